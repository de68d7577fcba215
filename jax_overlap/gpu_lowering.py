"""The GPU lowering of the primitives: which algorithm takes a call, and the custom call it lowers to.

For each call on "cuda"/"rocm" (primitives.py registers these rules):
  1. The XLA reference decomposition when the user asked for it, when
     JAX_OVERLAP_DISABLE is set, when the native module is not built for this
     platform, or when no algorithm can take the call (an explicit "fused" or
     "pipelined" request then raises, saying why; "auto" falls back, and says
     why at DEBUG level).
  2. "pipelined" (csrc/pipelined/): the vendor GEMM per stage of chunks with
     copy-engine transfers; a group of one is the vendor GEMM alone.
     "fused" (csrc/kernels/): one persistent kernel of movers and GEMM tiles.
     "auto": the XLA path for a group of one (nothing to overlap); otherwise
     whichever the cost model (pipeline_plan.py, fed by calibration.py, and
     config.py's fused model) predicts fastest, taken only when it beats the
     XLA path by the model's margin.
  3. A group of two or more that takes the fused or pipelined path sets up the
     symmetric workspace (runtime.initialize) and a region of it; "auto"
     falls back to XLA on any shortfall (workspace full, peers not reachable,
     vendor BLAS missing, out of memory in the set-up or a measurement, no
     answer from another process in time; runtime.SetupError).

With several processes, a call of a group of two or more leads to collective
steps (the workspace's set-up, its region), so every process decides alike: the
cost model runs on process 0's figures (calibration.py), groups that span hosts
are found from one host map, and each process's proposal (the algorithm, its
plan and region, or why it cannot) is gathered from all: the call takes a path
only when every process proposes the same one, the XLA path otherwise, on every
process (an explicit algorithm then raises everywhere, naming the process and
its reason). Before the workspace exists a first round agrees on setting it up.
Each (call, algorithm, settings) is decided once per process and runtime
generation: lowering it again, on any process, asks nobody.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import os
import threading
import weakref

import jax
import numpy as np
from jax.interpreters import mlir

from jax_overlap import _compat, calibration, config, native, pipeline_plan, runtime

log = logging.getLogger("jax_overlap")

KILL_SWITCH = "JAX_OVERLAP_DISABLE"
# Pins the pipelined stage plan ("1,3": stage sizes in ring order) of the calls over a group of as many
# ranks as its stages cover, in place of the cost model's choice (tuning, tests).
PINNED_STAGES = "JAX_OVERLAP_PIPELINE_STAGES"
# Settings that change a call's plan, and so take part in naming its decision.
_PLAN_SETTINGS = (PINNED_STAGES, "JAX_OVERLAP_ARCH_TRAITS")


def disabled() -> bool:
  return runtime.env_flag(KILL_SWITCH)


@dataclasses.dataclass(frozen=True)
class Call:
  """One call as the lowering sees it. `m` is x's rows per batch element (ag_matmul: a shard's)."""

  op: str
  dtype_name: str
  batch: int
  m: int
  k: int
  n: int
  world: int
  groups: tuple  # every group's global device ids in rank order; () for a group of one
  w_kmajor: bool

  @property
  def rows(self) -> int:
    return self.batch * self.m

  @property
  def local_groups(self) -> tuple:
    """The groups this process's devices are in: the only ones it must reach (others may be on other hosts)."""
    local = runtime.local_device_ids()
    return tuple(g for g in self.groups if local & set(g))


@dataclasses.dataclass(frozen=True)
class Choice:
  algorithm: str  # "fused", "pipelined" or "all_gather"
  plan: object  # config.FusedPlan, pipeline_plan.PipelinedPlan, or None (a group of one's vendor GEMM)
  region: tuple | None = None  # (key, bytes) of its workspace region; None for a group of one
  offset: int = 0  # the region's offset, once placed

  def fingerprint(self) -> list:
    """What every rank of a group must share to run the call together (JSON)."""
    if isinstance(self.plan, pipeline_plan.PipelinedPlan):
      plan = list(self.plan.stages)
    elif isinstance(self.plan, config.FusedPlan):
      plan = [self.plan.tile, self.plan.comm_workgroups, self.plan.chunk_k, self.plan.tail_slots]
    else:
      plan = None
    return [self.algorithm, plan, repr(self.region), self.offset]


class Declined(Exception):
  """No algorithm takes the call; the message says why."""


def group_ids(ctx, axis_name) -> tuple:
  """Global device ids of every group of `axis_name`, each in rank order (axis_index order)."""
  axis_ctx = ctx.module_context.axis_context
  if not isinstance(axis_ctx, _compat.spmd_axis_context_type()):
    raise Declined("not inside shard_map or a custom partitioning")
  mesh = axis_ctx.mesh
  devices = getattr(mesh, "devices", None)
  if devices is None:
    raise Declined("the mesh has no concrete devices at lowering")
  auto = [a for a in mesh.axis_names if a not in axis_ctx.manual_axes and mesh.shape[a] > 1]
  if auto:
    raise Declined(f"mesh axes {auto} are not manual here (partially manual shard_map)")
  names = list(mesh.axis_names)
  ids = np.vectorize(lambda d: d.id, otypes=[np.int64])(np.asarray(devices))
  group_axes = [names.index(a) for a in axis_name]
  other_axes = [i for i in range(len(names)) if i not in group_axes]
  size = math.prod(mesh.shape[a] for a in axis_name)
  ids = ids.transpose(other_axes + group_axes).reshape(-1, size)
  return tuple(tuple(int(i) for i in g) for g in ids)


def _native_ready(ctx) -> None:
  if disabled():
    raise Declined(f"{KILL_SWITCH} is set")
  if native.platform() is None:
    raise Declined("the native extension is not built")
  if ctx.module_context.platforms != (native.platform(),):
    raise Declined(f"the extension is built for {native.platform()}")
  native.ensure_registered()


def _vendor_blas() -> None:
  """Loads the vendor BLAS on every local GPU now, at lowering: never during a command buffer's capture; and
  checks, once per GPU, that its GEMM replays right from a captured graph (csrc/blas/capture_check.h)."""
  try:
    for ordinal in runtime.local_ordinals():
      check = native.module().prepare_vendor_blas(ordinal)
      if check["checked_now"] and not check["graph_safe"]:
        log.info("jax_overlap: the vendor GEMM on GPU %d failed its graph-capture check (%s): pipelined calls of a "
                 "group of one run outside XLA's command buffers", ordinal, check["detail"])
  except RuntimeError as e:
    raise Declined(str(e)) from e


# The fused kernels' GEMM engine against the vendor GEMM (0.62-0.66x cuBLAS on
# the H200, benchmarks/results): the fused model's engine rate is the measured
# vendor rate times this.
FUSED_ENGINE_RATIO = 0.63


# With several processes the figures are a collective step (process 0 measures): the planners take them before
# anything of this process alone can decline the call, so that every process reaches the same steps.

def _fused_plan(call: Call, algorithm: str):
  figures = (calibration.figures(call.op, call.dtype_name, call.rows, call.k, call.n, call.world, call.w_kmajor)
             if algorithm == "auto" else None)
  device = runtime.device_props()
  if figures is not None:
    # The fused model fed with this machine's figures (vendor GEMM rate, peer link) as the pipelined one is.
    vendor = 2.0 * call.world * pipeline_plan.chunk_rows(call.op, call.rows, call.world) * call.k * call.n / \
        figures.gemm_us[-1]
    device = dataclasses.replace(device, vendor_flops=vendor, engine_flops=FUSED_ENGINE_RATIO * vendor,
                                 link_bytes=figures.link_bytes_per_us)
  planner = config.plan_ag_matmul if call.op == "ag_matmul" else config.plan_matmul_rs
  geometry = functools.partial(native.gemm_geometry, call.op, dtype_name=call.dtype_name, w_kmajor=call.w_kmajor,
                               world=call.world, batch=call.batch, m=call.m, k=call.k, n=call.n, device=device)
  plan, why = planner(dtype_name=call.dtype_name, rows=call.rows, k=call.k, n=call.n, world=call.world,
                      device=device, tiles=native.tile_shapes(), geometry=geometry, algorithm=algorithm)
  if plan is None:
    raise Declined(why)
  return plan


def _pipelined_plan(call: Call) -> pipeline_plan.PipelinedPlan | None:
  why = pipeline_plan.eligible(call.op, call.dtype_name, call.rows, call.k, call.n, call.world, config.MAX_WORLD)
  if why:
    raise Declined(why)
  if call.world == 1:
    _vendor_blas()
    return None
  figures = calibration.figures(call.op, call.dtype_name, call.rows, call.k, call.n, call.world, call.w_kmajor)
  _vendor_blas()
  pinned = os.environ.get(PINNED_STAGES)
  try:
    stages = pipeline_plan.parse_stages(pinned, call.op, call.world) if pinned else None
  except ValueError as e:
    raise ValueError(f"jax_overlap: {PINNED_STAGES}: {e}") from None
  return pipeline_plan.plan(call.op, call.world, figures, stages)


def _estimates(algorithm: str, plan) -> tuple:
  """The model's times (us) for `algorithm`'s plan and for the XLA path."""
  if algorithm == "pipelined":
    return plan.est_us, plan.est_xla_us
  return plan.est_fused_us, plan.est_xla_us


def _preferred(call: Call, algorithm: str) -> str:
  """The algorithm that would take the call, judged before any workspace exists (auto: with the link guessed)."""
  if call.op == "all_gather":
    if call.world < 2 or call.k * np.dtype(call.dtype_name).itemsize % 16:
      raise Declined("a group of one, or rows not 16-byte multiples")
    return "all_gather"
  if algorithm == "pipelined":
    _pipelined_plan(call)
    return algorithm
  if algorithm == "fused":
    _fused_plan(call, algorithm)
    return algorithm
  if call.world == 1:
    raise Declined("a group of one has no communication to overlap: XLA's dot")
  reasons, options = [], []
  for candidate, planner in (("pipelined", _pipelined_plan), ("fused", lambda c: _fused_plan(c, "auto"))):
    try:
      plan = planner(call)
    except Declined as e:
      reasons.append(f"{candidate}: {e}")
      continue
    est, est_xla = _estimates(candidate, plan)
    if pipeline_plan.faster(est, est_xla):
      options.append((est, candidate))
    else:
      reasons.append(f"{candidate}: the cost model predicts {est:.0f} us vs xla {est_xla:.0f} us")
  if not options:
    raise Declined("; ".join(reasons))
  return min(options)[1]


def _planned(call: Call, algorithm: str, mode: str) -> Choice:
  """`algorithm`'s plan and region for the call, once the workspace a group of two or more needs exists.
  mode "auto" declines a plan that, planned again with the measured link, no longer beats XLA."""
  if call.op == "all_gather":
    row_bytes = call.k * np.dtype(call.dtype_name).itemsize
    nbytes = native.module().all_gather_region_bytes(call.world, call.rows, row_bytes)
    return Choice("all_gather", None, (("all_gather", call.groups, (call.rows, call.k, call.dtype_name)), nbytes))
  if algorithm == "pipelined":
    plan = _pipelined_plan(call)
    region = None if call.world == 1 else (
        (f"{call.op}/pipelined", call.groups, (call.batch, call.m, call.k, call.n)),
        native.module().pipelined_region_bytes(call.op, call.world, call.batch, call.m, call.k, call.n, 2))
  else:
    plan = _fused_plan(call, mode)
    region = None if call.world == 1 else (
        (f"{call.op}/fused", call.groups, (call.batch, call.m, call.k, call.n, plan.tile, plan.chunk_k)),
        plan.region_bytes)
  if mode == "auto":
    # Planned again once the workspace exists: with the measured link, and the
    # ranks sharing a GPU known (the fused kernels split its SMs between them).
    est, est_xla = _estimates(algorithm, plan)
    if not pipeline_plan.faster(est, est_xla):
      raise Declined(f"{algorithm}: with the measured link the cost model predicts {est:.0f} us vs xla "
                     f"{est_xla:.0f} us")
  return Choice(algorithm, plan, region)


def _set_up() -> None:
  """Sets the workspace up (collective; a failure is every process's)."""
  try:
    runtime.initialize()
  except runtime.SetupError as e:
    raise Declined(str(e)) from e
  if not runtime.is_active():
    raise Declined("no GPU workspace")


def _reachable(call: Call) -> None:
  ids = {i for g in call.local_groups for i in g}
  if not runtime.reachable(ids):
    raise Declined("the group spans devices this process cannot reach (another host)")


def _placed(choice: Choice) -> Choice:
  """The choice with its region's offset (the region is not recorded yet)."""
  return choice if choice.region is None else dataclasses.replace(choice, offset=runtime.placement(*choice.region))


def choose(call: Call, algorithm: str) -> Choice:
  """The algorithm, plan and placed region that take `call`, or Declined saying why none does."""
  if call.world > 1 and jax.process_count() > 1:
    return _agreed_choice(call, algorithm)
  preferred = _preferred(call, algorithm)
  if call.world > 1:
    _set_up()
    _reachable(call)
  choice = _placed(_planned(call, preferred, algorithm))
  if choice.region is not None:
    runtime.place(*choice.region, choice.offset)
  return choice


# --- one decision for every process ------------------------------------------------
# (call, algorithm, plan settings, runtime generation) -> (Choice, None) or (None, why not), decided with every
# process once; a later lowering of the same call, by any process, reuses it.
_decisions: dict = {}
# One decision at a time in a process: each is a collective step, which one process must not enter twice.
_deciding = threading.Lock()


def _agreed_choice(call: Call, algorithm: str) -> Choice:
  key = (call, algorithm, tuple(os.environ.get(name, "") for name in _PLAN_SETTINGS), runtime.generation())
  with _deciding:
    if key not in _decisions:
      _decisions[key] = _agree(call, algorithm, f"decide/{runtime.digest(key)}")
  choice, why = _decisions[key]
  if choice is None:
    raise Declined(why)
  return choice


def _agree(call: Call, algorithm: str, name: str) -> tuple:
  """The choice every process proposes for the call, or why there is none (the same on every process)."""
  if not runtime.is_active() and runtime.setup_failed() is None:
    # The set-up is collective: first agree that every process wants it for this call.
    wanted, why = _decided(f"{name}/setup", _proposal(algorithm, lambda: _setup_proposal(call, algorithm)))
    if wanted is None:
      return None, why
  choice = None

  def final():
    nonlocal choice
    choice = _final_choice(call, algorithm)
    return choice.fingerprint()

  agreed, why = _decided(f"{name}/final", _proposal(algorithm, final))
  if agreed is None:
    return None, why
  runtime.place(*choice.region, choice.offset)
  return choice, None


def _within_hosts(call: Call) -> None:
  hosts = runtime.hosts()
  for group in call.groups:
    names = sorted({hosts.get(i, "a process without GPUs") for i in group})
    if len(names) > 1:
      raise Declined(f"the group {group} spans hosts {names}")


def _setup_proposal(call: Call, algorithm: str) -> str:
  _within_hosts(call)
  return _preferred(call, algorithm)


def _final_choice(call: Call, algorithm: str) -> Choice:
  # The collective steps (host map, set-up, figures) first, then what this process alone can refuse.
  _within_hosts(call)
  _set_up()
  preferred = _preferred(call, algorithm)
  _reachable(call)
  return _placed(_planned(call, preferred, algorithm))


def _proposal(algorithm: str, propose) -> dict:
  """This process's proposal (JSON): what propose() returns, or why it cannot take the call."""
  try:
    return {"choice": propose(), "why": None}
  except runtime.WorkspaceFullError as e:
    if algorithm == "auto":
      runtime.note_workspace_full(e)
    return {"choice": None, "why": str(e)}
  except (Declined, runtime.SetupError) as e:
    return {"choice": None, "why": str(e)}


def _decided(name: str, proposal: dict) -> tuple:
  """(the choice every process proposed, None), or (None, why not): the same on every process."""
  try:
    proposals = runtime.gather(name, proposal)
  except runtime.SetupError as e:
    return None, str(e)
  declined = [(p, q["why"]) for p, q in enumerate(proposals) if q["choice"] is None]
  if declined:
    reasons = {why for _, why in declined}
    if len(declined) == len(proposals) and len(reasons) == 1:
      return None, reasons.pop()
    return None, "; ".join(f"process {p}: {why}" for p, why in declined)
  choices = [q["choice"] for q in proposals]
  if any(c != choices[0] for c in choices):
    return None, "the processes chose differently: " + "; ".join(f"process {p}: {c}" for p, c in enumerate(choices))
  return choices[0], None


# --- call sites --------------------------------------------------------------------
# The module being lowered -> {region key: its calls lowered so far}: a call site's name is its module and its
# place among that module's calls of the region (runtime.site).
_lowered_sites = weakref.WeakKeyDictionary()


def _site(ctx, region_key: tuple) -> int:
  module = ctx.module_context.module
  seen = _lowered_sites.setdefault(module, collections.Counter())
  seen[region_key] += 1
  attributes = module.operation.attributes
  module_name = mlir.ir.StringAttr(attributes["sym_name"]).value if "sym_name" in attributes else ""
  return runtime.site(region_key, (module_name, seen[region_key]))


# --- emitting the custom calls ---------------------------------------------------

def _bias_operand(x_aval, bias):
  return (bias[0] if bias else mlir.ir_constant(np.zeros((0,), x_aval.dtype)),
          jax.core.ShapedArray((0,), x_aval.dtype))


def _u8(nbytes: int):
  return jax.core.ShapedArray((int(nbytes),), np.uint8)


def _emit_fused(ctx, call: Call, choice: Choice, x, w, bias):
  plan = choice.plan
  x_aval, w_aval = ctx.avals_in[:2]
  bias_value, empty = _bias_operand(x_aval, bias)
  avals_in = [x_aval, w_aval, ctx.avals_in[2] if bias else empty]
  site = _site(ctx, choice.region[0]) if call.world > 1 else 0
  attrs = plan.attribute(w_kmajor=call.w_kmajor, region_offset=choice.offset, site=site,
                         generation=runtime.generation())
  log.debug("jax_overlap.%s: fused (world %d, tile %d, comm workgroups %d, chunk_k %d; model %.0f us vs xla %.0f us)",
            call.op, call.world, plan.tile, plan.comm_workgroups, plan.chunk_k, plan.est_fused_us, plan.est_xla_us)
  if call.world == 1:
    # No protocol, but the GPU's device state, which shutdown() frees: a target XLA dispatches each run (no
    # command buffer), whose handler checks the generation. The second result is the stream-K tail's scratch
    # (FusedPlan.tail_slots).
    sub_ctx = ctx.replace(avals_in=avals_in, avals_out=[ctx.avals_out[0], _u8(plan.tail_scratch_bytes)])
    y = jax.ffi.ffi_lowering(native.target(call.op + "_local"))(sub_ctx, x, w, bias_value, config=attrs)[0]
    return [y, x] if call.op == "ag_matmul" else [y]  # a group of one gathers x itself
  sub_ctx = ctx.replace(avals_in=avals_in, avals_out=list(ctx.avals_out))
  return jax.ffi.ffi_lowering(native.target(call.op))(
      sub_ctx, x, w, bias_value, config=attrs, groups=np.array([i for g in call.groups for i in g], np.int64),
      world=np.int64(call.world))


def _emit_pipelined(ctx, call: Call, choice: Choice, x, w, bias):
  nat, plan = native.module(), choice.plan
  x_aval, w_aval = ctx.avals_in[:2]
  bias_value, empty = _bias_operand(x_aval, bias)
  avals_in = [x_aval, w_aval, ctx.avals_in[2] if bias else empty]
  scratch = _u8(nat.pipelined_scratch_bytes(call.op, call.world, call.batch, call.m, call.n, 2))
  if call.world == 1:
    log.debug("jax_overlap.%s: pipelined, a group of one: the vendor GEMM", call.op)
    sub_ctx = ctx.replace(avals_in=avals_in, avals_out=[ctx.avals_out[0], scratch])
    # In XLA's command buffers only where the vendor GEMM passed its capture check (_vendor_blas).
    target = native.target("vendor_gemm" if nat.vendor_gemm_graph_safe() else "vendor_gemm_no_graph")
    y = jax.ffi.ffi_lowering(target)(sub_ctx, x, w, bias_value, w_kmajor=np.int64(call.w_kmajor))[0]
    return [y, x] if call.op == "ag_matmul" else [y]
  region_key, region_bytes = choice.region
  log.debug("jax_overlap.%s: pipelined (world %d, stages %s; model %.0f us vs xla %.0f us)", call.op, call.world,
            plan.stages, plan.est_us, plan.est_xla_us)
  sub_ctx = ctx.replace(avals_in=avals_in, avals_out=list(ctx.avals_out) + [scratch])
  config_attr = {"w_kmajor": np.int64(call.w_kmajor), "region_offset": np.int64(choice.offset),
                 "region_bytes": np.int64(region_bytes), "site": np.int64(_site(ctx, region_key)),
                 "generation": np.int64(runtime.generation())}
  outs = jax.ffi.ffi_lowering(native.target(call.op + "_pipelined"))(
      sub_ctx, x, w, bias_value, config=config_attr,
      groups=np.array([i for g in call.groups for i in g], np.int64), world=np.int64(call.world),
      stages=np.array(plan.stages, np.int64))
  return outs[:-1]


def _fallback(op: str, algorithm: str, error: Exception) -> None:
  """Raises for an explicit algorithm; for "auto", says why the call takes the XLA path (DEBUG)."""
  if algorithm != "auto":
    raise ValueError(f"jax_overlap.{op}: algorithm={algorithm!r} cannot take this call: {error}") from error
  if isinstance(error, runtime.WorkspaceFullError):
    runtime.note_workspace_full(error)
  log.debug("jax_overlap.%s: XLA path (%s)", op, error)


# What a call that cannot take a GPU path raises: Declined, a full workspace, or a set-up that failed (out of
# memory, no answer from another process in time). Once a choice is made (and agreed), emitting it never falls back.
_DECLINED = (Declined, runtime.WorkspaceFullError, runtime.SetupError)


def gpu_rule(ctx, x, w, *bias, op, axis_name, axis_size, algorithm, w_kmajor, lower_reference):
  """The lowering of ag_matmul_p / matmul_rs_p on a GPU platform (see the module docstring)."""
  params = dict(axis_name=axis_name, axis_size=axis_size, algorithm=algorithm, w_kmajor=w_kmajor)
  if algorithm == "xla" or disabled():
    if algorithm != "xla":
      log.debug("jax_overlap.%s: XLA path (%s is set)", op, KILL_SWITCH)
    return lower_reference(ctx, x, w, *bias, op=op, **params)
  x_aval, w_aval = ctx.avals_in[:2]
  *lead, m, k = x_aval.shape
  try:
    _native_ready(ctx)
    groups = () if axis_name is None else group_ids(ctx, axis_name)
    call = Call(op, np.dtype(x_aval.dtype).name, math.prod(lead), m, k, w_aval.shape[0 if w_kmajor else 1],
                axis_size if axis_name is not None else 1, groups, bool(w_kmajor))
    choice = choose(call, algorithm)
  except _DECLINED as e:
    _fallback(op, algorithm, e)
    return lower_reference(ctx, x, w, *bias, op=op, **params)
  emit = _emit_pipelined if choice.algorithm == "pipelined" else _emit_fused
  return emit(ctx, call, choice, x, w, bias)


def gather_gpu_rule(ctx, x, *, axis_name, axis_size, lower_default):
  """The runtime's all-gather on the symmetric workspace (tests); XLA's all_gather where it cannot run."""
  x_aval = ctx.avals_in[0]
  try:
    _native_ready(ctx)
    groups = group_ids(ctx, axis_name)
    call = Call("all_gather", np.dtype(x_aval.dtype).name, 1, math.prod(x_aval.shape[:-1]), x_aval.shape[-1], 0,
                axis_size, groups, False)
    choice = choose(call, "all_gather")
  except _DECLINED as e:
    log.debug("jax_overlap.all_gather: XLA path (%s)", e)
    return lower_default(ctx, x, axis_name=axis_name, axis_size=axis_size)
  region_key, region_bytes = choice.region
  return jax.ffi.ffi_lowering(native.target("all_gather"))(
      ctx, x, config={"region_offset": np.int64(choice.offset), "region_bytes": np.int64(region_bytes),
                      "site": np.int64(_site(ctx, region_key)), "generation": np.int64(runtime.generation())},
      groups=np.array([i for g in groups for i in g], np.int64), world=np.int64(axis_size))
