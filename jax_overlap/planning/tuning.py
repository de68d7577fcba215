"""The vendor GEMM's algorithm for each GEMM a pipelined call runs, chosen by measurement at lowering.

The fastest of the heuristic's first JAX_OVERLAP_GEMM_CANDIDATES (csrc/blas/gemm.h DeviceBlas::tune) is installed
on every local GPU. For a group of two or more, process 0 chooses for every process: every rank then runs the same
algorithm, so matmul_rs's partial products and replicas' results agree bit for bit. A group of one chooses its own
and waits for no other process. The problems assume 256-byte aligned buffers, as XLA gives them; a GEMM on buffers
aligned otherwise runs the heuristic's first.
"""

from __future__ import annotations

import logging

from jax_overlap.runtime import backend, processes, settings, workspace
from jax_overlap.runtime.errors import SetupError

log = logging.getLogger("jax_overlap")

# Another candidate replaces the heuristic's first only when this much faster: run-to-run noise (docs/performance.md)
# must not flip a choice between processes' lifetimes or cache files.
MARGIN = 0.02


def options() -> dict:
  candidates = settings.gemm_candidates() if settings.gemm_tuning() else 1
  return {"candidates": candidates, "margin": MARGIN, "cache_dir": settings.gemm_cache_dir() or ""}


def problems(problem, op, stages: tuple) -> list:
  call = {"dtype": problem.dtype_name, "batch": problem.batch, "m": problem.m, "k": problem.k, "n": problem.n,
          "w_kmajor": problem.w_kmajor, "bias": problem.gemm_bias, "stages": list(stages)}
  if problem.scaled:
    call.update(w_dtype=problem.w_dtype, out_dtype=problem.out_dtype, blocks=problem.scaling.blocks,
                fast_accumulation=problem.fast_accumulation, x_scale_shared=problem.x_scale_shared)
  return list(backend.current().native.gemm_problems(op.name, problem.world, call,
                                                     workspace.device_props().sm_count))


def choose(problem, op, stages: tuple) -> list:
  """[(problem id, choice)]: a collective step for a group of two or more (every process reaches it at the same
  point of planning). SetupError when a problem has no plan at all."""
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
  nat, candidates = backend.current().native, options()["candidates"]
  for ordinal in workspace.local_ordinals():
    for pid, choice in chosen:
      if not nat.install_gemm_algo(ordinal, pid, choice, candidates):
        log.info("jax_overlap: GPU %d's vendor heuristic does not list process 0's algorithm for %s among its "
                 "first %d: it runs its own, and its results may differ from other ranks' in the last bits",
                 ordinal, pid, candidates)
