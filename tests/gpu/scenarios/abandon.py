"""Scenario "abandon" (world 2, JAX_OVERLAP_ON_TIMEOUT=raise, a 60 s watchdog): a pipelined call that one rank
cannot enqueue (issue 24, item 3). For each op, after two calls on both ranks:

  1. rank 1's vendor GEMM plans cannot be made (fault "pipelined_plan_fail"): rank 1's call raises at once naming
     the cause; rank 0's call ends within seconds, not the watchdog, with NaN outputs and an error naming rank 1;
  2. rank 1's enqueue fails right after its first release to rank 0 (fault "pipelined_fail_after_release", as a
     failed launch would): the same on rank 1; rank 0 ends within seconds, right (rank 1's data was complete when
     rank 0 read it) or NaN with the error, never wrong;
after each, both ranks clear_errors() and the next call is right.

On the code before the fix (the faults exist since the commit "test hooks"), rank 1 made its GEMM plans while
enqueuing, after taking the epoch, and left rank 0 waiting for its flags until the watchdog: "peer_fails_promptly_*"
fails (60 s).
"""

from __future__ import annotations

import time

import numpy as np

from scenarios.common import Ctx, all_nan, recorded_error
from tolerance import close

ENV = {"JAX_OVERLAP_ON_TIMEOUT": "raise", "JAX_OVERLAP_WATCHDOG_SECONDS": "60"}
WORLDS = (2,)
PROMPT_S = 10.0  # a peer's error must come this soon: far below the watchdog
OPS = ("ag_matmul", "matmul_rs")
FAULTS = ("pipelined_plan_fail", "pipelined_fail_after_release")


def required(rank: int, world: int) -> tuple:
  per_fault = ("failing_rank_raises_at_once",) if rank == 1 else ("peer_fails_promptly",)
  return tuple(f"{check}_{op}_{fault}" for op in OPS for fault in FAULTS
               for check in per_fault + ("in_step_after_clear_errors",))


def returncode(rank: int, world: int) -> int:
  return 0


def _call(ctx: Ctx, op: str):
  """The op's jitted call on fixed inputs, and right(out): whether this rank's output matches its float64
  reference (with the detail to record)."""
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  rng, world, rank = ctx.rng, ctx.world, ctx.rank
  m, k, n = 128, 256, 128
  if op == "ag_matmul":
    fn = ctx.ag_fn("pipelined")
    x = rng.standard_normal((world * m, k)).astype(jnp.bfloat16)
    w = (rng.standard_normal((k, world * n)) / np.sqrt(k)).astype(jnp.bfloat16)
    args = (ctx.shard(x, P("tp")), ctx.shard(w, P(None, "tp")))
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)[:, rank * n:(rank + 1) * n]
    return (lambda: fn(*args)[0]), lambda out: close(out, ref, jnp.bfloat16, k, k ** -0.5)
  fn = ctx.rs_fn("pipelined")
  x = rng.standard_normal((world * m, world * k)).astype(jnp.bfloat16)
  w = (rng.standard_normal((world * k, n)) / np.sqrt(world * k)).astype(jnp.bfloat16)
  args = (ctx.shard(x, P(None, "tp")), ctx.shard(w, P("tp", None)))
  ref = (np.asarray(x, np.float64) @ np.asarray(w, np.float64))[rank * m:(rank + 1) * m]
  return (lambda: fn(*args)), lambda out: close(out, ref, jnp.bfloat16, world * k, (world * k) ** -0.5)


def _failing_rank(ctx: Ctx, harness, call, name: str, fault: str) -> None:
  harness.set_faults(f"{fault}=1")
  t0 = time.monotonic()
  try:
    ctx.local(call())
    raised = "no exception"
  except Exception as e:  # XlaRuntimeError carrying the handler's error
    raised = str(e)
  finally:
    harness.set_faults("")
  took = time.monotonic() - t0
  ctx.check(f"failing_rank_raises_at_once_{name}", fault in raised and took < PROMPT_S,
            f"{took:.1f} s: {raised[:300]}")


def _peer(ctx: Ctx, jo, call, right, name: str, fault: str) -> None:
  t0 = time.monotonic()
  out = ctx.local(call())
  took, err = time.monotonic() - t0, recorded_error(jo)
  nan, (correct, detail) = all_nan(out), right(out)
  told = err is not None and "rank 1" in err and "abandoned" in err
  ok = took < PROMPT_S and ((nan and told) or (fault == "pipelined_fail_after_release" and correct))
  ctx.check(f"peer_fails_promptly_{name}", ok,
            f"{took:.1f} s, all NaN {nan}, {detail}, error: {(err or 'none')[:300]}")


def run(ctx: Ctx) -> None:
  import jax

  import jax_overlap as jo
  from jax_overlap import _native_testing

  jo.initialize()
  for op in OPS:
    call, right = _call(ctx, op)
    for fault in FAULTS:
      name = f"{op}_{fault}"
      for _ in range(2):  # both parities' slots in use
        jax.block_until_ready(call())
      if ctx.rank == 1:
        _failing_rank(ctx, _native_testing, call, name, fault)
      else:
        _peer(ctx, jo, call, right, name, fault)
      jo.clear_errors()
      correct, detail = right(ctx.local(call()))
      ctx.check(f"in_step_after_clear_errors_{name}", recorded_error(jo) is None and correct, detail)
