"""Layers on the ops for layer libraries: dot_general callables (dot_general.py) and in float8 (fp8*.py)."""
