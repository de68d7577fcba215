"""ag_matmul on one GPU: fused vs the XLA path vs cuBLAS, and emulated ranks (see _harness.py).

  python benchmarks/bench_ag_matmul.py [--out benchmarks/results] [--shapes M,N,K ...]
"""

import jax
from jax.sharding import PartitionSpec as P

import _harness
import jax_overlap as jo

SHAPES = [(1024, 3584, 8192), (16384, 3584, 8192)]  # (M total, N, K): Llama-3-70B MLP up-projection, tp=8


def make_op(algorithm):
  def call(x, w):  # x [M, K] gathered over rows, w [K, N]
    body = lambda x, w: jo.ag_matmul(x, w, axis_name="tp", algorithm=algorithm)
    return jax.shard_map(body, mesh=_harness.one_gpu_mesh(), in_specs=(P("tp"), P(None, "tp")),
                         out_specs=P(None, "tp"))(x, w)
  return call


if __name__ == "__main__":
  _harness.run("ag_matmul", make_op, SHAPES)
