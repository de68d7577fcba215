"""Number formats and float8 scaling: what the ops' operands are, below planning and the JAX integration.

  formats.py     the dtype table: which dtypes the ops take and which paths run each; float8 families
  scaling.py     the scaling modes (tensor, block) as one type, and Scales, a call's scales by name
  numerics.py    a float8 operand's value, and the quantization the fp8 layers apply (current, block scaling)
  recipes.py     the fp8 layers' recipes (tensor, block, delayed scaling) as one type, and their registry
The cast to float8 as a primitive (the project's kernel or XLA's form) is an op: ops/fp8_cast.py.
"""
