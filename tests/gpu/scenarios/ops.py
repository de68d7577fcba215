"""The ops across processes, every result against float64 NumPy (the first part of scenario "main").

  1. the all_gather custom call inside shard_map: 1000 calls in a row, every result checked;
  2. fused ag_matmul (with the gathered x) and matmul_rs;
  3. pipelined ag_matmul and matmul_rs, bf16 and fp16, odd rows, batch dims, bias; matmul_rs twice: identical
     bits; every kind of stage plan pinned (JAX_OVERLAP_PIPELINE_STAGES), with ag_matmul's dx (matmul_rs,
     w K-major); 1000 pipelined calls back to back on changing inputs, all checked;
  4. the VJP of a TP MLP (ag_matmul -> gelu -> matmul_rs), fused and pipelined.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from scenarios.common import Ctx, gelu, gelu_grad
from tolerance import close, rms

CHECKS = (
    "initialize", "all_gather_1000_calls", "ag_matmul", "ag_matmul_gathered", "matmul_rs", "matmul_rs_bitwise_repeat",
    "pipelined_ag_matmul_bfloat16", "pipelined_ag_matmul_float16", "pipelined_ag_matmul_gathered",
    "pipelined_matmul_rs_bfloat16", "pipelined_matmul_rs_float16", "pipelined_matmul_rs_bitwise_repeat",
    "pipelined_stage_plans", "pipelined_1000_calls", "mlp_vjp_fused", "mlp_vjp_pipelined")


def stage_plans(world: int) -> list:
  """Pipelined stage plans that exercise every path: one chunk per stage, all peers in one stage, a stage that
  wraps past the last rank, and (matmul_rs only: ag_matmul's first stage is its own shard) one stage of all."""
  plans = {(1,) * world, (1, world - 1), (world,)}
  if world >= 4:
    plans.add((1, 2, world - 3))
  return sorted(plans)


def run(ctx: Ctx) -> None:
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  import jax_overlap as jo

  rank, world, rng, shard, local, check = ctx.rank, ctx.world, ctx.rng, ctx.shard, ctx.local, ctx.check
  info = jo.initialize()
  check("initialize", info["active"] and len(info["reachable_devices"]) == world, json.dumps(info["devices"]))

  # 1. all_gather, 1000 calls.
  m, c = 64, 128
  base = rng.standard_normal((world * m, c)).astype(np.float32)
  gather = jax.jit(jax.shard_map(lambda x, i: jo.all_gather(x + i, axis_name="tp")[None], mesh=ctx.mesh,
                                 in_specs=(P("tp"), P()), out_specs=P("tp")))
  x = shard(base, P("tp"))
  bad = []
  t0 = time.perf_counter()
  for i in range(1000):
    got = local(gather(x, shard(np.array(i, np.float32), P())))[0]
    if not np.array_equal(got, base + np.float32(i)):
      bad.append(i)
  check("all_gather_1000_calls", not bad, f"{len(bad)} bad calls; {(time.perf_counter() - t0) * 1e3:.0f} ms")

  # 2. fused ag_matmul and matmul_rs.
  m, k, n = 192, 512, 256
  X = rng.standard_normal((world * m, k)).astype(jnp.bfloat16)
  W = (rng.standard_normal((k, world * n)) / np.sqrt(k)).astype(jnp.bfloat16)
  y, g = ctx.ag_fn("fused")(shard(X, P("tp")), shard(W, P(None, "tp")))
  ref = np.asarray(X, np.float64) @ np.asarray(W, np.float64)[:, rank * n:(rank + 1) * n]
  check("ag_matmul", *close(local(y), ref, jnp.bfloat16, k, k ** -0.5))
  check("ag_matmul_gathered", np.array_equal(local(g), np.asarray(X)), "")
  Mt, kl, N = world * 96, 256, 384
  Xr = rng.standard_normal((Mt, world * kl)).astype(jnp.bfloat16)
  Wr = (rng.standard_normal((world * kl, N)) / np.sqrt(world * kl)).astype(jnp.bfloat16)
  rs = ctx.rs_fn("fused")
  xr, wr = shard(Xr, P(None, "tp")), shard(Wr, P("tp", None))
  z1, z2 = local(rs(xr, wr)), local(rs(xr, wr))
  ref = (np.asarray(Xr, np.float64) @ np.asarray(Wr, np.float64))[rank * 96:(rank + 1) * 96]
  check("matmul_rs", *close(z1, ref, jnp.bfloat16, world * kl, (world * kl) ** -0.5))
  check("matmul_rs_bitwise_repeat", np.array_equal(z1.view(np.uint16), z2.view(np.uint16)), "")

  # 3. pipelined: odd rows, a batch dim, bias, both 16-bit dtypes.
  for dtype in (jnp.bfloat16, jnp.float16):
    name = np.dtype(dtype).name
    m, k, n = 37, 520, 136
    X = rng.standard_normal((2, world * m, k)).astype(dtype)
    W = (rng.standard_normal((k, world * n)) / np.sqrt(k)).astype(dtype)
    B = rng.standard_normal((world * n,)).astype(dtype)
    y, g = ctx.ag_fn("pipelined", bias=True, lead=1)(shard(X, P(None, "tp")), shard(W, P(None, "tp")),
                                                     shard(B, P("tp")))
    cols = slice(rank * n, (rank + 1) * n)
    ref = np.asarray(X, np.float64) @ np.asarray(W, np.float64)[:, cols] + np.asarray(B, np.float64)[cols]
    check(f"pipelined_ag_matmul_{name}", *close(local(y), ref, dtype, k, k ** -0.5))
    if dtype == jnp.bfloat16:
      check("pipelined_ag_matmul_gathered", np.array_equal(local(g), np.asarray(X)), "")
    Mt, kl, N = world * 37, 264, 136
    Xr = rng.standard_normal((2, Mt, world * kl)).astype(dtype)
    Wr = (rng.standard_normal((world * kl, N)) / np.sqrt(world * kl)).astype(dtype)
    Br = rng.standard_normal((N,)).astype(dtype)
    rsp = ctx.rs_fn("pipelined", bias=True, lead=1)
    args = (shard(Xr, P(None, None, "tp")), shard(Wr, P("tp", None)), shard(Br, P()))
    z1, z2 = local(rsp(*args)), local(rsp(*args))
    ref = (np.asarray(Xr, np.float64) @ np.asarray(Wr, np.float64))[:, rank * 37:(rank + 1) * 37] + \
        np.asarray(Br, np.float64)
    check(f"pipelined_matmul_rs_{name}", *close(z1, ref, dtype, world * kl, (world * kl) ** -0.5))
    if dtype == jnp.bfloat16:
      check("pipelined_matmul_rs_bitwise_repeat", np.array_equal(z1.view(np.uint16), z2.view(np.uint16)), "")

  # 3b. every kind of stage plan, pinned: both ops, odd rows, a batch dim, bias; and ag_matmul's dx (a
  # pipelined matmul_rs with w transposed, K-major) under the same plan.
  m, k, n = 37, 520, 136
  X = rng.standard_normal((2, world * m, k)).astype(jnp.bfloat16)
  W = (rng.standard_normal((k, world * n)) / np.sqrt(k)).astype(jnp.bfloat16)
  B = rng.standard_normal((world * n,)).astype(jnp.bfloat16)
  DY = rng.standard_normal((2, world * m, world * n)).astype(jnp.bfloat16)
  Xr = rng.standard_normal((2, world * m, world * 264)).astype(jnp.bfloat16)
  Wr = (rng.standard_normal((world * 264, n)) / np.sqrt(world * 264)).astype(jnp.bfloat16)
  x64, w64, b64, dy64 = (np.asarray(a, np.float64) for a in (X, W, B, DY))
  cols, rows = slice(rank * n, (rank + 1) * n), slice(rank * m, (rank + 1) * m)
  ag_dx = jax.jit(jax.shard_map(
      lambda x, w, b, dy: jax.vjp(lambda x: jo.ag_matmul(x, w, b, axis_name="tp", algorithm="pipelined"), x)[1](dy)[0],
      mesh=ctx.mesh, in_specs=(P(None, "tp"), P(None, "tp"), P("tp"), P(None, None, "tp")), out_specs=P(None, "tp")))
  verdicts = {}  # (ok, detail) of each op and plan
  for stages in stage_plans(world):
    os.environ["JAX_OVERLAP_PIPELINE_STAGES"] = ",".join(map(str, stages))
    jax.clear_caches()
    if stages[0] == 1:
      y, _ = ctx.ag_fn("pipelined", bias=True, lead=1)(shard(X, P(None, "tp")), shard(W, P(None, "tp")),
                                                       shard(B, P("tp")))
      dx = ag_dx(shard(X, P(None, "tp")), shard(W, P(None, "tp")), shard(B, P("tp")), shard(DY, P(None, None, "tp")))
      verdicts[f"ag {stages}"] = close(local(y), x64 @ w64[:, cols] + b64[cols], jnp.bfloat16, k, k ** -0.5)
      # dx = dy @ w^T: world * n terms of dy (unit) times w (k ** -0.5)
      verdicts[f"ag dx {stages}"] = close(local(dx), (dy64 @ w64.T)[:, rows], jnp.bfloat16, world * n, k ** -0.5)
    z = ctx.rs_fn("pipelined", lead=1)(shard(Xr, P(None, None, "tp")), shard(Wr, P("tp", None)))
    verdicts[f"rs {stages}"] = close(local(z), (np.asarray(Xr, np.float64) @ np.asarray(Wr, np.float64))[:, rows],
                                     jnp.bfloat16, world * 264, (world * 264) ** -0.5)
  del os.environ["JAX_OVERLAP_PIPELINE_STAGES"]
  jax.clear_caches()
  check("pipelined_stage_plans", all(ok for ok, _ in verdicts.values()),
        "; ".join(f"{name}: {detail}" for name, (ok, detail) in verdicts.items() if not ok))

  # 1000 pipelined calls back to back, each on new inputs, each checked.
  m, k, n = 32, 128, 64
  X = rng.standard_normal((world * m, k)).astype(jnp.bfloat16)
  W = (rng.standard_normal((k, world * n)) / np.sqrt(k)).astype(jnp.bfloat16)
  agp = jax.jit(jax.shard_map(lambda x, w, i: jo.ag_matmul(x + i, w, axis_name="tp", algorithm="pipelined"),
                              mesh=ctx.mesh, in_specs=(P("tp"), P(None, "tp"), P()), out_specs=P(None, "tp")))
  xs, ws = shard(X, P("tp")), shard(W, P(None, "tp"))
  w_local = np.asarray(W, np.float64)[:, rank * n:(rank + 1) * n]
  outs = [agp(xs, ws, shard(np.array(i % 7, jnp.bfloat16), P())) for i in range(1000)]
  # x + i: terms of (1 + i) times w (k ** -0.5)
  bad = [i for i, out in enumerate(outs)
         if not close(local(out), np.asarray((X.astype(np.float32) + i % 7).astype(jnp.bfloat16), np.float64) @ w_local,
                      jnp.bfloat16, k, (1 + i % 7) * k ** -0.5)[0]]
  check("pipelined_1000_calls", not bad, f"{len(bad)} bad calls, first {bad[:5]}")

  # 4. VJP of a TP MLP through both ops (no bias: nothing replicated, so no XLA psum).
  m, d, f = 64, 256, 128
  Xm = rng.standard_normal((world * m, d)).astype(jnp.bfloat16)
  W1 = (rng.standard_normal((d, world * f)) / np.sqrt(d)).astype(jnp.bfloat16)
  W2 = (rng.standard_normal((world * f, d)) / np.sqrt(world * f)).astype(jnp.bfloat16)
  DY = rng.standard_normal((world * m, d)).astype(jnp.bfloat16)
  x64, w1, w2, dy = (np.asarray(a, np.float64) for a in (Xm, W1, W2, DY))
  pre = x64 @ w1
  h = gelu(pre)
  dpre = (dy @ w2.T) * gelu_grad(pre)
  want = {"dx": (dpre @ w1.T)[rank * m:(rank + 1) * m], "dw1": (x64.T @ dpre)[:, rank * f:(rank + 1) * f],
          "dw2": (h.T @ dy)[rank * f:(rank + 1) * f]}
  for algorithm in ("fused", "pipelined"):
    def mlp(x, w1, w2, algorithm=algorithm):
      h = jax.nn.gelu(jo.ag_matmul(x, w1, axis_name="tp", algorithm=algorithm))
      return jo.matmul_rs(h, w2, axis_name="tp", algorithm=algorithm)

    fn = jax.shard_map(mlp, mesh=ctx.mesh, in_specs=(P("tp"), P(None, "tp"), P("tp", None)), out_specs=P("tp"))
    args = (shard(Xm, P("tp")), shard(W1, P(None, "tp")), shard(W2, P("tp", None)))
    grads = jax.jit(lambda x, w1, w2, dy: jax.vjp(fn, x, w1, w2)[1](dy))(*args, shard(DY, P("tp")))
    # three rounded stages (matmul, gelu, matmul) against float64, as in tests/test_mlp.py
    verdicts = {name: close(local(got), want[name], jnp.bfloat16, 1, 3 * rms(want[name]))
                for name, got in zip(("dx", "dw1", "dw2"), grads)}
    check(f"mlp_vjp_{algorithm}", all(ok for ok, _ in verdicts.values()),
          json.dumps({name: detail for name, (ok, detail) in verdicts.items()}))
