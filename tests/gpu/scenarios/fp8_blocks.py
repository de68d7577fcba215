"""Scenario "fp8_blocks" (worlds 2 and 4): float8 ag_matmul and matmul_rs with block scales (1x128 for x, 128x128
for w), pipelined, across processes, every rank with block scales of its own, against float64 of the dequantized
operands (each element times its block's scale):
  ag_matmul   y, the gathered x (its bytes) and the gathered block scales (every shard's, which travel in its
              slot), w given [K, N] with K/128 = 5 blocks (the lowering transposes w and pads its scales' rows
              to 8), a bfloat16 bias (added by XLA after a float32 GEMM: no bias epilogue takes block scales);
              under every stage plan kind;
  matmul_rs   each rank's partial from its K blocks, a float32 bias added once in the reduction, every stage plan
              kind; the bits repeat from call to call.

  python tests/gpu/multiprocess.py --scenarios fp8_blocks     (about a minute on the H200 under MPS)
"""

from __future__ import annotations

import os

import numpy as np

from block_scales import dequantized as _value
from scenarios.common import Ctx
from scenarios.fp8 import stage_plans
from tolerance import close

ENV = {"JAX_OVERLAP_ON_TIMEOUT": "raise"}
WORLDS = (2, 4)
CHECKS = ("blocks_ag_matmul", "blocks_ag_matmul_gathered", "blocks_matmul_rs", "blocks_matmul_rs_bitwise_repeat")
BLOCK = 128


def required(rank: int, world: int) -> tuple:
  return CHECKS


def returncode(rank: int, world: int) -> int:
  return 0


def run(ctx: Ctx) -> None:
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  import jax_overlap as jo

  rng, world, rank, mesh = ctx.rng, ctx.world, ctx.rank, ctx.mesh
  e4m3, e5m2 = jnp.float8_e4m3fn, jnp.float8_e5m2
  scales = lambda shape: rng.uniform(0.3, 0.9, shape).astype(np.float32)  # noqa: E731

  # ag_matmul: rank q's rows of x with their block scales, its columns of w with theirs.
  m, k, n = 96, 5 * BLOCK, 2 * BLOCK
  X, W = rng.standard_normal((world * m, k)).astype(e4m3), rng.standard_normal((k, world * n)).astype(e5m2)
  B = rng.standard_normal((world * n,)).astype(jnp.bfloat16)
  SX, SW = scales((world * m, k // BLOCK)), scales((k // BLOCK, world * n // BLOCK)) / np.float32(np.sqrt(k))
  ag = jax.jit(jax.shard_map(
      lambda x, w, b, sx, sw: jo.ag_matmul(x, w, b, x_scale=sx, w_scale=sw, axis_name="tp", algorithm="pipelined",
                                           return_gathered=True),
      mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp"), P("tp"), P(None, "tp")),
      out_specs=(P(None, "tp"), P("tp"), P("tp"))))
  cols = slice(rank * n, (rank + 1) * n)
  want = _value(X, SX) @ _value(W, SW)[:, cols] + np.asarray(B[cols], np.float64)
  args = (ctx.shard(X, P("tp")), ctx.shard(W, P(None, "tp")), ctx.shard(B, P("tp")), ctx.shard(SX, P("tp")),
          ctx.shard(SW, P(None, "tp")))
  verdicts, gathered_ok = {}, []
  for stages in stage_plans(world)["ag_matmul"]:
    os.environ["JAX_OVERLAP_PIPELINE_STAGES"] = ",".join(map(str, stages))
    jax.clear_caches()
    y, gathered, gathered_scales = (ctx.local(r) for r in ag(*args))
    verdicts[stages] = close(y, want, jnp.bfloat16, k, float(SX.max() * SW.max()))
    gathered_ok.append(np.array_equal(gathered.view(np.uint8), X.view(np.uint8)) and
                       np.array_equal(gathered_scales, SX))
  ctx.check("blocks_ag_matmul", all(ok for ok, _ in verdicts.values()),
            "; ".join(f"stages {s}: {detail}" for s, (ok, detail) in verdicts.items() if not ok))
  ctx.check("blocks_ag_matmul_gathered", all(gathered_ok),
            f"gathered x and block scales right under each plan: {gathered_ok}")

  # matmul_rs: rank q's contraction slice of x (2 blocks of K) and its rows of w, each with their block scales.
  mb, kl, n = 48, 2 * BLOCK, 3 * BLOCK
  X = rng.standard_normal((world * mb, world * kl)).astype(e4m3)
  W = rng.standard_normal((world * kl, n)).astype(e4m3)
  B = rng.standard_normal((n,)).astype(np.float32)
  SX, SW = scales((world * mb, world * kl // BLOCK)), scales((world * kl // BLOCK, n // BLOCK))
  SW /= np.float32(np.sqrt(world * kl))
  args = (ctx.shard(X, P(None, "tp")), ctx.shard(W, P("tp", None)), ctx.shard(B, P()), ctx.shard(SX, P(None, "tp")),
          ctx.shard(SW, P("tp", None)))
  want = (_value(X, SX) @ _value(W, SW))[rank * mb:(rank + 1) * mb] + np.asarray(B, np.float64)
  rs = jax.jit(jax.shard_map(
      lambda x, w, b, sx, sw: jo.matmul_rs(x, w, b, x_scale=sx, w_scale=sw, axis_name="tp", algorithm="pipelined"),
      mesh=mesh, in_specs=(P(None, "tp"), P("tp", None), P(), P(None, "tp"), P("tp", None)), out_specs=P("tp")))
  verdicts, repeat = {}, {}
  for stages in stage_plans(world)["matmul_rs"]:
    os.environ["JAX_OVERLAP_PIPELINE_STAGES"] = ",".join(map(str, stages))
    jax.clear_caches()
    z1, z2 = ctx.local(rs(*args)), ctx.local(rs(*args))
    verdicts[stages] = close(z1, want, jnp.bfloat16, world * kl, float(SX.max() * SW.max()))
    repeat[stages] = np.array_equal(z1.view(np.uint8), z2.view(np.uint8))
  ctx.check("blocks_matmul_rs", all(ok for ok, _ in verdicts.values()),
            "; ".join(f"stages {s}: {detail}" for s, (ok, detail) in verdicts.items() if not ok))
  ctx.check("blocks_matmul_rs_bitwise_repeat", all(repeat.values()), f"bits repeat per plan: {repeat}")
  del os.environ["JAX_OVERLAP_PIPELINE_STAGES"]
  jax.clear_caches()
