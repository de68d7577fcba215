"""Scenario "fp8" (worlds 2 and 4): float8 ag_matmul and matmul_rs, pipelined, across processes, every rank with
scales of its own (each quantized its shards with its own scale: no amax all-reduce), against float64 of the
dequantized operands (x.astype(float64) * x_scale):
  ag_matmul   y, the gathered x (its bytes) and the gathered scales (each shard's rank's x scale, in gathered
              order), w given [K, N] (the lowering transposes it), a bfloat16 bias; under every stage plan kind
              (a stage of several shards runs one GEMM per shard, each with its own scale); and with one x scale
              replicated to every rank (x_scale_shared: a stage's shards in one GEMM);
  matmul_rs   each rank's partial scaled by its own x and w scales, a float32 bias added once in the reduction,
              bfloat16 and float32 outputs, every stage plan kind; the bits repeat from call to call; with fast
              accumulation, bfloat16's tolerance.

  python tests/gpu/multiprocess.py --scenarios fp8     (about a minute on the H200 under MPS)
"""

from __future__ import annotations

import os

import numpy as np

from scenarios.common import Ctx
from tolerance import close

ENV = {"JAX_OVERLAP_ON_TIMEOUT": "raise"}
WORLDS = (2, 4)
CHECKS = ("fp8_ag_matmul", "fp8_ag_matmul_gathered", "fp8_ag_matmul_shared_scale",
          "fp8_matmul_rs_bfloat16", "fp8_matmul_rs_float32",
          "fp8_matmul_rs_bitwise_repeat", "fp8_matmul_rs_fast_accumulation")


def required(rank: int, world: int) -> tuple:
  return CHECKS


def returncode(rank: int, world: int) -> int:
  return 0


def stage_plans(world: int) -> dict:
  """Plans of each kind per op: one shard or block per stage, and all but ag_matmul's own in one stage."""
  return {"ag_matmul": [(1,) * world, (1, world - 1)], "matmul_rs": [(1,) * world, (world,)]}


def _f64(a):
  return np.asarray(np.asarray(a).astype(np.float32), np.float64)


def run(ctx: Ctx) -> None:
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  import jax_overlap as jo

  rng, world, rank, mesh = ctx.rng, ctx.world, ctx.rank, ctx.mesh
  e4m3, e5m2 = jnp.float8_e4m3fn, jnp.float8_e5m2
  scales = lambda: rng.uniform(0.3, 0.9, world).astype(np.float32)  # one per rank

  # ag_matmul: rank q's rows of x at scale sx[q], its columns of w at sw[q].
  m, k, n = 100, 512, 272
  X, W = rng.standard_normal((world * m, k)).astype(e4m3), rng.standard_normal((k, world * n)).astype(e5m2)
  B = rng.standard_normal((world * n,)).astype(jnp.bfloat16)
  sx, sw = scales(), scales() / np.float32(np.sqrt(k))
  ag = jax.jit(jax.shard_map(
      lambda x, w, b, sx, sw: jo.ag_matmul(x, w, b, x_scale=sx[0], w_scale=sw[0], out_dtype=jnp.bfloat16,
                                           axis_name="tp", algorithm="pipelined", return_gathered=True),
      mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp"), P("tp"), P("tp")),
      out_specs=(P(None, "tp"), P("tp"), P("tp"))))
  x_value = np.concatenate([_f64(X[q * m:(q + 1) * m]) * sx[q] for q in range(world)])
  cols = slice(rank * n, (rank + 1) * n)
  want = x_value @ (_f64(W[:, cols]) * sw[rank]) + _f64(B[cols])
  args = (ctx.shard(X, P("tp")), ctx.shard(W, P(None, "tp")), ctx.shard(B, P("tp")), ctx.shard(sx, P("tp")),
          ctx.shard(sw, P("tp")))
  verdicts, gathered_ok = {}, []
  for stages in stage_plans(world)["ag_matmul"]:
    os.environ["JAX_OVERLAP_PIPELINE_STAGES"] = ",".join(map(str, stages))
    jax.clear_caches()
    y, gathered, gathered_scales = (ctx.local(r) for r in ag(*args))
    verdicts[stages] = close(y, want, jnp.bfloat16, k, max(sx) * max(sw))
    gathered_ok.append(np.array_equal(gathered.view(np.uint8), X.view(np.uint8)) and
                       np.array_equal(gathered_scales, sx))
  ctx.check("fp8_ag_matmul", all(ok for ok, _ in verdicts.values()),
            "; ".join(f"stages {s}: {detail}" for s, (ok, detail) in verdicts.items() if not ok))
  ctx.check("fp8_ag_matmul_gathered", all(gathered_ok), f"gathered x and scales right under each plan: {gathered_ok}")

  # The same with one x scale on every rank, replicated into shard_map: the call says so (x_scale_shared), and its
  # stage of several shards is one GEMM scaled by the rank's own (equal) scale.
  shared = jax.jit(jax.shard_map(
      lambda x, w, b, sx, sw: jo.ag_matmul(x, w, b, x_scale=sx[0], w_scale=sw[0], out_dtype=jnp.bfloat16,
                                           axis_name="tp", algorithm="pipelined"),
      mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp"), P(), P("tp")), out_specs=P(None, "tp")))
  sx1 = sx[:1]
  args = (ctx.shard(X, P("tp")), ctx.shard(W, P(None, "tp")), ctx.shard(B, P("tp")), ctx.shard(sx1, P()),
          ctx.shard(sw, P("tp")))
  want = (_f64(X) * sx1[0]) @ (_f64(W[:, cols]) * sw[rank]) + _f64(B[cols])
  verdicts, lowered = {}, []
  for stages in stage_plans(world)["ag_matmul"]:
    os.environ["JAX_OVERLAP_PIPELINE_STAGES"] = ",".join(map(str, stages))
    jax.clear_caches()
    lowered.append("x_scale_shared = 1" in shared.lower(*args).as_text())
    verdicts[stages] = close(ctx.local(shared(*args)), want, jnp.bfloat16, k, sx1[0] * max(sw))
  ctx.check("fp8_ag_matmul_shared_scale", all(ok for ok, _ in verdicts.values()) and all(lowered),
            f"x_scale_shared in each call: {lowered}; " +
            "; ".join(f"stages {s}: {detail}" for s, (ok, detail) in verdicts.items() if not ok))

  # matmul_rs: rank q's contraction slice of x at scale sx[q], its rows of w at sw[q]; a float32 bias.
  mb, kl, n = 48, 256, 384
  X = rng.standard_normal((world * mb, world * kl)).astype(e4m3)
  W = rng.standard_normal((world * kl, n)).astype(e4m3)
  B = rng.standard_normal((n,)).astype(np.float32)
  sx, sw = scales(), scales() / np.float32(np.sqrt(world * kl))
  args = (ctx.shard(X, P(None, "tp")), ctx.shard(W, P("tp", None)), ctx.shard(B, P()), ctx.shard(sx, P("tp")),
          ctx.shard(sw, P("tp")))
  total = sum((_f64(X[:, q * kl:(q + 1) * kl]) * sx[q]) @ (_f64(W[q * kl:(q + 1) * kl]) * sw[q]) for q in range(world))
  want = total[rank * mb:(rank + 1) * mb] + _f64(B)
  for out_dtype in (jnp.bfloat16, jnp.float32):
    rs = jax.jit(jax.shard_map(
        lambda x, w, b, sx, sw: jo.matmul_rs(x, w, b, x_scale=sx[0], w_scale=sw[0], out_dtype=out_dtype,
                                             axis_name="tp", algorithm="pipelined"),
        mesh=mesh, in_specs=(P(None, "tp"), P("tp", None), P(), P("tp"), P("tp")), out_specs=P("tp")))
    verdicts, first = {}, {}
    for stages in stage_plans(world)["matmul_rs"]:
      os.environ["JAX_OVERLAP_PIPELINE_STAGES"] = ",".join(map(str, stages))
      jax.clear_caches()
      z1, z2 = ctx.local(rs(*args)), ctx.local(rs(*args))
      # Hopper's float8 MMA adds in about 14 bits between promotions: float16's tolerance for a float32 output.
      verdicts[stages] = close(z1, want, jnp.float16 if out_dtype == jnp.float32 else out_dtype, world * kl,
                               max(sx) * max(sw))
      first[stages] = np.array_equal(z1.view(np.uint8), z2.view(np.uint8))
    name = np.dtype(out_dtype).name
    ctx.check(f"fp8_matmul_rs_{name}", all(ok for ok, _ in verdicts.values()),
              "; ".join(f"stages {s}: {detail}" for s, (ok, detail) in verdicts.items() if not ok))
    if out_dtype == jnp.bfloat16:
      ctx.check("fp8_matmul_rs_bitwise_repeat", all(first.values()), f"bits repeat per plan: {first}")
  # Fast accumulation (the fp8 layers' forward): the pipelined call's config attribute reaches its GEMMs.
  rs_fast = jax.jit(jax.shard_map(
      lambda x, w, b, sx, sw: jo.matmul_rs(x, w, b, x_scale=sx[0], w_scale=sw[0], out_dtype=jnp.bfloat16,
                                           fast_accumulation=True, axis_name="tp", algorithm="pipelined"),
      mesh=mesh, in_specs=(P(None, "tp"), P("tp", None), P(), P("tp"), P("tp")), out_specs=P("tp")))
  lowered = "fast_accumulation = 1" in rs_fast.lower(*args).as_text()
  ok, detail = close(ctx.local(rs_fast(*args)), want, jnp.bfloat16, world * kl, max(sx) * max(sw))
  ctx.check("fp8_matmul_rs_fast_accumulation", ok and lowered, f"attribute lowered: {lowered}; {detail}")
  del os.environ["JAX_OVERLAP_PIPELINE_STAGES"]
  jax.clear_caches()
