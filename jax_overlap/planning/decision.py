"""decide(): an explicit algorithm's plan, or for "auto" the fastest predicted if it beats XLA by AUTO_MARGIN.
The figures are a collective step (process 0 measures), so a planner takes them after the eligibility and before
anything one process alone can refuse (vendor BLAS, tiles): every process reaches the same steps."""


from __future__ import annotations

import dataclasses
import functools
import logging
import math

import numpy as np

from jax_overlap.planning import figures, fused, pipelined, tuning
from jax_overlap.planning.eligibility import eligible
from jax_overlap.planning.problem import Choice, Declined, Problem
from jax_overlap.quantization import formats
from jax_overlap.runtime import backend, settings, workspace

log = logging.getLogger("jax_overlap")

# The model's error must not make a call slower than XLA.
AUTO_MARGIN = 0.95
# The fused kernels' GEMM engine against the vendor GEMM (docs/performance.md): the fused model's engine rate is
# the measured vendor rate times this.
FUSED_ENGINE_RATIO = 0.63


def faster(est_us: float, est_xla_us: float) -> bool:
  return math.isfinite(est_us) and est_us < AUTO_MARGIN * est_xla_us


def _vendor_blas() -> None:
  """Loads the vendor BLAS on every local GPU now, never during a command buffer's capture, and checks once per
  GPU that its GEMM replays right from a captured graph."""
  try:
    for ordinal in workspace.local_ordinals():
      check = backend.current().native.prepare_vendor_blas(ordinal)
      if check["checked_now"] and not check["graph_safe"]:
        log.info("jax_overlap: the vendor GEMM on GPU %d failed its graph-capture check (%s): pipelined calls of a "
                 "group of one run outside XLA's command buffers", ordinal, check["detail"])
  except RuntimeError as e:
    raise Declined(str(e)) from e


def _measured(problem: Problem, op) -> figures.Figures:
  return figures.measure(op, problem.dtype_name, problem.rows, problem.k, problem.n, problem.world,
                         problem.w_kmajor, types=(problem.w_dtype, problem.out_dtype) if problem.scaled else None,
                         scaling=problem.scaling)


def _pinned_stages(op, world: int) -> tuple | None:
  pinned = settings.pipeline_stages()
  try:
    return pipelined.parse_stages(pinned, op, world) if pinned else None
  except ValueError as e:
    raise ValueError(f"jax_overlap: {settings.PIPELINE_STAGES}: {e}") from None


def _plan_pipelined(problem: Problem, op, auto: bool) -> Choice:
  del auto  # the same plan either way: the model picks the stages
  why = eligible(problem, op, "pipelined")
  if why:
    raise Declined(why)
  # The GEMMs' algorithms are agreed (collective) before the vendor BLAS is prepared (which one process can fail).
  if problem.world == 1:
    chosen = tuning.choose(problem, op, (1,))
    _vendor_blas()
    tuning.install(chosen)
    return Choice("pipelined", None)
  f = _measured(problem, op)
  plan = pipelined.plan(op, problem.world, f, _pinned_stages(op, problem.world))
  chosen = tuning.choose(problem, op, plan.stages)
  _vendor_blas()
  tuning.install(chosen)
  sizes = (formats.itemsize(problem.dtype_name), formats.partial(problem.out_dtype).itemsize, problem.scaled,
           problem.scaled and problem.scaling.blocks)
  nbytes = backend.current().native.pipelined_region_bytes(
      op.name, problem.world, problem.batch, problem.m, problem.k, problem.n, *sizes)
  # Calls of one key share a region, so the key holds all that its bytes follow.
  key = (f"{op.name}/pipelined", problem.groups, (problem.batch, problem.m, problem.k, problem.n, *sizes))
  return Choice("pipelined", plan, (key, nbytes))


def _plan_fused(problem: Problem, op, auto: bool) -> Choice:
  """auto: the model is fed this machine's measured figures (vendor GEMM rate, peer link)."""
  why = eligible(problem, op, "fused")
  if why:
    raise Declined(why)
  f = _measured(problem, op) if auto else None
  device = workspace.device_props()
  if f is not None:
    chunk_rows = op.planning.chunk_rows(problem.rows, problem.world)
    vendor = 2.0 * problem.world * chunk_rows * problem.k * problem.n / f.gemm_us[-1]
    device = dataclasses.replace(device, vendor_flops=vendor, engine_flops=FUSED_ENGINE_RATIO * vendor,
                                 link_bytes=f.link_bytes_per_us)
  machine = backend.current()
  geometry = functools.partial(machine.gemm_geometry, op.name, dtype_name=problem.dtype_name,
                               w_kmajor=problem.w_kmajor, world=problem.world, batch=problem.batch, m=problem.m,
                               k=problem.k, n=problem.n, device=device)
  plan, why = fused.plan(op, dtype_name=problem.dtype_name, rows=problem.rows, k=problem.k, n=problem.n,
                         world=problem.world, device=device, tiles=machine.tile_shapes(), geometry=geometry)
  if plan is None:
    raise Declined(why)
  if problem.world == 1:
    return Choice("fused", plan)
  key = (f"{op.name}/fused", problem.groups, (problem.batch, problem.m, problem.k, problem.n,
                                              formats.itemsize(problem.dtype_name), plan.tile, plan.chunk_k))
  return Choice("fused", plan, (key, plan.region_bytes))


def _plan_all_gather(problem: Problem, op, auto: bool) -> Choice:
  """The runtime's all-gather of x's rows (tests): any dtype, rows of whole 16-byte vectors."""
  del op, auto
  row_bytes = problem.k * np.dtype(problem.dtype_name).itemsize
  if problem.world < 2 or row_bytes % formats.VECTOR_BYTES:
    raise Declined("a group of one, or rows not 16-byte multiples")
  nbytes = backend.current().native.all_gather_region_bytes(problem.world, problem.rows, row_bytes)
  return Choice("all_gather", None, (("all_gather", problem.groups, (problem.rows, problem.k, problem.dtype_name)),
                                     nbytes))


_PLANNERS = {"pipelined": _plan_pipelined, "fused": _plan_fused, "all_gather": _plan_all_gather}


def decide(problem: Problem, op, requested: str, *, again: str | None = None) -> Choice:
  """The plan that takes the call, or Declined saying why. again: auto's choice made on a guessed link, judged
  again now that it is measured."""

  if requested != "auto":
    return _PLANNERS[requested](problem, op, auto=False)
  if problem.world == 1:
    if not problem.scaled:
      raise Declined("a group of one has no communication to overlap: XLA's dot")
    # A float8 group of one is the vendor's fp8 GEMM, faster than XLA's fp8 forms (docs/performance.md).
    return _plan_pipelined(problem, op, auto=True)
  if problem.scaled and not problem.scaling.xla_gemm:
    # XLA's form for block scales is a float32 dot, which the model's XLA path (the vendor's fp8 rate) would flatter.

    return _plan_pipelined(problem, op, auto=True)
  if again is not None:
    choice = _PLANNERS[again](problem, op, auto=True)
    est, est_xla = choice.estimates()
    if not faster(est, est_xla):
      raise Declined(f"{again}: with the measured link the cost model predicts {est:.0f} us vs xla "
                     f"{est_xla:.0f} us")
    return choice
  reasons, options = [], []
  for algorithm in op.planning.algorithms:
    try:
      choice = _PLANNERS[algorithm](problem, op, auto=True)
    except Declined as e:
      reasons.append(f"{algorithm}: {e}")
      continue
    est, est_xla = choice.estimates()
    if faster(est, est_xla):
      options.append((est, algorithm, choice))
    else:
      reasons.append(f"{algorithm}: the cost model predicts {est:.0f} us vs xla {est_xla:.0f} us")
  if not options:
    raise Declined("; ".join(reasons))
  return min(options, key=lambda option: option[:2])[2]
