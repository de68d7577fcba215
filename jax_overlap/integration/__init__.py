"""The JAX integration of the ops: how their primitives are defined to JAX, lowered, partitioned and differentiated.

  primitives.py    the rules every GEMM op's primitive shares (impl, batching, refusals, lowering per platform)
  lowering.py      the GPU lowering: the custom call a call lowers to, once planning has chosen
  operands.py      the custom calls' operands: float8 w K-major, scales in the vendor GEMM's layouts, bias placement
  results.py       what an op's results are, by kind, and how each lowering produces them
  fp8_lowering.py  the fp8 cast's and step scales' kernels, or XLA's forms
  partitioning.py  global arrays under jit: custom partitioning with Shardy rules
  autodiff.py      what the ops' backward passes share (layouts of gradients, weight and bias gradients)
Nothing here names an op: each takes the Op (ops/op.py) it serves. Specs, plan pieces and meshes with Explicit axes
are ../_sharding.py's, below every layer.
"""
