"""Failures across processes (the second part of scenario "main", JAX_OVERLAP_ON_TIMEOUT=raise).

  5. a straggler: rank 1 sleeps 3 s (far beyond any spin, well within the watchdog) before a call: right
     results; two call sites sharing a region run in different orders on even and odd ranks (fused,
     pipelined): the call-site error and NaN on every rank; after clear_errors() the next call is right;
  6. shutdown(): a call compiled before refuses to run; compiled again after initialize(), it is right;
  7. the last rank enqueues a call and exits at once (dies mid-call); every survivor's calls then fail with
     the watchdog error (rank, peer, flag) within the timeout, their outputs are NaN, and check_errors()
     raises it. The process ends here (os._exit: a peer is gone, jax.distributed's exit barrier would hang).
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from scenarios.common import DEATH_WATCHDOG_SECONDS, Ctx, all_nan
from tolerance import close

CHECKS = ("straggler", "call_sites_out_of_order_fused", "in_step_after_clear_errors_fused",
          "call_sites_out_of_order_pipelined", "in_step_after_clear_errors_pipelined",
          "old_call_refused_after_shutdown", "recompiled_after_shutdown")
# The survivors' checks of step 7; the rank that dies reports "dies_mid_call" instead.
DEATH_CHECKS = ("peer_death_raises", "peer_death_within_watchdog", "peer_death_outputs_nan", "check_errors_raises")


def required(rank: int, world: int) -> tuple:
  return CHECKS + (DEATH_CHECKS if rank < world - 1 else ("dies_mid_call",))


def run(ctx: Ctx) -> None:
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  import jax_overlap as jo

  rank, world, rng, shard, local, check = ctx.rank, ctx.world, ctx.rng, ctx.shard, ctx.local, ctx.check

  # 5. A straggler: late by seconds, within the watchdog, and nothing is lost.
  m, k, n = 64, 256, 128
  X = rng.standard_normal((world * m, k)).astype(jnp.bfloat16)
  W = (rng.standard_normal((k, world * n)) / np.sqrt(k)).astype(jnp.bfloat16)
  ag = ctx.ag_fn("pipelined")
  args = (shard(X, P("tp")), shard(W, P(None, "tp")))
  jax.block_until_ready(ag(*args))
  if rank == 1:
    time.sleep(3.0)
  y, _ = ag(*args)
  ref = np.asarray(X, np.float64) @ np.asarray(W, np.float64)[:, rank * n:(rank + 1) * n]
  right = lambda y: close(local(y), ref, jnp.bfloat16, k, k ** -0.5)
  straggled, detail = right(y)
  try:
    jo.check_errors()
    no_error = True
  except jo.PeerTimeoutError as e:
    no_error, detail = False, str(e)
  check("straggler", no_error and straggled, detail)

  # 5b. Two call sites of one shape share a region (two programs: a site is named by its program and its place
  # in it); even ranks run the first where odd ranks run the second: every rank gets the call-site error and
  # NaN, never the other call's data. clear_errors() puts the ranks back in step.
  for algorithm in ("fused", "pipelined"):
    first, second = (ctx.ag_fn(algorithm, name=f"{name}_{algorithm}").lower(*args).compile()
                     for name in ("first", "second"))  # lowered alike everywhere
    y, _ = (first if rank % 2 == 0 else second)(*args)
    nan = all_nan(local(y))
    try:
      jo.check_errors()
      err = "no error"
    except jo.PeerTimeoutError as e:
      err = str(e)
    check(f"call_sites_out_of_order_{algorithm}", "another call site" in err and nan, f"NaN {nan}: {err[:300]}")
    jo.clear_errors()
    y, _ = first(*args)
    check(f"in_step_after_clear_errors_{algorithm}", *right(y))

  # 6. shutdown(): compiled calls refuse; compiled again, they run.
  jo.shutdown()
  try:
    jax.block_until_ready(ag(*args))
    check("old_call_refused_after_shutdown", False, "the old call ran")
  except Exception as e:  # XlaRuntimeError
    check("old_call_refused_after_shutdown", "shutdown() freed" in str(e), str(e)[:300])
  jax.clear_caches()
  jo.initialize()
  y, _ = ctx.ag_fn("pipelined")(*args)
  check("recompiled_after_shutdown", *right(y))

  # 7. A peer dies in the middle of a call: survivors fail within the watchdog, they do not hang.
  jo.initialize(watchdog_seconds=DEATH_WATCHDOG_SECONDS)
  ag = ctx.ag_fn("pipelined")
  for _ in range(3):
    jax.block_until_ready(ag(*args))
  if rank == world - 1:
    ag(*args)  # enqueued, not finished: the process ends under it
    check("dies_mid_call", True)
    os._exit(0)
  t0 = time.monotonic()
  err, nan_outputs = None, False
  for _ in range(20):
    y, g = ag(*args)
    try:
      jax.block_until_ready(y)
      nan_outputs = nan_outputs or all_nan(local(y))
    except Exception as e:  # XlaRuntimeError carrying the watchdog record
      err = str(e)
      break
  waited = time.monotonic() - t0
  check("peer_death_raises", err is not None and "timed out" in err and f"rank {world - 1}" in err,
        (err or "no error")[:300])
  check("peer_death_within_watchdog", waited < DEATH_WATCHDOG_SECONDS + 10.0, f"{waited:.1f} s")
  check("peer_death_outputs_nan", nan_outputs, "the timed-out call's output was NaN" if nan_outputs else "not NaN")
  try:
    jo.check_errors()
    check("check_errors_raises", False, "no PeerTimeoutError")
  except jo.PeerTimeoutError as e:
    check("check_errors_raises", e.record["peer"] == world - 1, json.dumps(e.record))
  os._exit(0)  # skip jax.distributed's exit barrier: a peer is gone
