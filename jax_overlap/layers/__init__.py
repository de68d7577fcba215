"""Layers on the ops for layer libraries: dot_general callables in 16-bit and float32 (dot_general.py) and float8
(fp8.py, fp8_delayed.py)."""
