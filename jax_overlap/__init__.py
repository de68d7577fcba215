"""jax_overlap: fused communication + GEMM kernels for tensor parallelism in JAX.

  ag_matmul     all-gather + GEMM (column-parallel linear)
  matmul_rs     GEMM + reduce-scatter (row-parallel linear)
  AgDotGeneral  ag_matmul as a layer's dot_general (flax Dense, DenseGeneral, nnx.Linear, attention qkv)
  RsDotGeneral  matmul_rs as a layer's dot_general (the row-parallel projections)
  Fp8AgDotGeneral, Fp8RsDotGeneral  the same layers in float8 for training (bf16/f32 in, quantized each call)

Use them inside jax.shard_map (axis_name=...) or on sharded global arrays under
jax.jit (axis_name=None). Checkpoint names of the results: jax_overlap.remat. See README.md.
"""

from jax_overlap import remat, tracing
from jax_overlap.api import ag_matmul, all_gather, matmul_rs
from jax_overlap.errors import PeerTimeoutError, WorkspaceFullError
from jax_overlap.linear import AgDotGeneral, Fp8AgDotGeneral, Fp8RsDotGeneral, RsDotGeneral
from jax_overlap.native import build_info, gpu_available
from jax_overlap.runtime import check_errors, clear_errors, initialize, shutdown, workspace_info

__version__ = "0.1.0"

__all__ = [
    "ag_matmul", "matmul_rs", "AgDotGeneral", "RsDotGeneral", "Fp8AgDotGeneral", "Fp8RsDotGeneral", "all_gather", "remat", "build_info", "gpu_available",
    "initialize", "shutdown", "workspace_info", "check_errors", "clear_errors", "PeerTimeoutError",
    "WorkspaceFullError", "tracing", "__version__",
]
