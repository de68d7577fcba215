"""The GPU lowering of the ops: agreement.choose's algorithm as its custom call, or the XLA reference where none
takes the call (an explicit algorithm then raises; "auto" says why at DEBUG)."""

from __future__ import annotations

import collections
import hashlib
import logging
import math
import re
import sys
import weakref

import jax
import numpy as np
from jax.interpreters import mlir

from jax_overlap import _compat
from jax_overlap.integration import operands
from jax_overlap.integration.results import Kind
from jax_overlap.planning import Choice, Declined, Problem
from jax_overlap.planning.agreement import DECLINED, choose
from jax_overlap.quantization import formats, scaling as scaling_modes
from jax_overlap.runtime import backend, settings, workspace
from jax_overlap.runtime.errors import WorkspaceFullError

log = logging.getLogger("jax_overlap")


def group_ids(ctx, axis_name) -> tuple:
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


def native_ready(ctx) -> None:
  """Declined unless the native module can serve this lowering; then registers its FFI targets."""
  machine = backend.current()
  if settings.disabled():
    raise Declined(f"{settings.DISABLE} is set")
  if machine.platform is None:
    raise Declined("the native extension is not built")
  if ctx.module_context.platforms != (machine.platform,):
    raise Declined(f"the extension is built for {machine.platform}")
  machine.register_targets()


# A site is named by its module, its program's digest and its place among the module's calls of the region, so the
# flags tell apart ranks that run their calls in different orders (docs/protocol.md).
_lowered_sites = weakref.WeakKeyDictionary()  # module -> (its program's digest, {region key: calls so far})
# A set of names prints in hash order, which differs between processes.
_NAME_SET = re.compile(r"\{('[^'{}]*'(?:, '[^'{}]*')+)\}")


def _program_digest() -> str:
  """A digest of the jaxpr lowered into the current module, the same in every process ("" if not found)."""
  frame = sys._getframe(1)
  while frame is not None and frame.f_code.co_name != "lower_jaxpr_to_module":
    frame = frame.f_back
  jaxpr = None if frame is None else frame.f_locals.get("jaxpr")
  if jaxpr is None:
    return ""
  text = re.sub(r" at 0x[0-9a-f]+", "", str(jaxpr))
  text = _NAME_SET.sub(lambda m: "{" + ", ".join(sorted(m.group(1).split(", "))) + "}", text)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def _site(ctx, region_key: tuple) -> int:
  module = ctx.module_context.module
  if module not in _lowered_sites:
    _lowered_sites[module] = (_program_digest(), collections.Counter())
  digest, seen = _lowered_sites[module]
  seen[region_key] += 1
  attributes = module.operation.attributes
  module_name = mlir.ir.StringAttr(attributes["sym_name"]).value if "sym_name" in attributes else ""
  return workspace.site(region_key, (module_name, digest, seen[region_key]))


def _u8(nbytes: int):
  return jax.core.ShapedArray((int(nbytes),), np.uint8)


def _groups_attribute(problem: Problem):
  return np.array([i for g in problem.groups for i in g], np.int64)


def _emit_fused(ctx, problem: Problem, op, choice: Choice, call: operands.GemmCall):
  machine, plan = backend.current(), choice.plan
  args, avals_in = operands.fused_operands(call)
  site = _site(ctx, choice.region[0]) if problem.world > 1 else 0
  attrs = plan.attribute(w_kmajor=problem.w_kmajor, region_offset=choice.offset, site=site,
                         generation=workspace.generation())
  log.debug("jax_overlap.%s: fused (world %d, tile %d, comm workgroups %d, chunk_k %d; model %.0f us vs xla %.0f us)",
            op.name, problem.world, plan.tile, plan.comm_workgroups, plan.chunk_k, plan.est_us, plan.est_xla_us)
  if problem.world == 1:
    # No protocol, but device state shutdown() frees: a target run outside command buffers checks the generation.
    # The second result is the stream-K tail's scratch.
    sub_ctx = ctx.replace(avals_in=avals_in, avals_out=[ctx.avals_out[0], _u8(plan.tail_scratch_bytes)])
    y = jax.ffi.ffi_lowering(machine.target(op.name + "_local"))(sub_ctx, *args, config=attrs)[0]
    return op.results.of_one(y, call.values.x, None, scaled=False)  # the fused kernels are 16-bit only
  sub_ctx = ctx.replace(avals_in=avals_in, avals_out=list(ctx.avals_out))
  return jax.ffi.ffi_lowering(machine.target(op.name))(
      sub_ctx, *args, config=attrs, groups=_groups_attribute(problem), world=np.int64(problem.world))


def _emit_pipelined(ctx, problem: Problem, op, choice: Choice, call: operands.GemmCall):
  machine, plan = backend.current(), choice.plan
  bias_after = operands.bias_by_xla(call, op.planning.reduces and problem.world > 1)
  x_groups = 1 if problem.world == 1 else problem.m // op.planning.chunk_rows(problem.m, problem.world)
  args, avals_in = operands.gemm_operands(ctx, call, bias_after, x_groups)
  y_aval = ctx.avals_out[0].update(dtype=np.dtype(np.float32) if bias_after else call.out_dtype)
  scratch = _u8(machine.native.pipelined_scratch_bytes(op.name, problem.world, problem.batch, problem.m, problem.n,
                                                       formats.partial(problem.out_dtype).itemsize))
  if problem.world == 1:
    log.debug("jax_overlap.%s: pipelined, a group of one: the vendor GEMM", op.name)
    sub_ctx = ctx.replace(avals_in=avals_in, avals_out=[y_aval, scratch])
    # In command buffers only where the vendor GEMM passed its capture check (planning/decision.py _vendor_blas).
    target = machine.target("vendor_gemm" if machine.native.vendor_gemm_graph_safe() else "vendor_gemm_no_graph")
    y = jax.ffi.ffi_lowering(target)(sub_ctx, *args, w_kmajor=np.int64(problem.w_kmajor),
                                     scaling=np.int64(scaling_modes.code(problem.scaling)),
                                     fast_accumulation=np.int64(problem.fast_accumulation))[0]
    return op.results.of_one(operands.finished(ctx, call, y, y_aval, bias_after), call.values.x,
                             lambda i: operands.own_gathered_scales(ctx, call, ctx.avals_out[i]), call.scaled)
  region_key, region_bytes = choice.region
  log.debug("jax_overlap.%s: pipelined (world %d, stages %s; model %.0f us vs xla %.0f us)", op.name, problem.world,
            plan.stages, plan.est_us, plan.est_xla_us)
  # Between y and its scratch: the gathered x and the flat gathered scales (f32[0] when unscaled).
  kinds = op.results.of_call(call.scaled)
  between = []
  if op.results.gathers:
    between = [ctx.avals_out[kinds.index(Kind.GATHERED)], jax.core.ShapedArray((0,), np.float32)]
    if call.scaled:
      between[1] = operands.flat_scales_aval(ctx.avals_out[kinds.index(Kind.GATHERED_SCALES)])
  sub_ctx = ctx.replace(avals_in=avals_in, avals_out=[y_aval, *between, scratch])
  config_attr = {"w_kmajor": np.int64(problem.w_kmajor), "scaling": np.int64(scaling_modes.code(problem.scaling)),
                 "fast_accumulation": np.int64(problem.fast_accumulation),
                 "x_scale_shared": np.int64(problem.x_scale_shared), "region_offset": np.int64(choice.offset),
                 "region_bytes": np.int64(region_bytes), "site": np.int64(_site(ctx, region_key)),
                 "generation": np.int64(workspace.generation())}
  y, *rest = jax.ffi.ffi_lowering(machine.target(op.name + "_pipelined"))(
      sub_ctx, *args, config=config_attr, groups=_groups_attribute(problem), world=np.int64(problem.world),
      stages=np.array(plan.stages, np.int64))
  by_kind = {Kind.PRODUCT: operands.finished(ctx, call, y, y_aval, bias_after)}
  if op.results.gathers:
    by_kind[Kind.GATHERED] = rest[0]
    if call.scaled:
      by_kind[Kind.GATHERED_SCALES] = operands.gathered_scales(
          ctx, call, rest[1], problem.world, ctx.avals_out[kinds.index(Kind.GATHERED_SCALES)])
  return [by_kind[k] for k in kinds]


_EMITTERS = {"pipelined": _emit_pipelined, "fused": _emit_fused}


def _fallback(op_name: str, algorithm: str, error: Exception) -> None:
  if algorithm != "auto":
    raise ValueError(f"jax_overlap.{op_name}: algorithm={algorithm!r} cannot take this call: {error}") from error
  if isinstance(error, WorkspaceFullError):
    workspace.note_workspace_full(error)
  log.debug("jax_overlap.%s: XLA path (%s)", op_name, error)


def gpu_rule(ctx, *args, op, axis_name, axis_size, algorithm, w_kmajor, has_bias: bool, scaling, out_dtype: str):
  if algorithm == "xla" or settings.disabled():
    if algorithm != "xla":
      log.debug("jax_overlap.%s: XLA path (%s is set)", op.name, settings.DISABLE)
    return None
  call = operands.gemm_call(ctx, args, has_bias=has_bias, scaling=scaling, out_dtype=out_dtype, w_kmajor=w_kmajor)
  x_aval, w_aval = call.avals.x, call.avals.w
  *lead, m, k = x_aval.shape
  try:
    native_ready(ctx)
    groups = () if axis_name is None else group_ids(ctx, axis_name)
    world = axis_size if axis_name is not None else 1
    problem = Problem(op.name, formats.name(x_aval.dtype), math.prod(lead), m, k,
                      w_aval.shape[0 if w_kmajor else 1], world, groups,
                      bool(w_kmajor) or call.scaled, out_dtype_name=call.out_dtype.name,
                      w_dtype_name=formats.name(w_aval.dtype), scaling=scaling,
                      gemm_bias=has_bias and not operands.bias_by_xla(call, op.planning.reduces and world > 1))
    choice = choose(problem, op, algorithm)
  except DECLINED as e:
    _fallback(op.name, algorithm, e)
    return None
  return _EMITTERS[choice.algorithm](ctx, problem, op, choice, call)


def gather_rule(ctx, x, *, axis_name, axis_size):
  x_aval = ctx.avals_in[0]
  try:
    native_ready(ctx)
    groups = group_ids(ctx, axis_name)
    problem = Problem("all_gather", formats.name(x_aval.dtype), 1, math.prod(x_aval.shape[:-1]), x_aval.shape[-1],
                      0, axis_size, groups, False)
    choice = choose(problem, None, "all_gather")
  except DECLINED as e:
    log.debug("jax_overlap.all_gather: XLA path (%s)", e)
    return None
  region_key, region_bytes = choice.region
  return jax.ffi.ffi_lowering(backend.current().target("all_gather"))(
      ctx, x, config={"region_offset": np.int64(choice.offset), "region_bytes": np.int64(region_bytes),
                      "site": np.int64(_site(ctx, region_key)), "generation": np.int64(workspace.generation())},
      groups=_groups_attribute(problem), world=np.int64(axis_size))
