"""The pipelined algorithm's stage plan and cost model, for any op.

A call runs the vendor GEMM per stage of consecutive chunks while copy engines move chunks between ranks. Few large
stages run the GEMM at a better rate but wait longer for their data: the plan is the split of the ring the model
predicts fastest (at most 2^7 for 8 ranks).
"""

from __future__ import annotations

import dataclasses
import itertools

# The only figures not measured per call: a stage's wait and launch, a call's fork, join and trailing kernel, and
# the share of a pull on the SMs the GEMMs' last waves hide. Fitted to loopback, which has no flag waits
# (bench_model_sweep.py --fit; docs/performance.md).
STAGE_OVERHEAD_US = 0.5
CALL_OVERHEAD_US = 3.0
SM_PULL_HIDDEN = 0.5


@dataclasses.dataclass(frozen=True)
class PipelinedPlan:
  """A call's stages (ring positions per stage) and the model's times for it and the XLA path."""

  stages: tuple
  est_us: float
  est_xla_us: float

  def fingerprint(self) -> list:
    return list(self.stages)


def compositions(total: int):
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
  return (f.stage_gemm_us or f.gemm_us)[chunks - 1]


def xla_us(world: int, f) -> float:
  """The XLA path: the collective, then the GEMM (one per chunk for shards with scales of their own)."""
  return (world - 1) * f.chunk_bytes / f.link_bytes_per_us + gemm_us(f, world)


def parse_stages(text: str, op, world: int) -> tuple | None:
  """A stage plan written "1,3": None when it covers another group size, ValueError when `op` cannot run it."""
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
  """The stage plans `op`'s model chooses from. With one GEMM per chunk whatever the stages (f.stage_gemm_us), a
  larger stage gains no GEMM rate and only waits for its last chunk: one chunk per stage, though the model would
  rather save the overheads (measured: docs/performance.md)."""
  plans = op.planning.stage_candidates(world)
  if f.stage_gemm_us is None:
    return plans
  return [c for c in plans if max(c) == 1]


def plan(op, world: int, f, stages: tuple | None = None) -> PipelinedPlan:
  """The plan the model predicts fastest (or `stages`, pinned)."""
  if len(f.gemm_us) != world:
    raise ValueError(f"pipelined.plan: gemm_us needs {world} entries (1 .. world chunks), got {len(f.gemm_us)}")
  best = stages if stages is not None else min(candidates(op, world, f),
                                               key=lambda c: (op.planning.pipelined_us(c, f), len(c)))
  return PipelinedPlan(best, op.planning.pipelined_us(best, f), xla_us(world, f))
