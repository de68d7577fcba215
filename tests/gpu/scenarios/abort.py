"""Scenario "abort" (world 2, the default JAX_OVERLAP_ON_TIMEOUT=abort): rank 1 exits mid-call; rank 0's
process must end by SIGABRT with the error record on its stderr."""

from __future__ import annotations

import os
import signal
import time

from scenarios.common import DEATH_WATCHDOG_SECONDS, Ctx

ENV = {}
WORLDS = (2,)


def required(rank: int, world: int) -> tuple:
  return ("first_call",)


def returncode(rank: int, world: int) -> int:
  return 0 if rank == world - 1 else -signal.SIGABRT


def verdict(result: dict) -> None:
  if result["rank"] < result["world"] - 1:
    ok = "timed out" in result["stderr"] and "aborting the process" in result["stderr"]
    result["checks"]["aborted_with_record"] = {"ok": ok, "detail": result["stderr"][-300:]}


def run(ctx: Ctx) -> None:
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  import jax_overlap as jo

  x = ctx.rng.standard_normal((ctx.world * 64, 256)).astype(jnp.bfloat16)
  w = ctx.rng.standard_normal((256, ctx.world * 128)).astype(jnp.bfloat16)
  jo.initialize(watchdog_seconds=DEATH_WATCHDOG_SECONDS)
  ag = ctx.ag_fn("pipelined")
  args = (ctx.shard(x, P("tp")), ctx.shard(w, P(None, "tp")))
  jax.block_until_ready(ag(*args))
  ctx.check("first_call", True)
  if ctx.rank == ctx.world - 1:
    ag(*args)
    os._exit(0)  # mid-call
  for _ in range(100):
    jax.block_until_ready(ag(*args))  # the monitor thread must end this process
    time.sleep(0.1)
  ctx.check("aborted", False, "the process survived its peer's death")
  os._exit(0)


