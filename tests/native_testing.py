"""The harness module, jax_overlap._native_testing: what the tests and benchmarks drive beside the package's native
module (simulated ranks, loopback timings, fault injection, the constants the Python side mirrors).

CMakeLists.txt builds and installs it with jax_overlap._native; the package never imports it
(tests/test_native_surface.py).
"""

from __future__ import annotations

import importlib

from jax_overlap.runtime import native


def module():
  """The harness module; None on a pure-Python install. A native build without one is broken: ImportError."""
  return None if native.module() is None else importlib.import_module("jax_overlap._native_testing")
