"""Layers on the ops, for layer libraries (below jax_overlap.maxtext, the top of the package).

  dot_general.py   AgDotGeneral, RsDotGeneral: the ops behind lax.dot_general's signature (16-bit and float32)
  fp8.py           Fp8AgDotGeneral, Fp8RsDotGeneral: the same layers in float8 for training, and the custom VJP
                   every recipe runs (quantization/recipes.py)
  fp8_delayed.py   Fp8DelayedAgDotGeneral, Fp8DelayedRsDotGeneral: flax.linen modules with Flax's delayed-scaling
                   fp8 state and update rule (Fp8DirectDotGeneralOp's) on the same ops; they import flax
"""
