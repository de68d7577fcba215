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
     vendor BLAS missing).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os

import jax
import numpy as np
from jax.interpreters import mlir

from jax_overlap import _compat, calibration, config, native, pipeline_plan, runtime

log = logging.getLogger("jax_overlap")

KILL_SWITCH = "JAX_OVERLAP_DISABLE"
# Pins the pipelined stage plan ("1,3": stage sizes in ring order) of the calls over a group of as many
# ranks as its stages cover, in place of the cost model's choice (tuning, tests).
PINNED_STAGES = "JAX_OVERLAP_PIPELINE_STAGES"


def disabled() -> bool:
  return os.environ.get(KILL_SWITCH, "0") not in ("", "0", "false", "False")


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

  @property
  def spans_processes(self) -> bool:
    local = runtime.local_device_ids()
    return any(i not in local for g in self.local_groups for i in g)


@dataclasses.dataclass(frozen=True)
class Choice:
  algorithm: str  # "fused" or "pipelined"
  plan: object  # config.FusedPlan, pipeline_plan.PipelinedPlan, or None (a group of one's vendor GEMM)


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


def _fused_plan(call: Call, algorithm: str):
  device = runtime.device_props()
  if algorithm == "auto":
    # The fused model fed with this machine's figures (vendor GEMM rate, peer link) as the pipelined one is.
    figures = calibration.figures(call.op, call.dtype_name, call.rows, call.k, call.n, call.world, call.w_kmajor,
                                  call.spans_processes)
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
  _vendor_blas()
  if call.world == 1:
    return None
  figures = calibration.figures(call.op, call.dtype_name, call.rows, call.k, call.n, call.world, call.w_kmajor,
                                call.spans_processes)
  pinned = os.environ.get(PINNED_STAGES)
  try:
    stages = pipeline_plan.parse_stages(pinned, call.op, call.world) if pinned else None
  except ValueError as e:
    raise ValueError(f"jax_overlap: {PINNED_STAGES}: {e}") from None
  return pipeline_plan.plan(call.op, call.world, figures, stages)


def _ensure_workspace(call: Call) -> None:
  """Sets the workspace up (collective) and checks that this process reaches its groups' devices."""
  runtime.initialize()
  if not runtime.is_active():
    raise Declined("no GPU workspace")
  ids = {i for g in call.local_groups for i in g}
  if not runtime.reachable(ids):
    raise Declined("the group spans devices this process cannot reach (another host)")


def _auto(call: Call) -> Choice:
  if call.world == 1:
    raise Declined("a group of one has no communication to overlap: XLA's dot")
  reasons, options = [], []
  for algorithm, planner in (("pipelined", _pipelined_plan), ("fused", lambda c: _fused_plan(c, "auto"))):
    try:
      plan = planner(call)
    except Declined as e:
      reasons.append(f"{algorithm}: {e}")
      continue
    est, est_xla = (plan.est_us, plan.est_xla_us) if algorithm == "pipelined" else (plan.est_fused_us, plan.est_xla_us)
    if pipeline_plan.faster(est, est_xla):
      options.append((est, Choice(algorithm, plan)))
    else:
      reasons.append(f"{algorithm}: the cost model predicts {est:.0f} us vs xla {est_xla:.0f} us")
  if not options:
    raise Declined("; ".join(reasons))
  algorithm = min(options, key=lambda o: o[0])[1].algorithm
  # Planned again once the workspace exists: with the measured link, and the
  # ranks sharing a GPU known (the fused kernels split its SMs between them).
  choice = _planned(call, algorithm, "auto")
  est, est_xla = ((choice.plan.est_us, choice.plan.est_xla_us) if algorithm == "pipelined" else
                  (choice.plan.est_fused_us, choice.plan.est_xla_us))
  if not pipeline_plan.faster(est, est_xla):
    raise Declined(f"{algorithm}: with the measured link the cost model predicts {est:.0f} us vs xla {est_xla:.0f} us")
  return choice


def _planned(call: Call, algorithm: str, mode: str) -> Choice:
  """`algorithm`'s plan for the call, made after setting up the workspace a group of two or more needs."""
  if algorithm == "pipelined":
    _pipelined_plan(call)  # eligibility, before any workspace is set up
  if call.world > 1:
    _ensure_workspace(call)
  return Choice(algorithm, _pipelined_plan(call) if algorithm == "pipelined" else _fused_plan(call, mode))


def choose(call: Call, algorithm: str) -> Choice:
  """The algorithm and plan that take `call`, or Declined saying why none does."""
  if algorithm == "auto":
    return _auto(call)
  return _planned(call, algorithm, algorithm)


# --- emitting the custom calls ---------------------------------------------------

def _bias_operand(x_aval, bias):
  return (bias[0] if bias else mlir.ir_constant(np.zeros((0,), x_aval.dtype)),
          jax.core.ShapedArray((0,), x_aval.dtype))


def _u8(nbytes: int):
  return jax.core.ShapedArray((int(nbytes),), np.uint8)


def _region(call: Call, algorithm: str, nbytes: int, shape_key: tuple) -> tuple[int, int]:
  """(offset, site) of the call's region; "auto" falls back when the workspace is full."""
  return runtime.region((f"{call.op}/{algorithm}", call.groups, shape_key), nbytes)


def _emit_fused(ctx, call: Call, plan, x, w, bias):
  x_aval, w_aval = ctx.avals_in[:2]
  bias_value, empty = _bias_operand(x_aval, bias)
  avals_in = [x_aval, w_aval, ctx.avals_in[2] if bias else empty]
  offset, site = (_region(call, "fused", plan.region_bytes,
                          (call.batch, call.m, call.k, call.n, plan.tile, plan.chunk_k)) if call.world > 1 else (0, 0))
  attrs = plan.attribute(w_kmajor=call.w_kmajor, region_offset=offset, site=site, generation=runtime.generation())
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


def _emit_pipelined(ctx, call: Call, plan, x, w, bias):
  nat = native.module()
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
  region_bytes = nat.pipelined_region_bytes(call.op, call.world, call.batch, call.m, call.k, call.n, 2)
  offset, site = _region(call, "pipelined", region_bytes, (call.batch, call.m, call.k, call.n))
  log.debug("jax_overlap.%s: pipelined (world %d, stages %s; model %.0f us vs xla %.0f us)", call.op, call.world,
            plan.stages, plan.est_us, plan.est_xla_us)
  sub_ctx = ctx.replace(avals_in=avals_in, avals_out=list(ctx.avals_out) + [scratch])
  config_attr = {"w_kmajor": np.int64(call.w_kmajor), "region_offset": np.int64(offset),
                 "region_bytes": np.int64(region_bytes), "site": np.int64(site),
                 "generation": np.int64(runtime.generation())}
  outs = jax.ffi.ffi_lowering(native.target(call.op + "_pipelined"))(
      sub_ctx, x, w, bias_value, config=config_attr,
      groups=np.array([i for g in call.groups for i in g], np.int64), world=np.int64(call.world),
      stages=np.array(plan.stages, np.int64))
  return outs[:-1]


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
    emit = _emit_pipelined if choice.algorithm == "pipelined" else _emit_fused
    return emit(ctx, call, choice.plan, x, w, bias)
  except (Declined, runtime.WorkspaceFullError) as e:
    if algorithm != "auto":
      raise ValueError(f"jax_overlap.{op}: algorithm={algorithm!r} cannot take this call: {e}") from e
    log.debug("jax_overlap.%s: XLA path (%s)", op, e)
    return lower_reference(ctx, x, w, *bias, op=op, **params)


def gather_gpu_rule(ctx, x, *, axis_name, axis_size, lower_default):
  """The runtime's all-gather on the symmetric workspace (tests); XLA's all_gather where it cannot run."""
  x_aval = ctx.avals_in[0]
  row_bytes = x_aval.shape[-1] * np.dtype(x_aval.dtype).itemsize
  try:
    _native_ready(ctx)
    if axis_size < 2 or row_bytes % 16:
      raise Declined("a group of one, or rows not 16-byte multiples")
    groups = group_ids(ctx, axis_name)
    call = Call("all_gather", np.dtype(x_aval.dtype).name, 1, 0, 0, 0, axis_size, groups, False)
    _ensure_workspace(call)
  except Declined as e:
    log.debug("jax_overlap.all_gather: XLA path (%s)", e)
    return lower_default(ctx, x, axis_name=axis_name, axis_size=axis_size)
  rows = math.prod(x_aval.shape[:-1])
  region_bytes = native.module().all_gather_region_bytes(axis_size, rows, row_bytes)
  offset, site = runtime.region(("all_gather", groups, tuple(x_aval.shape) + (np.dtype(x_aval.dtype).name,)),
                                region_bytes)
  ids = np.array([i for g in groups for i in g], np.int64)
  return jax.ffi.ffi_lowering(native.target("all_gather"))(
      ctx, x, config={"region_offset": np.int64(offset), "region_bytes": np.int64(region_bytes),
                      "site": np.int64(site), "generation": np.int64(runtime.generation())},
      groups=ids, world=np.int64(axis_size))
