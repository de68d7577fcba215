"""The JAX integration of the ops: how their primitives are defined to JAX, lowered, partitioned and differentiated.
Nothing here names an op: each function takes the Op (ops/op.py) it serves."""


