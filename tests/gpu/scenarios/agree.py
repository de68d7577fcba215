"""Scenario "agree" (world 2): every process decides each call alike, whatever each one meets.

  1. The last rank cannot set the workspace up (it asks for 16 TiB: out of memory). An explicit
     algorithm raises on every process, naming that process, within seconds (not after the 120 s
     key-value timeout, no process left waiting in the handle exchange); auto then takes the XLA path
     on every process, at once. After shutdown() on every process and a workspace that fits, the same
     call is right.
  2. auto's decisions for calls of several shapes, both ops, are the same on every process (their
     lowered custom calls compared through the key-value store); those that took a GPU path run right.
  3. Rank 0 alone lowers and compiles a program once more before every rank runs it (as when looking at
     its HLO: shard_map with ShapeDtypeStructs, global arrays with other compiler options): every rank's
     results are right and no call-site error is raised (call sites are named by where they sit, not by
     how often a process lowered them).
XLA's own collectives cannot run here (one GPU), so only calls lowered to jax_overlap's custom calls run.
About a minute on the H200.
"""

from __future__ import annotations

import hashlib
import os
import time

import numpy as np

from scenarios.common import Ctx
from tolerance import close

ENV = {"JAX_OVERLAP_ON_TIMEOUT": "raise"}
WORLDS = (2,)
CHECKS = ("failed_setup_raises_everywhere", "failed_setup_within_seconds", "failed_setup_auto_takes_xla",
          "right_after_shutdown", "auto_decisions_alike", "auto_gpu_paths_right", "relowered_shard_map_right",
          "relowered_global_right")
# Bound on a failed set-up's decision: far below the key-value timeout a waiting process would show.
PROMPT_SECONDS = 30.0


def required(rank: int, world: int) -> tuple:
  return CHECKS


def returncode(rank: int, world: int) -> int:
  return 0


def _custom_calls(text: str) -> list:
  return [line.strip() for line in text.splitlines() if "stablehlo.custom_call @jax_overlap" in line]


def _same_everywhere(ctx: Ctx, name: str, value: str) -> bool:
  """Whether every process has the same `value` (compared with process 0's through the key-value store)."""
  from jax_overlap import _compat

  client = _compat.kv_client()
  digest = hashlib.sha1(value.encode()).hexdigest()
  client.key_value_set(f"agree_scenario/{name}/{ctx.rank}", digest)
  return all(client.blocking_key_value_get(f"agree_scenario/{name}/{p}", 60_000) == digest for p in range(ctx.world))


def _no_error() -> str:
  import jax_overlap as jo

  try:
    jo.check_errors()
    return ""
  except jo.PeerTimeoutError as e:
    return str(e)


def run(ctx: Ctx) -> None:
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  import jax_overlap as jo

  rank, world, rng, shard, local, check = ctx.rank, ctx.world, ctx.rng, ctx.shard, ctx.local, ctx.check
  m, k, n = 64, 256, 128
  X = rng.standard_normal((world * m, k)).astype(jnp.bfloat16)
  W = (rng.standard_normal((k, world * n)) / np.sqrt(k)).astype(jnp.bfloat16)
  args = (shard(X, P("tp")), shard(W, P(None, "tp")))
  ref = np.asarray(X, np.float64) @ np.asarray(W, np.float64)[:, rank * n:(rank + 1) * n]

  # 1. A set-up that fails on one process fails on every process, at once.
  fitting = os.environ["JAX_OVERLAP_WORKSPACE_BYTES"]
  if rank == world - 1:
    os.environ["JAX_OVERLAP_WORKSPACE_BYTES"] = str(1 << 44)
  t0 = time.monotonic()
  try:
    ctx.ag_fn("pipelined", name="explicit").lower(*args)
    err = "no error"
  except ValueError as e:
    err = str(e)
  waited = time.monotonic() - t0
  check("failed_setup_raises_everywhere", "could not be set up" in err and f"process {world - 1}" in err, err[:400])
  check("failed_setup_within_seconds", waited < PROMPT_SECONDS, f"{waited:.1f} s")
  t0 = time.monotonic()
  calls = _custom_calls(ctx.ag_fn("auto", name="automatic").lower(*args).as_text())
  check("failed_setup_auto_takes_xla", calls == [] and time.monotonic() - t0 < PROMPT_SECONDS,
        f"{len(calls)} custom calls, {time.monotonic() - t0:.1f} s")
  os.environ["JAX_OVERLAP_WORKSPACE_BYTES"] = fitting
  jo.shutdown()
  jax.clear_caches()
  y, _ = ctx.ag_fn("pipelined", name="explicit")(*args)
  err = _no_error()
  ok, detail = close(local(y), ref, jnp.bfloat16, k, k ** -0.5)
  check("right_after_shutdown", not err and ok, err[:300] or detail)

  # 2. auto decides alike on every process; what took a GPU path runs right.
  lowered, verdicts = [], {}
  for rows, kk, nn in ((64, 256, 128), (512, 1024, 512), (2048, 2048, 1024)):
    Xa = rng.standard_normal((world * rows, kk)).astype(jnp.bfloat16)
    Wa = (rng.standard_normal((kk, world * nn)) / np.sqrt(kk)).astype(jnp.bfloat16)
    Xr = rng.standard_normal((world * rows, world * kk)).astype(jnp.bfloat16)
    Wr = (rng.standard_normal((world * kk, nn)) / np.sqrt(world * kk)).astype(jnp.bfloat16)
    for op, fn, operands in (("ag", ctx.ag_fn("auto"), (shard(Xa, P("tp")), shard(Wa, P(None, "tp")))),
                             ("rs", ctx.rs_fn("auto"), (shard(Xr, P(None, "tp")), shard(Wr, P("tp", None))))):
      calls = _custom_calls(fn.lower(*operands).as_text())
      lowered.append(f"{op} {rows}x{kk}x{nn}: " + " | ".join(calls))
      if not calls:
        continue  # the XLA path: its collectives cannot run on one GPU
      if op == "ag":
        out = local(fn(*operands)[0])
        want = np.asarray(Xa, np.float64) @ np.asarray(Wa, np.float64)[:, rank * nn:(rank + 1) * nn]
        terms, scale = kk, kk ** -0.5
      else:
        out = local(fn(*operands))
        want = (np.asarray(Xr, np.float64) @ np.asarray(Wr, np.float64))[rank * rows:(rank + 1) * rows]
        terms, scale = world * kk, (world * kk) ** -0.5
      verdicts[f"{op} {rows}x{kk}x{nn}"] = close(out, want, jnp.bfloat16, terms, scale)
  taken = sum(1 for line in lowered if "custom_call" in line)
  check("auto_decisions_alike", _same_everywhere(ctx, "auto", "\n".join(lowered)),
        f"{taken} of {len(lowered)} calls on a GPU path")
  err = _no_error()
  check("auto_gpu_paths_right", not err and all(ok for ok, _ in verdicts.values()), err[:300] or str(verdicts))

  # 3. Rank 0 alone lowers and compiles each program once more before every rank runs it.
  inspected = ctx.ag_fn("pipelined", name="inspected")
  if rank == 0:
    inspected.lower(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (X, W))).compile()
  y, _ = inspected(*args)
  err = _no_error()
  ok, detail = close(local(y), ref, jnp.bfloat16, k, k ** -0.5)
  check("relowered_shard_map_right", not err and ok, err[:300] or detail)
  global_fn = jax.jit(lambda x, w: jo.ag_matmul(x, w, algorithm="pipelined"))
  try:
    if rank == 0:
      global_fn.lower(*args).compile({"xla_embed_ir_in_executable": True})  # another compile: partitioned again
    y = global_fn(*args)
    err = _no_error()
    ok, detail = close(local(y), ref, jnp.bfloat16, k, k ** -0.5)
    ok, detail = not err and ok, err[:300] or detail
  except Exception as e:  # a compile or run failure is this check's failure
    ok, detail = False, f"{type(e).__name__}: {e}"[:400]
  check("relowered_global_right", ok, detail)
