"""The pipelined algorithm's stage plan and cost model (pure functions), for any op (ops/).

A pipelined call runs the vendor GEMM per stage of consecutive chunks (ring
positions, csrc/pipelined/schedule.h) while copy engines move chunks between
ranks. Few large stages waste less of the GEMM (a 2048-row chunk of a
16384 x 3584 x 8192 GEMM runs at 0.91x the whole GEMM's rate on the H200) but
wait longer for their data; the plan is the split of the ring into stages that
the model predicts fastest, out of every split the op allows (at most 2^7 for
8 ranks). Each op models when its stages' data is ready (its pipelined_us);
the overheads below are the only figures not measured (planning/figures.py).
"""

from __future__ import annotations

import dataclasses
import itertools

# A stage's wait on its data and its launch on a side stream (event wait, GEMM
# launch gap), a call's fork, join and trailing kernel, and the share of a pull
# on the SMs (Figures.pulls_on_sms) that the GEMMs' last waves hide: the figures'
# defaults (figures.Figures): among the settings bench_model_sweep.py --fit finds
# leaving the fewest loopback rows off by more than 10% on the H200 (11 of 144 at
# M = 128 to 4096, none at M >= 1024: docs/performance.md). Loopback has no flag
# waits, which a stage across GPUs adds.
STAGE_OVERHEAD_US = 0.5
CALL_OVERHEAD_US = 3.0
SM_PULL_HIDDEN = 0.5


@dataclasses.dataclass(frozen=True)
class PipelinedPlan:
  """A pipelined call's stages (ring positions per stage) and the model's times for it and the XLA path."""

  stages: tuple
  est_us: float
  est_xla_us: float

  def fingerprint(self) -> list:
    return list(self.stages)


def compositions(total: int):
  """Every split of `total` chunks into consecutive stages, as tuples of stage sizes."""
  for cuts in itertools.product((False, True), repeat=total - 1):
    sizes, size = [], 1
    for cut in cuts:
      if cut:
        sizes.append(size)
        size = 1
      else:
        size += 1
    yield tuple(sizes + [size])


def gemm_us(f, chunks: int) -> float:
  """What a stage of `chunks` chunks spends in GEMMs (f: figures.Figures): one vendor GEMM over their rows, or
  where the schedule runs several (f.stage_gemm_us), those."""
  return (f.stage_gemm_us or f.gemm_us)[chunks - 1]


def xla_us(world: int, f) -> float:
  """Model of the XLA path: the collective (world - 1 chunks over the link), then the whole GEMM, or where that
  is one GEMM per chunk (f.stage_gemm_us: the gathered shards of a float8 ag_matmul, each with its own scale,
  which XLA's fp8 GEMM form takes one dot each: numerics.gathered_matmul) those, at the vendor's rate."""
  return (world - 1) * f.chunk_bytes / f.link_bytes_per_us + gemm_us(f, world)


def parse_stages(text: str, op, world: int) -> tuple | None:
  """A stage plan written "1,3" (stage sizes in ring order) for a call of `op` over `world` ranks: None when
  its stages cover another group size, ValueError when it cannot be one of `op`'s plans."""
  try:
    stages = tuple(int(s) for s in text.split(","))
  except ValueError:
    raise ValueError(f"stage plan {text!r}: expected stage sizes separated by commas, such as 1,3") from None
  if sum(stages) != world:
    return None
  if any(s < 1 for s in stages):
    raise ValueError(f"stage plan {text!r}: every stage needs at least one chunk")
  op.planning.check_stages(stages, text)
  return stages


def candidates(op, world: int, f) -> list:
  """The stage plans `op`'s model chooses from. Where the schedule runs one GEMM per chunk whatever the stages
  (f.stage_gemm_us: a float8 ag_matmul, one GEMM per shard and its scale), a stage of several chunks gains no GEMM
  rate and only waits for its last chunk: one chunk per stage. (The model, whose copies finish under the first
  GEMM, would rather save the stages' overheads; on the H200 in loopback, ag_matmul at T = 8 ran 0.88x one
  float8 GEMM with one shard per stage, 0.83x with the model's (1, 7): 6a98e4b:benchmarks/results/fp8_2026-12-02.md.)"""
  plans = op.planning.stage_candidates(world)
  if f.stage_gemm_us is None:
    return plans
  return [c for c in plans if max(c) == 1]


def plan(op, world: int, f, stages: tuple | None = None) -> PipelinedPlan:
  """The stages `op`'s model predicts fastest among its candidates (or `stages`, pinned), with its times for them
  and for the XLA path."""
  if len(f.gemm_us) != world:
    raise ValueError(f"pipelined.plan: gemm_us needs {world} entries (1 .. world chunks), got {len(f.gemm_us)}")
  best = stages if stages is not None else min(candidates(op, world, f),
                                               key=lambda c: (op.planning.pipelined_us(c, f), len(c)))
  return PipelinedPlan(best, op.planning.pipelined_us(best, f), xla_us(world, f))
