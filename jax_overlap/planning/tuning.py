"""The vendor GEMM's algorithm for each GEMM a pipelined call runs, chosen by measurement.

csrc/blas/gemm.h DeviceBlas::tune times the vendor heuristic's first
JAX_OVERLAP_GEMM_CANDIDATES candidates of a GEMM problem on one GPU (or reads
the choice from the tuning cache in JAX_OVERLAP_GEMM_CACHE_DIR) and keeps the
fastest; that choice is installed on each of the process's GPUs. For a group of
two or more, whose ranks may sit in several processes, process 0 chooses and
every process takes its choice (processes.agree, a step the group's planning
takes on every process anyway): every rank runs the same algorithm for the
same problem, so the partial products matmul_rs's reduction sums, and the
results of replicas, stay alike bit for bit. A group of one is one process's
own: its choice is that process's, and its lowering waits for no other. A GPU
whose heuristic does not list the choice keeps its own (said at INFO). All of
it at lowering, before a call runs, never in one; a problem is timed once per
process, and with the cache once per machine. JAX_OVERLAP_GEMM_TUNING=0 leaves
each GPU the heuristic's first.

The problems are the call's GEMMs on every rank (csrc/pipelined/schedule.h
gemm_problems: the stages' row ranges and both slot parities) on buffers as XLA
gives them, 256-byte aligned; a GEMM
on buffers aligned otherwise runs the heuristic's first (its plan is another
problem).
"""

from __future__ import annotations

import logging

from jax_overlap.runtime import backend, processes, settings, workspace
from jax_overlap.runtime.errors import SetupError

log = logging.getLogger("jax_overlap")

# Another candidate replaces the heuristic's first only when timed at least this much faster: run-to-run noise
# (about 1% on the H200) must not flip a choice between processes' lifetimes or cache files.
MARGIN = 0.02


def options() -> dict:
  """The tuning settings as the native module's tune_gemm takes them (candidates 1: the heuristic's first)."""
  candidates = settings.gemm_candidates() if settings.gemm_tuning() else 1
  return {"candidates": candidates, "margin": MARGIN, "cache_dir": settings.gemm_cache_dir() or ""}


def problems(problem, op, stages: tuple) -> list:
  """The ids of every GEMM problem a call of `problem` with `stages` runs (one for a group of one)."""
  call = {"dtype": problem.dtype_name, "batch": problem.batch, "m": problem.m, "k": problem.k, "n": problem.n,
          "w_kmajor": problem.w_kmajor, "bias": problem.gemm_bias, "stages": list(stages)}
  if problem.scaled:
    call.update(w_dtype=problem.w_dtype, out_dtype=problem.out_dtype, blocks=problem.scaling.blocks,
                fast_accumulation=problem.fast_accumulation, x_scale_shared=problem.x_scale_shared)
  return list(backend.current().native.gemm_problems(op.name, problem.world, call,
                                                     workspace.device_props().sm_count))


def choose(problem, op, stages: tuple) -> list:
  """(problem id, the choice) for each GEMM problem of the call: process 0's for a group of two or more (a
  collective step: every process reaches it at the same point of planning), this process's for a group of one.
  [] with tuning off. SetupError (on every process of the group) when a problem has no plan at all."""
  if not settings.gemm_tuning():
    return []
  nat, opts = backend.current().native, options()

  def tune(pid):
    return dict(nat.tune_gemm(workspace.first_ordinal(), pid, **opts))
  chosen = []
  for pid in problems(problem, op, stages):
    if problem.world > 1:
      result = processes.agree(f"gemm_algo/{processes.digest(pid)}", lambda pid=pid: tune(pid))
    else:
      try:
        result = tune(pid)
      except RuntimeError as e:
        raise SetupError(f"jax_overlap: the vendor GEMM for {pid}: {e}") from e
    if result["source"] == "heuristic" and result["detail"]:
      log.info("jax_overlap: the vendor GEMM keeps its heuristic's first algorithm for %s: %s", pid,
               result["detail"])
    else:
      log.debug("jax_overlap: vendor GEMM %s: algorithm %d of %d (%s), %.1f us against the heuristic's first's "
                "%.1f us", pid, result["index"], result["candidates"], result["source"], result["us"],
                result["first_us"])
    chosen.append((pid, result["choice"]))
  return chosen


def install(chosen: list) -> None:
  """Makes the chosen algorithms those of every local GPU (after the vendor BLAS is prepared on them)."""
  nat, candidates = backend.current().native, options()["candidates"]
  for ordinal in workspace.local_ordinals():
    for pid, choice in chosen:
      if not nat.install_gemm_algo(ordinal, pid, choice, candidates):
        log.info("jax_overlap: GPU %d's vendor heuristic does not list process 0's algorithm for %s among its "
                 "first %d: it runs its own, and its results may differ from other ranks' in the last bits",
                 ordinal, pid, candidates)
