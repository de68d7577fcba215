"""Scenario "copy_paths": the pipelined algorithm's copy paths across processes, through fault injection.

For each copy path (csrc/pipelined/copy.h), the faults that make initialize()'s self-test see the earlier
paths' bytes not land (copy_selftest_engine_fails, copy_selftest_d2d_fails; runtime/faults.h) are set in
every process, and the runtime set up again (shutdown(), initialize()): the GPU must take that path, say so
at INFO (nothing for the first path), and pipelined ag_matmul (with the gathered x) and matmul_rs, with a
batch dim (pitched copies), odd rows and bias, must match float64 from every peer's pulls. Then, with
copies split at 4 KiB (copy_max_bytes=4096, read by each call as it is enqueued), the same compiled calls
must give the same bits.
"""

from __future__ import annotations

import logging

import numpy as np

from scenarios.common import Ctx
from tolerance import close

ENV = {"JAX_OVERLAP_ON_TIMEOUT": "raise"}
WORLDS = (2, 4)
CASES = (("", "copy_engine"), ("copy_selftest_engine_fails", "device_to_device"),
         ("copy_selftest_engine_fails,copy_selftest_d2d_fails", "kernel"))
SPLIT = "copy_max_bytes=4096"
CHECKS = ("chosen", "info_line", "ag_matmul", "ag_matmul_gathered", "matmul_rs", "split_pieces", "split_bitwise")


def required(rank: int, world: int) -> tuple:
  return tuple(f"{path}_{c}" for _, path in CASES for c in CHECKS)


def returncode(rank: int, world: int) -> int:
  return 0


class _Lines(logging.Handler):
  def __init__(self):
    super().__init__(logging.INFO)
    self.lines = []

  def emit(self, record):
    self.lines.append(record.getMessage())


def run(ctx: Ctx) -> None:
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  import jax_overlap as jo
  from jax_overlap import _native_testing as harness

  rank, world, rng, shard, local, check = ctx.rank, ctx.world, ctx.rng, ctx.shard, ctx.local, ctx.check
  logger = logging.getLogger("jax_overlap")
  logger.setLevel(logging.INFO)
  lines = _Lines()
  logger.addHandler(lines)

  m, k, n = 37, 520, 136
  X = rng.standard_normal((2, world * m, k)).astype(jnp.bfloat16)
  W = (rng.standard_normal((k, world * n)) / np.sqrt(k)).astype(jnp.bfloat16)
  B = rng.standard_normal((world * n,)).astype(jnp.bfloat16)
  Xr = rng.standard_normal((2, world * m, world * 264)).astype(jnp.bfloat16)
  Wr = (rng.standard_normal((world * 264, n)) / np.sqrt(world * 264)).astype(jnp.bfloat16)
  cols, rows = slice(rank * n, (rank + 1) * n), slice(rank * m, (rank + 1) * m)
  ag_ref = np.asarray(X, np.float64) @ np.asarray(W, np.float64)[:, cols] + np.asarray(B, np.float64)[cols]
  rs_ref = (np.asarray(Xr, np.float64) @ np.asarray(Wr, np.float64))[:, rows] + np.asarray(B, np.float64)[:n]

  for spec, path in CASES:
    harness.set_faults(spec)
    jo.shutdown()
    jax.clear_caches()
    lines.lines.clear()
    jo.initialize()
    chosen = harness.copy_path(ctx.dev.local_hardware_id)
    check(f"{path}_chosen", chosen == path, f"{chosen}")
    said = [line for line in lines.lines if "moves the pipelined algorithm's bytes" in line]
    check(f"{path}_info_line", said == [] if path == "copy_engine" else
          (len(said) == 1 and "did not land" in said[0]), " | ".join(said)[:400])

    ag, rs = ctx.ag_fn("pipelined", bias=True, lead=1), ctx.rs_fn("pipelined", bias=True, lead=1)
    ag_args = (shard(X, P(None, "tp")), shard(W, P(None, "tp")), shard(B, P("tp")))
    rs_args = (shard(Xr, P(None, None, "tp")), shard(Wr, P("tp", None)), shard(B[:n], P()))
    (y, g), z = ag(*ag_args), rs(*rs_args)
    y, g, z = local(y), local(g), local(z)
    check(f"{path}_ag_matmul", *close(y, ag_ref, jnp.bfloat16, k, k ** -0.5))
    check(f"{path}_ag_matmul_gathered", np.array_equal(g, np.asarray(X)), "")
    check(f"{path}_matmul_rs", *close(z, rs_ref, jnp.bfloat16, world * 264, (world * 264) ** -0.5))

    harness.set_faults(f"{spec},{SPLIT}")
    # Not a vacuous split: each batch element of x's shard (ag_matmul's publish and pulls) goes in pieces.
    pieces = harness.copy_pieces(m * k * 2, 2, harness.max_copy_bytes())
    check(f"{path}_split_pieces", len(pieces) > 2 and max(w * h for _, _, w, h in pieces) <= 4096,
          f"{len(pieces)} pieces")
    (y2, g2), z2 = ag(*ag_args), rs(*rs_args)
    same = [np.array_equal(a.view(np.uint16), local(b).view(np.uint16)) for a, b in ((y, y2), (g, g2), (z, z2))]
    check(f"{path}_split_bitwise", all(same), f"y, gathered, matmul_rs equal: {same}")
  harness.set_faults("")
  logger.removeHandler(lines)
