"""The ops' primitives to JAX (rules, lowering, partitioning, autodiff); each function takes the Op it serves."""


