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


def _native_ready(ctx) -> None:
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

def _bias_operand(x_aval, bias):
  return (bias[0] if bias else mlir.ir_constant(np.zeros((0,), x_aval.dtype)),
          jax.core.ShapedArray((0,), x_aval.dtype))


def _u8(nbytes: int):
  return jax.core.ShapedArray((int(nbytes),), np.uint8)


def _groups_attribute(problem: Problem):
  """Every group's global device ids, flattened: the custom calls' `groups` attribute."""
  return np.array([i for g in problem.groups for i in g], np.int64)


def _emit_fused(ctx, problem: Problem, op, choice: Choice, x, w, bias):
  machine, plan = backend.current(), choice.plan
  x_aval, w_aval = ctx.avals_in[:2]
  bias_value, empty = _bias_operand(x_aval, bias)
  avals_in = [x_aval, w_aval, ctx.avals_in[2] if bias else empty]
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


def _emit_pipelined(ctx, problem: Problem, op, choice: Choice, x, w, bias):
  machine, plan = backend.current(), choice.plan
  x_aval, w_aval = ctx.avals_in[:2]
  bias_value, empty = _bias_operand(x_aval, bias)
  avals_in = [x_aval, w_aval, ctx.avals_in[2] if bias else empty]
  scratch = _u8(machine.native.pipelined_scratch_bytes(op.NAME, problem.world, problem.batch, problem.m, problem.n,
                                                       dtypes.itemsize(problem.dtype_name)))
  if problem.world == 1:
    log.debug("jax_overlap.%s: pipelined, a group of one: the vendor GEMM", op.NAME)
    sub_ctx = ctx.replace(avals_in=avals_in, avals_out=[ctx.avals_out[0], scratch])
    # In XLA's command buffers only where the vendor GEMM passed its capture check (planning._vendor_blas).
    target = machine.target("vendor_gemm" if machine.native.vendor_gemm_graph_safe() else "vendor_gemm_no_graph")
    y = jax.ffi.ffi_lowering(target)(sub_ctx, x, w, bias_value, w_kmajor=np.int64(problem.w_kmajor))[0]
    return op.results_of_one(y, x)
  region_key, region_bytes = choice.region
  log.debug("jax_overlap.%s: pipelined (world %d, stages %s; model %.0f us vs xla %.0f us)", op.NAME, problem.world,
            plan.stages, plan.est_us, plan.est_xla_us)
  sub_ctx = ctx.replace(avals_in=avals_in, avals_out=list(ctx.avals_out) + [scratch])
  config_attr = {"w_kmajor": np.int64(problem.w_kmajor), "region_offset": np.int64(choice.offset),
                 "region_bytes": np.int64(region_bytes), "site": np.int64(_site(ctx, region_key)),
                 "generation": np.int64(runtime.generation())}
  outs = jax.ffi.ffi_lowering(machine.target(op.NAME + "_pipelined"))(
      sub_ctx, x, w, bias_value, config=config_attr, groups=_groups_attribute(problem), world=np.int64(problem.world),
      stages=np.array(plan.stages, np.int64))
  return outs[:-1]


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


def gpu_rule(ctx, x, w, *operands, op, axis_name, axis_size, algorithm, w_kmajor, has_bias, scaled, out_dtype):
  """The lowering of a GEMM op's primitive on a GPU platform (see the module docstring): its custom call's
  results, or None where the call takes the XLA path."""
  del out_dtype
  if algorithm == "xla" or disabled():
    if algorithm != "xla":
      log.debug("jax_overlap.%s: XLA path (%s is set)", op.NAME, KILL_SWITCH)
    return None
  bias = operands[:1] if has_bias else ()
  x_aval, w_aval = ctx.avals_in[:2]
  *lead, m, k = x_aval.shape
  try:
    if scaled:
      raise Declined("float8 operands: the custom calls take no scales in this build")
    _native_ready(ctx)
    groups = () if axis_name is None else group_ids(ctx, axis_name)
    problem = Problem(op.NAME, dtypes.name(x_aval.dtype), math.prod(lead), m, k, w_aval.shape[0 if w_kmajor else 1],
                      axis_size if axis_name is not None else 1, groups, bool(w_kmajor))
    choice = choose(problem, op, algorithm)
  except _DECLINED as e:
    _fallback(op.NAME, algorithm, e)
    return None
  return _EMITTERS[choice.algorithm](ctx, problem, op, choice, x, w, bias)


def gather_rule(ctx, x, *, axis_name, axis_size):
  """The runtime's all-gather on the symmetric workspace (tests): its custom call's result, or None where XLA's
  all_gather takes the call."""
  x_aval = ctx.avals_in[0]
  try:
    _native_ready(ctx)
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
