"""Scenario "wrap" (world 2, JAX_OVERLAP_ON_TIMEOUT=raise): calls across the wrap of the flags' epoch bits
(issue 24, item 4). The host counts epochs in 64 bits; flags hold the low 32 (pipelined) or 16 (fused) bits.

For each origin (_native_testing.set_epoch_origin, applied to every region by clear_errors()), CALLS calls of each op,
pipelined and fused, on a new input each call, enqueued back to back (ranks run ahead of each other, so the
readers-done waits matter) and every result checked against float64:
  2^32 - 4: the calls cross 2^32, which wraps both the pipelined flags' 32 bits and the fused flags' 16;
  2^32 - 1: the first call's epoch has low bits 0 on flags still zero (a zero flag must never read as a release).

On the code before the fix the counter was 32-bit and `epoch > 2` decided whether a slot had readers to wait for:
from these origins the first call waited for done flags of calls that never ran, and every check fails after the
watchdog (20 s).
"""

from __future__ import annotations

import numpy as np

from scenarios.common import Ctx
from tolerance import close

ENV = {"JAX_OVERLAP_ON_TIMEOUT": "raise"}
WORLDS = (2,)
ORIGINS = (2 ** 32 - 4, 2 ** 32 - 1)
CALLS = 8
CASES = (("pipelined", "ag_matmul"), ("pipelined", "matmul_rs"), ("fused", "ag_matmul"), ("fused", "matmul_rs"))


def required(rank: int, world: int) -> tuple:
  return tuple(f"{algorithm}_{op}_from_{origin:#x}" for origin in ORIGINS for algorithm, op in CASES)


def returncode(rank: int, world: int) -> int:
  return 0


def _case(ctx: Ctx, algorithm: str, op: str):
  """call(i) on the op's inputs with i added to x, and right(out, i): whether this rank's output matches its
  float64 reference for i (with the detail to record)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  import jax_overlap as jo

  rng, world, rank = ctx.rng, ctx.world, ctx.rank
  if op == "ag_matmul":
    m, k, n = 192, 512, 256
    x = rng.standard_normal((world * m, k)).astype(jnp.bfloat16)
    w = (rng.standard_normal((k, world * n)) / np.sqrt(k)).astype(jnp.bfloat16)
    fn = jax.jit(jax.shard_map(lambda x, w, i: jo.ag_matmul(x + i, w, axis_name="tp", algorithm=algorithm),
                               mesh=ctx.mesh, in_specs=(P("tp"), P(None, "tp"), P()), out_specs=P(None, "tp")))
    args = (ctx.shard(x, P("tp")), ctx.shard(w, P(None, "tp")))
    w_local = np.asarray(w, np.float64)[:, rank * n:(rank + 1) * n]
    reference = lambda i: np.asarray((x.astype(np.float32) + i).astype(jnp.bfloat16), np.float64) @ w_local
    terms, w_scale = k, k ** -0.5
  else:
    mb, k, n = 96, 256, 384
    x = rng.standard_normal((world * mb, world * k)).astype(jnp.bfloat16)
    w = (rng.standard_normal((world * k, n)) / np.sqrt(world * k)).astype(jnp.bfloat16)
    fn = jax.jit(jax.shard_map(lambda x, w, i: jo.matmul_rs(x + i, w, axis_name="tp", algorithm=algorithm),
                               mesh=ctx.mesh, in_specs=(P(None, "tp"), P("tp", None), P()), out_specs=P("tp")))
    args = (ctx.shard(x, P(None, "tp")), ctx.shard(w, P("tp", None)))
    w64 = np.asarray(w, np.float64)
    reference = lambda i: (np.asarray((x.astype(np.float32) + i).astype(jnp.bfloat16), np.float64) @ w64)[
        rank * mb:(rank + 1) * mb]
    terms, w_scale = world * k, (world * k) ** -0.5
  # x + i: terms of (1 + i) times w
  right = lambda out, i: close(out, reference(i), jnp.bfloat16, terms, (1 + i) * w_scale)
  return (lambda i: fn(*args, ctx.shard(np.array(i, jnp.bfloat16), P()))), right


def run(ctx: Ctx) -> None:
  import jax_overlap as jo
  from jax_overlap import _native_testing

  jo.initialize()
  cases = {case: _case(ctx, *case) for case in CASES}
  for origin in ORIGINS:
    _native_testing.set_epoch_origin(origin)
    jo.clear_errors()  # every region's flags zeroed and its counter at the origin
    for (algorithm, op), (call, right) in cases.items():
      outs = [call(i % 5) for i in range(CALLS)]
      verdicts = [right(ctx.local(out), i % 5) for i, out in enumerate(outs)]
      try:
        jo.check_errors()
        err = None
      except jo.PeerTimeoutError as e:
        err = str(e)
      bad = [i for i, (ok, _) in enumerate(verdicts) if not ok]
      ctx.check(f"{algorithm}_{op}_from_{origin:#x}", not bad and err is None,
                f"bad calls {bad}: {[verdicts[i][1] for i in bad][:2]}; error: {(err or 'none')[:300]}")
      if err is not None:
        jo.clear_errors()
