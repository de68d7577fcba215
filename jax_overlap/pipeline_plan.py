"""The pipelined algorithm's stage plan, and the cost model `auto` decides with (pure functions).

A pipelined call runs the vendor GEMM per stage of consecutive chunks (ring
positions, csrc/pipelined/schedule.h) while copy engines move chunks between
ranks. Few large stages waste less of the GEMM (a 2048-row chunk of a
16384 x 3584 x 8192 GEMM runs at 0.91x the whole GEMM's rate on the H200) but
wait longer for their data; the plan is the split of the ring into stages that
the model predicts fastest, out of every split (at most 2^7 for 8 ranks).

The model's figures are measured on the machine (jax_overlap/calibration.py):
the vendor GEMM's time at each number of chunks the call's stages may cover,
matmul_rs's reduction kernel, the peer link and the local copy rate. Only the overheads below are fixed.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

# A stage's wait on its data and its launch on a side stream (event wait, GEMM
# launch gap), and a call's fork, join and trailing kernel: the order of
# magnitude of the launch gaps on a stream, not tuned to a machine.
STAGE_OVERHEAD_US = 2.0
CALL_OVERHEAD_US = 6.0
# `auto` takes the pipelined (or fused) path only when the model predicts it at
# least this much faster than the XLA path: the model's error must not make a
# call slower than XLA.
AUTO_MARGIN = 0.95

OPS = ("ag_matmul", "matmul_rs")
DTYPE_NAMES = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Figures:
  """What the model knows of one call on this machine (times in us, rates in bytes per us)."""

  gemm_us: tuple  # gemm_us[s - 1]: the vendor GEMM over s chunks' rows, s = 1 .. world
  chunk_bytes: int  # bytes of one chunk a rank receives (ag_matmul: a shard of x; matmul_rs: a block of partials)
  link_bytes_per_us: float  # a copy-engine pull from a peer
  local_bytes_per_us: float  # a copy-engine copy within this GPU
  reduce_us: float | None = None  # matmul_rs's reduction of world blocks into one (None: from the local copy rate)


@dataclasses.dataclass(frozen=True)
class PipelinedPlan:
  """A pipelined call's stages (ring positions per stage) and the model's times for it and the XLA path."""

  stages: tuple
  est_us: float
  est_xla_us: float


def eligible(op: str, dtype_name: str, rows: int, k: int, n: int, world: int, max_world: int) -> str | None:
  """None when the pipelined algorithm can take the call, else why not."""
  if dtype_name not in DTYPE_NAMES:
    return f"dtype {dtype_name} (the pipelined algorithm takes {', '.join(DTYPE_NAMES)})"
  if world > max_world:
    return f"group of {world} ranks (at most {max_world})"
  if k % 8 or n % 8:
    return f"k={k} and n={n} must be multiples of 8 (16-byte rows)"
  if rows == 0 or k == 0 or n == 0:
    return "empty operand"
  if op == "matmul_rs" and rows % world:
    return f"rows={rows} not divisible by the group size {world}"
  return None


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


def _gemm(f: Figures, chunks: int) -> float:
  return f.gemm_us[chunks - 1]


def ag_matmul_us(stages: tuple, f: Figures) -> float:
  """Model of a pipelined ag_matmul: stage 0 (the own shard) at once; stage j once its last shard has
  arrived (a copy of x into the published slot, then one pull per ring position, in order)."""
  pull = f.chunk_bytes / f.link_bytes_per_us
  publish = f.chunk_bytes / f.local_bytes_per_us
  end, position = _gemm(f, stages[0]), stages[0]
  for size in stages[1:]:
    arrived = publish + (position + size - 1) * pull
    end = max(end, arrived) + STAGE_OVERHEAD_US + _gemm(f, size)
    position += size
  return end + CALL_OVERHEAD_US


def matmul_rs_us(stages: tuple, f: Figures) -> float:
  """Model of a pipelined matmul_rs: the stages' GEMMs back to back (peers run the same schedule, so
  the peer at ring distance i has my block ready when its stage holding position i - 1 ends), the
  pulls of my block in that order, then the reduction of world partials (read) into one (written)."""
  world = sum(stages)
  ready, t = [], 0.0
  for size in stages:
    t += STAGE_OVERHEAD_US + _gemm(f, size)
    ready += [t] * size
  pull, pulled = f.chunk_bytes / f.link_bytes_per_us, 0.0
  for i in range(1, world):
    pulled = max(pulled, ready[i - 1] + STAGE_OVERHEAD_US) + pull
  reduce = f.reduce_us
  if reduce is None:  # a copy moves each byte twice (read and write); the reduction reads world blocks, writes one
    reduce = (world + 1) * f.chunk_bytes / (2 * f.local_bytes_per_us)
  return max(t, pulled) + reduce + CALL_OVERHEAD_US


def xla_us(world: int, f: Figures) -> float:
  """Model of the XLA path: the collective (world - 1 chunks over the link), then the whole GEMM."""
  return (world - 1) * f.chunk_bytes / f.link_bytes_per_us + _gemm(f, world)


def parse_stages(text: str, op: str, world: int) -> tuple | None:
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
  if op == "ag_matmul" and stages[0] != 1:
    raise ValueError(f"stage plan {text!r}: ag_matmul's first stage is its own shard alone (1)")
  return stages


def plan(op: str, world: int, f: Figures, stages: tuple | None = None) -> PipelinedPlan:
  """The stages the model predicts fastest (or `stages`, pinned), with its times for them and for the XLA path."""
  if len(f.gemm_us) != world:
    raise ValueError(f"pipeline_plan.plan: gemm_us needs {world} entries (1 .. world chunks), got {len(f.gemm_us)}")
  if op == "ag_matmul":
    candidates = [(1,) + rest for rest in compositions(world - 1)] if world > 1 else [(1,)]
    model = ag_matmul_us
  else:
    candidates, model = list(compositions(world)), matmul_rs_us
  best = stages if stages is not None else min(candidates, key=lambda c: (model(c, f), len(c)))
  return PipelinedPlan(best, model(best, f), xla_us(world, f))


def chunk_rows(op: str, rows: int, world: int) -> int:
  """Rows of x in one chunk: ag_matmul's shard is all of x; matmul_rs's block is a world-th of it."""
  return rows if op == "ag_matmul" else rows // world


def chunk_bytes(op: str, rows: int, k: int, n: int, world: int, elem_bytes: int = 2) -> int:
  """Bytes a rank receives per chunk: a shard of x [rows, k] (ag_matmul), a block of partials (matmul_rs)."""
  return chunk_rows(op, rows, world) * (k if op == "ag_matmul" else n) * elem_bytes


def faster(est_us: float, est_xla_us: float) -> bool:
  """Whether `auto` should take a path the model predicts at est_us over XLA's est_xla_us."""
  return math.isfinite(est_us) and est_us < AUTO_MARGIN * est_xla_us
