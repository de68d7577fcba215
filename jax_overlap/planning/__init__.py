"""Which GPU algorithm takes a call, and with which plan: one decision, from figures measured on the machine.

  planning/figures.py    what the models know of the machine (measured: GEMM and reduction times, copy rates)
  planning/pipelined.py  the pipelined algorithm's stage planner and cost model
  planning/fused.py      the fused kernels' tile and mover planner and cost model
  planning/agreement.py  choose(): the decision with the workspace it needs, and agreed between processes
  planning/tuning.py     the vendor GEMM's algorithm per problem of a pipelined call, timed and agreed
and here, eligibility (each GPU algorithm's, and the float8 formats this process's GPUs run) and decide(): an
explicit algorithm's plan, or for "auto" the candidate
the models predict fastest, taken only when it beats the XLA path by
AUTO_MARGIN. Each algorithm's eligibility is judged once, before anything is
measured; each candidate is planned once from the figures at hand. What is op
specific (chunks, the pipelined model, what the fused movers carry) is the op
module's (ops/), passed in as `op`; nothing here branches on an op's name.

With several processes the figures are a collective step (process 0
measures): a planner takes them after the eligibility, which is the same on
every process, and before anything that one process alone can refuse (the
vendor BLAS, the tiles its GPU can hold), so that every process reaches the
same steps.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import numpy as np

from jax_overlap.planning import figures, fused, pipelined, tuning
from jax_overlap.quantization import formats
from jax_overlap.runtime import backend, settings, workspace

log = logging.getLogger("jax_overlap")

# `auto` takes a GPU algorithm only when its model predicts it at least this
# much faster than the XLA path: the model's error must not make a call slower
# than XLA.
AUTO_MARGIN = 0.95
# Largest group the GPU algorithms take: the size of the kernels' per-rank pointer table
# (kMaxWorld in csrc/kernels/params.h; a native test checks they agree).
MAX_WORLD = 8
# The fused kernels' GEMM engine against the vendor GEMM (0.62-0.66x cuBLAS on
# the H200, benchmarks/results): the fused model's engine rate is the measured
# vendor rate times this.
FUSED_ENGINE_RATIO = 0.63


class Declined(Exception):
  """No algorithm takes the call; the message says why."""


@dataclasses.dataclass(frozen=True)
class Problem:
  """One call as the planner sees it. `m` is x's rows per batch element (ag_matmul: a shard's). A float8 call
  names its scales' Scaling, its w's dtype and its output's; a 16-bit call's are x's."""

  op: str
  dtype_name: str  # x's
  batch: int
  m: int
  k: int
  n: int
  world: int
  groups: tuple  # every group's global device ids in rank order; () for a group of one
  w_kmajor: bool  # as the GPU gets w (float8: always, csrc/blas/cublaslt_api.h)
  out_dtype_name: str | None = None
  w_dtype_name: str | None = None
  scaling: object = None  # the Scaling of a float8 call's scales (quantization/scaling.py), else None
  gemm_bias: bool = False  # the vendor GEMMs add the call's bias (it has one, and XLA does not add it after)

  @property
  def scaled(self) -> bool:
    return self.scaling is not None

  @property
  def fast_accumulation(self) -> bool:
    return self.scaled and self.scaling.fast_accumulation

  @property
  def x_scale_shared(self) -> bool:
    """ag_matmul's gathered shards share one x scale (Scaling.x_shared): its GEMMs take several at once."""
    return self.scaled and self.scaling.x_shared

  @property
  def rows(self) -> int:
    return self.batch * self.m

  @property
  def out_dtype(self) -> str:
    return self.out_dtype_name or self.dtype_name

  @property
  def w_dtype(self) -> str:
    return self.w_dtype_name or self.dtype_name


@dataclasses.dataclass(frozen=True)
class Choice:
  algorithm: str  # "pipelined", "fused" or "all_gather"
  plan: object  # fused.FusedPlan, pipelined.PipelinedPlan, or None (a group of one's vendor GEMM, all_gather)
  region: tuple | None = None  # (key, bytes) of its workspace region; None for a group of one
  offset: int = 0  # the region's offset, once placed

  def estimates(self) -> tuple:
    """The model's times (us) for the plan and for the XLA path."""
    return self.plan.est_us, self.plan.est_xla_us

  def fingerprint(self) -> list:
    """What every rank of a group must share to run the call together (JSON)."""
    return [self.algorithm, None if self.plan is None else self.plan.fingerprint(), repr(self.region), self.offset]


def faster(est_us: float, est_xla_us: float) -> bool:
  """Whether `auto` should take a path the model predicts at est_us over XLA's est_xla_us."""
  return math.isfinite(est_us) and est_us < AUTO_MARGIN * est_xla_us


def eligible(problem: Problem, op, algorithm: str) -> str | None:
  """None when `algorithm` ("pipelined" or "fused") can take the call, else why not."""
  if not formats.takes(algorithm, problem.dtype_name):
    return (f"dtype {problem.dtype_name} (the {algorithm} algorithm takes "
            f"{', '.join(formats.dtypes_for(algorithm))})")
  if problem.world > MAX_WORLD:
    return f"group of {problem.world} ranks (at most {MAX_WORLD})"
  vector = formats.vector_elems(problem.dtype_name)
  if problem.k % vector or problem.n % vector:
    return f"k={problem.k} and n={problem.n} must be multiples of {vector} (16-byte rows)"
  if problem.rows == 0 or problem.k == 0 or problem.n == 0:
    return "empty operand"
  partial = formats.partial(problem.out_dtype)
  if algorithm == "fused" and op.REDUCES and problem.world > 1 and partial != problem.out_dtype:
    return (f"a {problem.out_dtype} result with peers: the fused kernel stages each rank's partial in the result's "
            f"dtype, where a partial past its range is inf while the sum is not (the pipelined algorithm and the XLA "
            f"path stage them in {partial})")
  if problem.scaled and algorithm == "pipelined":
    archs = tuple(sorted({arch for _, arch in workspace.local_gpus()}))
    rows = problem.rows if problem.world == 1 else op.chunk_rows(problem.m, problem.world)
    why = (fp8_declined(problem.dtype_name, problem.w_dtype)
           or problem.scaling.gpu_refused(archs, rows, problem.batch, problem.world))
    if why:
      return why
  return op.eligible(problem.rows, problem.world)


def fp8_declined(*operand_dtypes) -> str | None:
  """Why this process's GPUs cannot run these float8 operands (the dtype and the device, in words), or None:
  they can, or no operand is float8, or no GPU is known here. The formats each GPU runs are its float8 family's
  (formats.fp8_family_of; the native module's vendor GEMM agrees: tests/test_formats.py)."""
  families = {formats.fp8_family(d): formats.name(d) for d in operand_dtypes if formats.is_fp8(d)}
  if not families:
    return None
  for name, arch in workspace.local_gpus():
    for family, dtype_name in families.items():
      if formats.fp8_family_of(arch) != family:
        return (f"{dtype_name} on this device ({name}, {arch}): {family.upper()} float8 formats run on "
                f"{formats.fp8_devices(family)}")
  return None


def _vendor_blas() -> None:
  """Loads the vendor BLAS on every local GPU now, at lowering: never during a command buffer's capture; and
  checks, once per GPU, that its GEMM replays right from a captured graph (csrc/blas/capture_check.h)."""
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
  # The GEMMs' algorithms are agreed (a collective step) before the vendor BLAS is prepared here (a step this
  # process alone can fail), then installed on this process's GPUs.
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
      op.NAME, problem.world, problem.batch, problem.m, problem.k, problem.n, *sizes)
  # Calls of one key share a region: its bytes follow the element sizes (and a float8 shard's scale header) as
  # they do the shape.
  key = (f"{op.NAME}/pipelined", problem.groups, (problem.batch, problem.m, problem.k, problem.n, *sizes))
  return Choice("pipelined", plan, (key, nbytes))


def _plan_fused(problem: Problem, op, auto: bool) -> Choice:
  """auto: the model fed with this machine's figures (vendor GEMM rate, peer link) as the pipelined one is."""
  why = eligible(problem, op, "fused")
  if why:
    raise Declined(why)
  f = _measured(problem, op) if auto else None
  device = workspace.device_props()
  if f is not None:
    chunk_rows = op.chunk_rows(problem.rows, problem.world)
    vendor = 2.0 * problem.world * chunk_rows * problem.k * problem.n / f.gemm_us[-1]
    device = dataclasses.replace(device, vendor_flops=vendor, engine_flops=FUSED_ENGINE_RATIO * vendor,
                                 link_bytes=f.link_bytes_per_us)
  machine = backend.current()
  geometry = functools.partial(machine.gemm_geometry, op.NAME, dtype_name=problem.dtype_name,
                               w_kmajor=problem.w_kmajor, world=problem.world, batch=problem.batch, m=problem.m,
                               k=problem.k, n=problem.n, device=device)
  plan, why = fused.plan(op, dtype_name=problem.dtype_name, rows=problem.rows, k=problem.k, n=problem.n,
                         world=problem.world, device=device, tiles=machine.tile_shapes(), geometry=geometry)
  if plan is None:
    raise Declined(why)
  if problem.world == 1:
    return Choice("fused", plan)
  key = (f"{op.NAME}/fused", problem.groups, (problem.batch, problem.m, problem.k, problem.n,
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
  """The algorithm and plan that take the call, or Declined saying why none does.

  requested: an algorithm (its plan, whatever the models predict), or "auto":
  the fastest of op.ALGORITHMS the models predict AUTO_MARGIN faster than the
  XLA path. again: auto's choice made before the workspace existed, judged once
  more now that it does (the link measured, the ranks sharing a GPU known).
  """
  if requested != "auto":
    return _PLANNERS[requested](problem, op, auto=False)
  if problem.world == 1:
    if not problem.scaled:
      raise Declined("a group of one has no communication to overlap: XLA's dot")
    # A float8 group of one is the vendor's fp8 GEMM: XLA's fp8 forms ran 1.1x (16384 rows) to 3.1x (2048 rows)
    # slower than cuBLASLt's on the H200 (jax 0.11.2, through torch._scaled_mm; benchmarks/bench_fp8.py times both).
    return _plan_pipelined(problem, op, auto=True)
  if problem.scaled and not problem.scaling.xla_gemm:
    # No fp8 GEMM of XLA's takes these scales (block scales): its form is a float32 dot (benchmarks/bench_fp8.py
    # times it), which the model's XLA path (the vendor's fp8 rate) would flatter.
    return _plan_pipelined(problem, op, auto=True)
  if again is not None:
    choice = _PLANNERS[again](problem, op, auto=True)
    est, est_xla = choice.estimates()
    if not faster(est, est_xla):
      raise Declined(f"{again}: with the measured link the cost model predicts {est:.0f} us vs xla "
                     f"{est_xla:.0f} us")
    return choice
  reasons, options = [], []
  for algorithm in op.ALGORITHMS:
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
