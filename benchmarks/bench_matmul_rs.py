"""matmul_rs on one GPU: fused vs the XLA path vs cuBLAS, and emulated ranks (see _harness.py).

  python benchmarks/bench_matmul_rs.py [--out benchmarks/results] [--shapes M,N,K ...]
"""

import jax
from jax.sharding import PartitionSpec as P

import _harness
import jax_overlap as jo

SHAPES = [(1024, 8192, 3584), (16384, 8192, 3584)]  # (M total, N, K per rank): Llama-3-70B down projection, tp=8


def make_op(algorithm):
  def call(x, w):  # x [M, K] with K the reduced dim, w [K, N]
    body = lambda x, w: jo.matmul_rs(x, w, axis_name="tp", algorithm=algorithm)
    return jax.shard_map(body, mesh=_harness.one_gpu_mesh(), in_specs=(P(None, "tp"), P("tp", None)),
                         out_specs=P("tp", None))(x, w)
  return call


if __name__ == "__main__":
  _harness.run("matmul_rs", make_op, SHAPES)
