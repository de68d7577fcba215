"""Scenario "overwrite" (world 2, JAX_OVERLAP_ON_TIMEOUT=raise, a 2 s watchdog once compiled): a reader paused across
its peer's watchdog while the peer's queued calls reuse the slot it reads (issue 24, item 1).

For each pipelined op, after two calls on both ranks:
  rank 1 runs one call with the fault "pipelined_pause_pull" (its copy stream stops for PAUSE_S once the wait for
    rank 0's data matched, before the pull: a reader that matched the epoch and is still pulling);
  rank 0 runs three calls back to back on different inputs. Its second call waits for rank 1 (stuck in the first)
    past the watchdog and aborts; its third reuses the slot rank 1 is about to pull (ag_matmul: the published copy
    of x, written by a copy engine; matmul_rs: the staged partials, written by the vendor GEMM), with other bytes.
Rank 1 must end with its call right, or with NaN and an error; never with finite wrong numbers. Rank 0 must report
the timeout (else the scenario did not happen). Both then clear_errors(), and the next call must be right.

On the code before the fix (before "the pipelined protocol after an abort"; the fault exists since the commit
"test hooks"), rank 0's aborted calls rewrote their slots without waiting for rank 1's done flag, and rank 1, whose
abort flag was clear, pulled rank 0's third input into its first call: "paused_reader_*" fails with a finite
relative error of order 1 and no error anywhere on rank 1.
"""

from __future__ import annotations

import time

import numpy as np

from scenarios.common import WATCHDOG_SECONDS, Ctx, all_nan, recorded_error
from tolerance import close

ENV = {"JAX_OVERLAP_ON_TIMEOUT": "raise"}
WORLDS = (2,)
SHORT_WATCHDOG_S = 2.0  # set after compiling and warming up: ranks may compile seconds apart
PAUSE_S = 6.0  # three watchdogs: rank 0's third call has long rewritten the slot when rank 1 pulls
OPS = ("ag_matmul", "matmul_rs")


def required(rank: int, world: int) -> tuple:
  per_op = ("paused_reader",) if rank == 1 else ("peer_timed_out",)
  return tuple(f"{check}_{op}" for op in OPS for check in per_op + ("in_step_after_clear_errors",))


def returncode(rank: int, world: int) -> int:
  return 0


def _calls(ctx: Ctx, op: str):
  """The op's jitted call, its global inputs for three calls (each a new x) and right(out, i): whether this rank's
  output of call i matches its float64 reference (with the detail to record)."""
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  rng, world, rank = ctx.rng, ctx.world, ctx.rank
  m, k, n = 256, 512, 256
  if op == "ag_matmul":
    fn = ctx.ag_fn("pipelined")
    w = (rng.standard_normal((k, world * n)) / np.sqrt(k)).astype(jnp.bfloat16)
    xs = [rng.standard_normal((world * m, k)).astype(jnp.bfloat16) for _ in range(3)]
    args = [(ctx.shard(x, P("tp")), ctx.shard(w, P(None, "tp"))) for x in xs]
    refs = [np.asarray(x, np.float64) @ np.asarray(w, np.float64)[:, rank * n:(rank + 1) * n] for x in xs]
    return (lambda a: fn(*a)[0]), args, lambda out, i: close(out, refs[i], jnp.bfloat16, k, k ** -0.5)
  fn = ctx.rs_fn("pipelined")
  w = (rng.standard_normal((world * k, n)) / np.sqrt(world * k)).astype(jnp.bfloat16)
  xs = [rng.standard_normal((world * m, world * k)).astype(jnp.bfloat16) for _ in range(3)]
  args = [(ctx.shard(x, P(None, "tp")), ctx.shard(w, P("tp", None))) for x in xs]
  refs = [(np.asarray(x, np.float64) @ np.asarray(w, np.float64))[rank * m:(rank + 1) * m] for x in xs]
  return (lambda a: fn(*a)), args, lambda out, i: close(out, refs[i], jnp.bfloat16, world * k, (world * k) ** -0.5)


def run(ctx: Ctx) -> None:
  import jax

  import jax_overlap as jo
  from jax_overlap import _native_testing

  for op in OPS:
    jo.initialize(watchdog_seconds=WATCHDOG_SECONDS)
    call, args, right = _calls(ctx, op)
    for _ in range(2):  # both parities' slots in use: the third call on rank 0 waits for readers
      jax.block_until_ready(call(args[0]))
    jo.initialize(watchdog_seconds=SHORT_WATCHDOG_S)
    if ctx.rank == 1:
      _native_testing.set_faults(f"pipelined_pause_pull={int(PAUSE_S * 1000)}")
      t0 = time.monotonic()
      out = ctx.local(call(args[0]))
      _native_testing.set_faults("")
      err, paused = recorded_error(jo), time.monotonic() - t0
      nan, (correct, detail) = all_nan(out), right(out, 0)
      ok = paused >= PAUSE_S and ((err is None and correct) or (nan and err is not None))
      ctx.check(f"paused_reader_{op}", ok, f"paused {paused:.1f} s, all NaN {nan}, {detail}, "
                                           f"error: {(err or 'none')[:300]}")
    else:
      outs = [call(a) for a in args]
      got = [ctx.local(o) for o in outs]
      err = recorded_error(jo)
      correct, detail = right(got[0], 0)
      ctx.check(f"peer_timed_out_{op}", err is not None and "rank 1" in err and correct,
                f"first call: {detail}; error: {(err or 'none')[:300]}")
    jo.clear_errors()
    correct, detail = right(ctx.local(call(args[1])), 1)
    ctx.check(f"in_step_after_clear_errors_{op}", recorded_error(jo) is None and correct, detail)
