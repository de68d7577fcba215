"""Layers on the ops, for layer libraries (the top of the package).

  dot_general.py   AgDotGeneral, RsDotGeneral: the ops behind lax.dot_general's signature (16-bit and float32)
  fp8.py           Fp8AgDotGeneral, Fp8RsDotGeneral: the same layers in float8 for training (current and block
                   scaling)
"""
