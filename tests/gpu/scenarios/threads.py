"""Scenario "threads" (world 2): one enqueuer per GPU (docs/protocol.md, "Host threads"). Each process calls one
program from two threads at once while fault enqueue_hold_ms keeps the first execute on its GPU long enough for
the second to meet it: on every rank exactly one call is refused, naming both threads, before it takes an epoch,
and the other one's result is right (the ranks stay in step). Pipelined and fused ag_matmul."""

from __future__ import annotations

import threading

import numpy as np

from scenarios.common import WATCHDOG_SECONDS, Ctx
from tolerance import close

ENV = {"JAX_OVERLAP_ON_TIMEOUT": "raise"}
WORLDS = (2,)
ALGORITHMS = ("pipelined", "fused")
HOLD_MS = 2000


def required(rank: int, world: int) -> tuple:
  return tuple(f"{a}_{what}" for a in ALGORITHMS for what in ("one_refused", "the_other_right", "then_in_step"))


def returncode(rank: int, world: int) -> int:
  return 0


def run(ctx: Ctx) -> None:
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  import jax_overlap as jo
  from jax_overlap.runtime import native

  jo.initialize(watchdog_seconds=WATCHDOG_SECONDS)
  m, k, n = 64, 256, 128
  x = ctx.rng.standard_normal((ctx.world * m, k)).astype(jnp.bfloat16)
  w = (ctx.rng.standard_normal((k, ctx.world * n)) / np.sqrt(k)).astype(jnp.bfloat16)
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)[:, ctx.rank * n:(ctx.rank + 1) * n]
  args = (ctx.shard(x, P("tp")), ctx.shard(w, P(None, "tp")))
  for algorithm in ALGORITHMS:
    ag = ctx.ag_fn(algorithm)
    jax.block_until_ready(ag(*args))  # compiled, bound and warm before the threads
    results, errors = [None, None], [None, None]
    start = threading.Barrier(2)

    def call(i):
      start.wait()
      try:
        results[i] = jax.block_until_ready(ag(*args))
      except Exception as e:  # noqa: BLE001  (the refusal comes back as XLA's runtime error)
        errors[i] = str(e)

    native.module().set_faults(f"enqueue_hold_ms={HOLD_MS}")
    try:
      threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
      for t in threads:
        t.start()
      for t in threads:
        t.join()
    finally:
      native.module().set_faults("")
    refused = [e for e in errors if e is not None]
    ctx.check(f"{algorithm}_one_refused", len(refused) == 1 and "was enqueuing another there" in refused[0]
              and "host thread" in refused[0], repr(errors)[-600:])
    ran = [r for r in results if r is not None]
    ctx.check(f"{algorithm}_the_other_right", len(ran) == 1 and close(ctx.local(ran[0][0]), want, jnp.bfloat16, k,
                                                                      k ** -0.5)[0], repr(errors)[-300:])
    y, _ = ag(*args)  # the refused call took no epoch: the ranks are still in step
    ctx.check(f"{algorithm}_then_in_step", *close(ctx.local(y), want, jnp.bfloat16, k, k ** -0.5))
