"""The GPU lowering of the ops: the decision a call takes (planning/), its set-up, and the custom call it lowers to.

For each call on "cuda"/"rocm" (primitives.py and ops/all_gather.py register these rules):
  1. The XLA reference decomposition when the user asked for it, when
     JAX_OVERLAP_DISABLE is set, when the native module is not built for this
     platform, or when no algorithm can take the call (an explicit "fused" or
     "pipelined" request then raises, saying why; "auto" falls back, and says
     why at DEBUG level).
  2. planning.decide: "pipelined" (csrc/pipelined/: the vendor GEMM per stage
     of chunks with copy-engine transfers; a group of one is the vendor GEMM
     alone), "fused" (csrc/kernels/: one persistent kernel of movers and GEMM
     tiles), or for "auto" the XLA path for a group of one (nothing to
     overlap), otherwise whichever the cost models predict fastest, taken only
     when it beats the XLA path by their margin.
  3. A group of two or more that takes the fused or pipelined path sets up the
     symmetric workspace (runtime.initialize) and a region of it; "auto"
     falls back to XLA on any shortfall (workspace full, peers not reachable,
     vendor BLAS missing, out of memory in the set-up or a measurement, no
     answer from another process in time; SetupError). A choice made before the
     workspace existed (on a guessed link) is judged again once it does.

With several processes, a call of a group of two or more leads to collective
steps (the workspace's set-up, its region), so every process decides alike: the
cost models run on process 0's figures (planning/figures.py), groups that span
hosts are found from one host map, and each process's proposal (the algorithm,
its plan and region, or why it cannot) is gathered from all: the call takes a
path only when every process proposes the same one, the XLA path otherwise, on
every process (an explicit algorithm then raises everywhere, naming the process
and its reason). Before the workspace exists a first round agrees on setting it
up. Each (call, algorithm, settings) is decided once per process and runtime
generation: lowering it again, on any process, asks nobody.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from jax_overlap import _compat, backend, dtypes, planning, processes, runtime
from jax_overlap.errors import SetupError, WorkspaceFullError
from jax_overlap.planning import Choice, Declined, Problem

log = logging.getLogger("jax_overlap")

KILL_SWITCH = "JAX_OVERLAP_DISABLE"
# Settings that change a call's plan, and so take part in naming its decision.
_PLAN_SETTINGS = (planning.PINNED_STAGES, backend.ARCH_TRAITS)


def disabled() -> bool:
  return runtime.env_flag(KILL_SWITCH)


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


def native_ready(ctx) -> None:
  machine = backend.current()
  if disabled():
    raise Declined(f"{KILL_SWITCH} is set")
  if machine.platform is None:
    raise Declined("the native extension is not built")
  if ctx.module_context.platforms != (machine.platform,):
    raise Declined(f"the extension is built for {machine.platform}")
  machine.register_targets()


# --- one process -------------------------------------------------------------------

def _set_up() -> None:
  """Sets the workspace up (collective; a failure is every process's)."""
  try:
    runtime.initialize()
  except SetupError as e:
    raise Declined(str(e)) from e
  if not runtime.is_active():
    raise Declined("no GPU workspace")


def _reachable(problem: Problem) -> None:
  """Only the groups this process's devices are in must be reachable (others may be on other hosts)."""
  local = runtime.local_device_ids()
  ids = {i for g in problem.groups if local & set(g) for i in g}
  if not runtime.reachable(ids):
    raise Declined("the group spans devices this process cannot reach (another host)")


def _placed(choice: Choice) -> Choice:
  """The choice with its region's offset (the region is not recorded yet)."""
  return choice if choice.region is None else dataclasses.replace(choice, offset=runtime.placement(*choice.region))


def choose(problem: Problem, op, algorithm: str) -> Choice:
  """The algorithm, plan and placed region that take the call, or Declined saying why none does."""
  if problem.world > 1 and jax.process_count() > 1:
    return _agreed_choice(problem, op, algorithm)
  measured = runtime.is_active()  # the figures at hand: the link measured, or guessed before any set-up
  choice = planning.decide(problem, op, algorithm)
  if problem.world > 1:
    _set_up()
    _reachable(problem)
    if not measured:
      choice = planning.decide(problem, op, algorithm, again=choice.algorithm if algorithm == "auto" else None)
  choice = _placed(choice)
  if choice.region is not None:
    runtime.place(*choice.region, choice.offset)
  return choice


# --- one decision for every process ------------------------------------------------
# (call, algorithm, plan settings, runtime generation) -> (Choice, None) or (None, why not), decided with every
# process once; a later lowering of the same call, by any process, reuses it.
_decisions: dict = {}
# One decision at a time in a process: each is a collective step, which one process must not enter twice.
_deciding = threading.Lock()


def _agreed_choice(problem: Problem, op, algorithm: str) -> Choice:
  key = (problem, algorithm, tuple(os.environ.get(name, "") for name in _PLAN_SETTINGS), runtime.generation())
  with _deciding:
    if key not in _decisions:
      _decisions[key] = _agree(problem, op, algorithm, f"decide/{processes.digest(key)}")
  choice, why = _decisions[key]
  if choice is None:
    raise Declined(why)
  return choice


def _agree(problem: Problem, op, algorithm: str, name: str) -> tuple:
  """The choice every process proposes for the call, or why there is none (the same on every process)."""
  if not runtime.is_active() and runtime.setup_failed() is None:
    # The set-up is collective: first agree that every process wants it for this call.
    wanted, why = _decided(f"{name}/setup", _proposal(algorithm, lambda: _setup_proposal(problem, op, algorithm)))
    if wanted is None:
      return None, why
  choice = None

  def final():
    nonlocal choice
    choice = _final_choice(problem, op, algorithm)
    return choice.fingerprint()

  agreed, why = _decided(f"{name}/final", _proposal(algorithm, final))
  if agreed is None:
    return None, why
  runtime.place(*choice.region, choice.offset)
  return choice, None


def _within_hosts(problem: Problem) -> None:
  hosts = processes.hosts()
  for group in problem.groups:
    names = sorted({hosts.get(i, "a process without GPUs") for i in group})
    if len(names) > 1:
      raise Declined(f"the group {group} spans hosts {names}")


def _setup_proposal(problem: Problem, op, algorithm: str) -> str:
  _within_hosts(problem)
  return planning.decide(problem, op, algorithm).algorithm


def _final_choice(problem: Problem, op, algorithm: str) -> Choice:
  # The collective steps (host map, set-up, figures) first, then what this process alone can refuse.
  _within_hosts(problem)
  _set_up()
  choice = planning.decide(problem, op, algorithm)
  _reachable(problem)
  return _placed(choice)


def _proposal(algorithm: str, propose) -> dict:
  """This process's proposal (JSON): what propose() returns, or why it cannot take the call."""
  try:
    return {"choice": propose(), "why": None}
  except WorkspaceFullError as e:
    if algorithm == "auto":
      runtime.note_workspace_full(e)
    return {"choice": None, "why": str(e)}
  except (Declined, SetupError) as e:
    return {"choice": None, "why": str(e)}


def _decided(name: str, proposal: dict) -> tuple:
  """(the choice every process proposed, None), or (None, why not): the same on every process."""
  try:
    proposals = processes.gather(name, proposal)
  except SetupError as e:
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
# A call's operands as the primitive gives them (ops/<op>.bind): x, w, [bias], [x_scale, w_scale]. Float8 calls
# (scaled) carry float32 scalar scales and an out_dtype; the pipelined targets take (x, w, bias, x_scale, w_scale)
# with the scales as f32[1] (f32[0] for a 16-bit call) and an empty bias [0] for none (csrc/ffi/pipelined.cc).
# Block scales go flat, in the layouts cuBLASLt reads (csrc/core/block_scales.h): x's [k/128][rows] for the rows
# of each GEMM (matmul_rs with peers: per row block, [world][k/128][m/world]), w's [n/128][k/128 padded to a
# multiple of _W_SCALE_ROW_ALIGN] of its K-major form.
_W_SCALE_ROW_ALIGN = 4

@dataclasses.dataclass(frozen=True)
class _Call:
  """One call's operands (IR values) and types at lowering."""

  x: object
  w: object
  bias: object | None
  scales: tuple  # (x_scale, w_scale) of a float8 call, else ()
  x_aval: object
  w_aval: object
  bias_aval: object | None
  scale_avals: tuple
  out_dtype: np.dtype
  w_kmajor: bool  # as given: a float8 w given [k, n] is transposed for the vendor GEMM (Hopper takes K-major only)

  @property
  def scaled(self) -> bool:
    return bool(self.scales)

  @property
  def blocks(self) -> bool:
    """Block scales (numerics.blocks)."""
    return self.scaled and self.scale_avals[1].ndim > 0


def _call_of(ctx, operands, scaled: bool, out_dtype, w_kmajor: bool) -> _Call:
  x, w, *rest = operands
  x_aval, w_aval, *rest_avals = ctx.avals_in
  count = 2 if scaled else 0
  scales, scale_avals = tuple(rest[len(rest) - count:]), tuple(rest_avals[len(rest) - count:])
  bias = rest[0] if len(rest) > count else None
  return _Call(x, w, bias, scales, x_aval, w_aval, rest_avals[0] if bias is not None else None, scale_avals,
               np.dtype(out_dtype or x_aval.dtype), bool(w_kmajor))


def _lowered(ctx, fn, args, avals_in, aval_out):
  """fn(*args) lowered in place: one value of aval_out."""
  return mlir.lower_fun(fn, multiple_results=False)(ctx.replace(avals_in=avals_in, avals_out=[aval_out]), *args)[0]


def _k_major_w(ctx, call: _Call):
  """(w, its aval) as the call passes it: a float8 w given [k, n] transposed to [n, k] (one pass over w: the
  vendor's float8 GEMM on Hopper takes K-major operands only), else as given."""
  if not call.scaled or call.w_kmajor:
    return call.w, call.w_aval
  transposed = call.w_aval.update(shape=call.w_aval.shape[::-1])
  return _lowered(ctx, lambda w: w.T, [call.w], [call.w_aval], transposed), transposed


def _x_block_scales(x_scale, groups: int):
  """x's block scales [..., rows, k/128] as the GEMMs read them: [groups][k/128][rows / groups], flat."""
  kb = x_scale.shape[-1]
  return x_scale.reshape(groups, -1, kb).transpose(0, 2, 1).reshape(-1)


def _w_block_scales(w_scale, w_kmajor: bool):
  """w's block scales as the GEMMs read them: [n/128][k/128 padded], flat (w_scale mirrors w's layout)."""
  s = w_scale if w_kmajor else w_scale.T
  return jnp.pad(s, ((0, 0), (0, -s.shape[1] % _W_SCALE_ROW_ALIGN))).reshape(-1)


def _scale_operands(ctx, call: _Call, x_groups: int) -> tuple:
  """(values, avals) of x_scale and w_scale: f32[1] each for a float8 call, f32[0] for a 16-bit one; block
  scales flat in the GEMMs' layouts, x's rows in `x_groups` groups (a GEMM's rows each)."""
  if not call.scaled:
    empty = np.zeros((0,), np.float32)
    return [mlir.ir_constant(empty)] * 2, [jax.core.ShapedArray((0,), np.float32)] * 2
  if call.blocks:
    forms = (lambda s: _x_block_scales(s, x_groups), lambda s: _w_block_scales(s, call.w_kmajor))
  else:
    forms = (lambda s: s.reshape(1),) * 2
  flat = [jax.eval_shape(f, aval) for f, aval in zip(forms, call.scale_avals)]
  avals = [aval.update(shape=f.shape) for aval, f in zip(call.scale_avals, flat)]
  return [_lowered(ctx, f, [s], [aval], out)
          for f, s, aval, out in zip(forms, call.scales, call.scale_avals, avals)], avals


def _bias_by_xla(problem: Problem, op, call: _Call) -> bool:
  """Whether the bias of a float8 call is added by XLA after the custom call rather than by it: the vendor's
  float8 GEMM epilogue takes a bias in a 16-bit output's dtype only (csrc/blas/cublaslt_api.h), so a float32
  bias (or a float32 output) goes that way when a GEMM adds it: then the custom call writes y in float32
  without it, and XLA adds the bias in float32 and rounds once, as the epilogue would (one more pass over y).
  matmul_rs with peers adds its bias in its reduction, in float32 from either dtype. cuBLASLt's block-scaled
  GEMM has no bias epilogue at all."""
  if not call.scaled or call.bias is None or (op.REDUCES and problem.world > 1):
    return False
  return call.blocks or call.bias_aval.dtype != call.out_dtype or call.out_dtype == np.float32


def _gemm_operands(ctx, call: _Call, bias_after: bool, x_groups: int) -> tuple:
  """(values, avals) of (x, w, bias, x_scale, w_scale) for a pipelined target; the bias empty where XLA adds it
  after the call (bias_after); x_groups: _scale_operands'."""
  w, w_aval = _k_major_w(ctx, call)
  if call.bias is None or bias_after:
    empty = np.zeros((0,), call.out_dtype if call.scaled else call.x_aval.dtype)
    bias, bias_aval = mlir.ir_constant(empty), jax.core.ShapedArray(empty.shape, empty.dtype)
  else:
    bias, bias_aval = call.bias, call.bias_aval
  scales, scale_avals = _scale_operands(ctx, call, x_groups)
  return [call.x, w, bias, *scales], [call.x_aval, w_aval, bias_aval, *scale_avals]


def _finished(ctx, call: _Call, y, y_aval, bias_after: bool):
  """y of the custom call as the op returns it: with bias_after (_bias_by_xla), the call's float32 y + the bias
  in float32, rounded once to the output dtype."""
  if not bias_after:
    return y
  return _lowered(ctx, lambda y, b: (y + b.astype(np.float32)).astype(call.out_dtype), [y, call.bias],
                  [y_aval, call.bias_aval], y_aval.update(dtype=call.out_dtype))


def _bias_operand(x_aval, bias):
  return (bias if bias is not None else mlir.ir_constant(np.zeros((0,), x_aval.dtype)),
          jax.core.ShapedArray((0,), x_aval.dtype))


def _u8(nbytes: int):
  return jax.core.ShapedArray((int(nbytes),), np.uint8)


def _groups_attribute(problem: Problem):
  """Every group's global device ids, flattened: the custom calls' `groups` attribute."""
  return np.array([i for g in problem.groups for i in g], np.int64)


def _emit_fused(ctx, problem: Problem, op, choice: Choice, call: _Call):
  machine, plan = backend.current(), choice.plan
  x, w, bias = call.x, call.w, call.bias
  bias_value, empty = _bias_operand(call.x_aval, bias)
  avals_in = [call.x_aval, call.w_aval, call.bias_aval if bias is not None else empty]
  site = _site(ctx, choice.region[0]) if problem.world > 1 else 0
  attrs = plan.attribute(w_kmajor=problem.w_kmajor, region_offset=choice.offset, site=site,
                         generation=runtime.generation())
  log.debug("jax_overlap.%s: fused (world %d, tile %d, comm workgroups %d, chunk_k %d; model %.0f us vs xla %.0f us)",
            op.NAME, problem.world, plan.tile, plan.comm_workgroups, plan.chunk_k, plan.est_us, plan.est_xla_us)
  if problem.world == 1:
    # No protocol, but the GPU's device state, which shutdown() frees: a target XLA dispatches each run (no
    # command buffer), whose handler checks the generation. The second result is the stream-K tail's scratch
    # (FusedPlan.tail_slots).
    sub_ctx = ctx.replace(avals_in=avals_in, avals_out=[ctx.avals_out[0], _u8(plan.tail_scratch_bytes)])
    y = jax.ffi.ffi_lowering(machine.target(op.NAME + "_local"))(sub_ctx, x, w, bias_value, config=attrs)[0]
    return op.results_of_one(y, x)
  sub_ctx = ctx.replace(avals_in=avals_in, avals_out=list(ctx.avals_out))
  return jax.ffi.ffi_lowering(machine.target(op.NAME))(
      sub_ctx, x, w, bias_value, config=attrs, groups=_groups_attribute(problem), world=np.int64(problem.world))


def _results_of_one(ctx, op, call: _Call, y) -> list:
  """The op's results of a group of one from its y (op.results_of_one), and for a float8 call of an op that
  returns gathered scales too (one result more), x's own scale as them, f32[1] (block scales: x_scale)."""
  results = list(op.results_of_one(y, call.x))
  if len(results) < len(ctx.avals_out):
    results.append(call.scales[0] if call.blocks else
                   _lowered(ctx, lambda s: s.reshape(1), [call.scales[0]], [call.scale_avals[0]],
                            ctx.avals_out[len(results)]))
  return results


def _gathered_block_scales(ctx, flat, world: int):
  """ag_matmul's gathered block scales as the op returns them, [..., world * m, k/128], from the custom call's
  [world][k/128][m] (each shard's as its GEMM read it)."""
  out = ctx.avals_out[2]
  kb = out.shape[-1]
  return _lowered(ctx, lambda s: s.reshape(world, kb, -1).transpose(0, 2, 1).reshape(out.shape), [flat],
                  [jax.core.ShapedArray((math.prod(out.shape),), np.float32)], out)


def _emit_pipelined(ctx, problem: Problem, op, choice: Choice, call: _Call):
  machine, plan = backend.current(), choice.plan
  bias_after = _bias_by_xla(problem, op, call)
  x_groups = 1 if problem.world == 1 else problem.m // op.chunk_rows(problem.m, problem.world)
  operands, avals_in = _gemm_operands(ctx, call, bias_after, x_groups)
  y_aval = ctx.avals_out[0].update(dtype=np.dtype(np.float32) if bias_after else call.out_dtype)
  scratch = _u8(machine.native.pipelined_scratch_bytes(op.NAME, problem.world, problem.batch, problem.m, problem.n,
                                                       dtypes.itemsize(problem.out_dtype)))
  if problem.world == 1:
    log.debug("jax_overlap.%s: pipelined, a group of one: the vendor GEMM", op.NAME)
    sub_ctx = ctx.replace(avals_in=avals_in, avals_out=[y_aval, scratch])
    # In XLA's command buffers only where the vendor GEMM passed its capture check (planning._vendor_blas).
    target = machine.target("vendor_gemm" if machine.native.vendor_gemm_graph_safe() else "vendor_gemm_no_graph")
    y = jax.ffi.ffi_lowering(target)(sub_ctx, *operands, w_kmajor=np.int64(problem.w_kmajor))[0]
    return _results_of_one(ctx, op, call, _finished(ctx, call, y, y_aval, bias_after))
  region_key, region_bytes = choice.region
  log.debug("jax_overlap.%s: pipelined (world %d, stages %s; model %.0f us vs xla %.0f us)", op.NAME, problem.world,
            plan.stages, plan.est_us, plan.est_xla_us)
  # A call that gathers x (results y and the gathered x) also returns the gathered scales: f32[0] when unscaled.
  gathers = len(ctx.avals_out) > 1
  scales_out = [jax.core.ShapedArray((0,), np.float32)] if gathers and not call.scaled else []
  results_out = list(ctx.avals_out[1:])
  if gathers and call.blocks:  # flat, as the GEMMs read them (_gathered_block_scales)
    results_out[1] = jax.core.ShapedArray((math.prod(results_out[1].shape),), np.float32)
  sub_ctx = ctx.replace(avals_in=avals_in, avals_out=[y_aval, *results_out, *scales_out, scratch])
  config_attr = {"w_kmajor": np.int64(problem.w_kmajor), "region_offset": np.int64(choice.offset),
                 "region_bytes": np.int64(region_bytes), "site": np.int64(_site(ctx, region_key)),
                 "generation": np.int64(runtime.generation())}
  y, *rest = jax.ffi.ffi_lowering(machine.target(op.NAME + "_pipelined"))(
      sub_ctx, *operands, config=config_attr, groups=_groups_attribute(problem), world=np.int64(problem.world),
      stages=np.array(plan.stages, np.int64))
  rest = rest[:len(ctx.avals_out) - 1]
  if gathers and call.blocks:
    rest[1] = _gathered_block_scales(ctx, rest[1], problem.world)
  return [_finished(ctx, call, y, y_aval, bias_after), *rest]


_EMITTERS = {"pipelined": _emit_pipelined, "fused": _emit_fused}


def _fallback(op_name: str, algorithm: str, error: Exception) -> None:
  """Raises for an explicit algorithm; for "auto", says why the call takes the XLA path (DEBUG)."""
  if algorithm != "auto":
    raise ValueError(f"jax_overlap.{op_name}: algorithm={algorithm!r} cannot take this call: {error}") from error
  if isinstance(error, WorkspaceFullError):
    runtime.note_workspace_full(error)
  log.debug("jax_overlap.%s: XLA path (%s)", op_name, error)


# What a call that cannot take a GPU path raises: Declined, a full workspace, or a set-up that failed (out of
# memory, no answer from another process in time). Once a choice is made (and agreed), emitting it never falls back.
_DECLINED = (Declined, WorkspaceFullError, SetupError)


def gpu_rule(ctx, *operands, op, axis_name, axis_size, algorithm, w_kmajor, scaled: bool = False,
             out_dtype: str | None = None, has_bias: bool | None = None):
  """The lowering of a GEMM op's primitive on a GPU platform (see the module docstring): its custom call's
  results, or None where the call takes the XLA path. operands: x, w, [bias], [x_scale, w_scale] (scaled: float8
  x and w, their y of out_dtype); a 16-bit call's params may leave out scaled, out_dtype (x's dtype) and
  has_bias, which its operands say."""
  del has_bias
  if algorithm == "xla" or disabled():
    if algorithm != "xla":
      log.debug("jax_overlap.%s: XLA path (%s is set)", op.NAME, KILL_SWITCH)
    return None
  call = _call_of(ctx, operands, scaled, out_dtype, w_kmajor)
  *lead, m, k = call.x_aval.shape
  try:
    native_ready(ctx)
    groups = () if axis_name is None else group_ids(ctx, axis_name)
    # A float8 w reaches the GPU K-major whatever its layout here (_k_major_w).
    problem = Problem(op.NAME, dtypes.name(call.x_aval.dtype), math.prod(lead), m, k,
                      call.w_aval.shape[0 if w_kmajor else 1], axis_size if axis_name is not None else 1, groups,
                      bool(w_kmajor) or call.scaled, out_dtype_name=call.out_dtype.name,
                      w_dtype_name=dtypes.name(call.w_aval.dtype), scaled=call.scaled, blocks=call.blocks)
    choice = choose(problem, op, algorithm)
  except _DECLINED as e:
    _fallback(op.NAME, algorithm, e)
    return None
  return _EMITTERS[choice.algorithm](ctx, problem, op, choice, call)


def gather_rule(ctx, x, *, axis_name, axis_size):
  """The runtime's all-gather on the symmetric workspace (tests): its custom call's result, or None where XLA's
  all_gather takes the call."""
  x_aval = ctx.avals_in[0]
  try:
    native_ready(ctx)
    groups = group_ids(ctx, axis_name)
    problem = Problem("all_gather", dtypes.name(x_aval.dtype), 1, math.prod(x_aval.shape[:-1]), x_aval.shape[-1],
                      0, axis_size, groups, False)
    choice = choose(problem, None, "all_gather")
  except _DECLINED as e:
    log.debug("jax_overlap.all_gather: XLA path (%s)", e)
    return None
  region_key, region_bytes = choice.region
  return jax.ffi.ffi_lowering(backend.current().target("all_gather"))(
      ctx, x, config={"region_offset": np.int64(choice.offset), "region_bytes": np.int64(region_bytes),
                      "site": np.int64(_site(ctx, region_key)), "generation": np.int64(runtime.generation())},
      groups=_groups_attribute(problem), world=np.int64(axis_size))
