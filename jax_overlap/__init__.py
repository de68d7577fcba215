"""jax_overlap: fused communication + GEMM kernels for tensor parallelism in JAX.

  ag_matmul  all-gather + GEMM (column-parallel linear)
  matmul_rs  GEMM + reduce-scatter (row-parallel linear)

Use them inside jax.shard_map (axis_name=...) or on sharded global arrays under
jax.jit (axis_name=None). See README.md.
"""

from jax_overlap import tracing
from jax_overlap.api import ag_matmul, all_gather, matmul_rs
from jax_overlap.native import build_info, fused_available
from jax_overlap.runtime import (PeerTimeoutError, WorkspaceFullError, check_errors, clear_errors, initialize,
                                 shutdown, workspace_info)

__version__ = "0.1.0"

__all__ = [
    "ag_matmul", "matmul_rs", "all_gather", "build_info", "fused_available", "initialize", "shutdown", "workspace_info",
    "check_errors", "clear_errors", "PeerTimeoutError", "WorkspaceFullError", "tracing", "__version__",
]
