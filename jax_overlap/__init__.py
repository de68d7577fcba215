"""jax_overlap: all-gather and reduce-scatter overlapped with GEMMs, for tensor parallelism in JAX.

  ag_matmul, matmul_rs          all-gather + GEMM, GEMM + reduce-scatter: the column- and row-parallel layers
  AgDotGeneral, RsDotGeneral    the ops as a layer's dot_general (flax Dense, DenseGeneral, nnx.Linear, attention)
  Fp8AgDotGeneral, Fp8RsDotGeneral  the same in float8, for training (bf16/f32 in, quantized each call)
  Fp8DelayedAgDotGeneral, Fp8DelayedRsDotGeneral  Flax's delayed-scaling fp8 dot on the ops (flax.linen modules)
  jax_overlap.maxtext           MaxText's dense layers on the ops (docs/maxtext.md)

Inside jax.shard_map (axis_name=...) or on sharded global arrays under jax.jit (axis_name=None), on any backend: a
GPU algorithm where it gains, else the XLA path (build_info() says which). Documentation: README.md and docs/.
"""

import importlib

from jax_overlap import remat, tracing
from jax_overlap._version import __version__
from jax_overlap.api import ag_matmul, all_gather, matmul_rs
from jax_overlap.layers.dot_general import AgDotGeneral, RsDotGeneral
from jax_overlap.layers.fp8 import Fp8AgDotGeneral, Fp8RsDotGeneral
from jax_overlap.runtime import settings as _settings
from jax_overlap.runtime.errors import PeerTimeoutError, WorkspaceFullError
from jax_overlap.runtime.native import build_info, gpu_available
from jax_overlap.runtime.workspace import check_errors, clear_errors, initialize, shutdown, workspace_info

_settings.check_all()

# The delayed-scaling layers are flax modules: flax is imported on first use, not with jax_overlap.
_ON_USE = {"Fp8DelayedAgDotGeneral": "jax_overlap.layers.fp8_delayed",
           "Fp8DelayedRsDotGeneral": "jax_overlap.layers.fp8_delayed"}


def __getattr__(name):
  if name in _ON_USE:
    return getattr(importlib.import_module(_ON_USE[name]), name)
  raise AttributeError(f"module 'jax_overlap' has no attribute {name!r}")


__all__ = [
    "ag_matmul", "matmul_rs", "AgDotGeneral", "RsDotGeneral", "Fp8AgDotGeneral", "Fp8RsDotGeneral",
    "Fp8DelayedAgDotGeneral", "Fp8DelayedRsDotGeneral", "all_gather",
    "remat", "build_info", "gpu_available", "initialize", "shutdown", "workspace_info", "check_errors",
    "clear_errors", "PeerTimeoutError", "WorkspaceFullError", "tracing", "__version__",
]
