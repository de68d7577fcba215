"""JAX primitives of the fused ops: abstract eval, batching and lowering per platform.

  ag_matmul_p(x, w[, bias]) -> (y, gathered)   y = all_gather(x, -2) @ w + bias
  matmul_rs_p(x, w[, bias]) -> z               z = psum_scatter(x @ w, -2) + bias
  all_gather_p(x) -> gathered                  the runtime's all-gather (tests)

Shapes: ag_matmul x [..., m, K], w [K, *n], bias [*n]; matmul_rs x [..., M, *k],
w [*k, N], bias [N] (see reference.py). Params: axis_name (tuple of mesh axes,
or None for the local product), axis_size (the group size), algorithm,
w_kmajor (w stored with the contraction last: [*n, K], [N, *k]) and out_specs
(the Explicit-mesh output types of a global-array call, else None).
Lowering: on "cuda"/"rocm" the FFI custom call when the native module is built
for that platform and config.py finds the call eligible (weights of other ranks
than 2 are reshaped to a matrix first); otherwise, and on every other platform,
the XLA reference decomposition (reference.py). Autodiff lives in api.py
(custom VJPs built from these primitives).
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import batching, mlir

from jax.sharding import AxisType, PartitionSpec as P

from jax_overlap import config, native, reference, runtime

log = logging.getLogger("jax_overlap")

ag_matmul_p = jex_core.Primitive("jax_overlap_ag_matmul")
ag_matmul_p.multiple_results = True
matmul_rs_p = jex_core.Primitive("jax_overlap_matmul_rs")
all_gather_p = jex_core.Primitive("jax_overlap_all_gather")


def _bias_args(bias):
  return () if bias is None else (bias,)


def ag_matmul(x, w, bias, *, axis_name, axis_size, algorithm, w_kmajor=False, out_specs=None):
  y, gathered = ag_matmul_p.bind(x, w, *_bias_args(bias), axis_name=axis_name, axis_size=axis_size,
                                 algorithm=algorithm, w_kmajor=w_kmajor, out_specs=out_specs)
  return y, gathered


def matmul_rs(x, w, bias, *, axis_name, axis_size, algorithm, w_kmajor=False, out_specs=None):
  return matmul_rs_p.bind(x, w, *_bias_args(bias), axis_name=axis_name, axis_size=axis_size,
                          algorithm=algorithm, w_kmajor=w_kmajor, out_specs=out_specs)


def all_gather(x, *, axis_name, axis_size):
  return all_gather_p.bind(x, axis_name=axis_name, axis_size=axis_size)


# --- abstract evaluation ----------------------------------------------------
# Outputs take x's type (and with it the manual-axis varying set) with a new
# shape. Global arrays on a mesh with Explicit axes carry their sharding in the
# type: `out_specs` (one PartitionSpec per result, from sharding_plan.py via
# partitioning.py) types the outputs the way the custom partitioning lays them
# out, so XLA adds no reshard after it. Elsewhere every output dim is unsharded.

def _n_of(w, w_kmajor):
  """Output columns of a canonical (2-D) w."""
  return w.shape[0] if w_kmajor else w.shape[1]


def _explicit_mesh(x):
  mesh = getattr(getattr(x, "sharding", None), "mesh", None)
  types = getattr(mesh, "axis_types", ())
  return mesh if any(t == AxisType.Explicit for t in types) else None


def _result(x, shape, spec):
  """An aval of x's type with `shape`, sharded by `spec` on an Explicit mesh, else unsharded."""
  sharding = getattr(x, "sharding", None)
  if sharding is None:
    return x.update(shape=shape)
  if spec is None or _explicit_mesh(x) is None:
    spec = P(*([None] * len(shape)))
  return x.update(shape=shape, sharding=sharding.update(spec=spec))


def _specs(out_specs, count):
  return tuple(out_specs) if out_specs is not None else (None,) * count


def _ag_abstract_eval(x, w, *bias, axis_name, axis_size, algorithm, w_kmajor, out_specs):
  del algorithm, bias, axis_name
  *lead, m, k = x.shape
  n = w.shape[:-1] if w_kmajor else w.shape[1:]
  y_spec, g_spec = _specs(out_specs, 2)
  return (_result(x, (*lead, axis_size * m, *n), y_spec), _result(x, (*lead, axis_size * m, k), g_spec))


def _rs_abstract_eval(x, w, *bias, axis_name, axis_size, algorithm, w_kmajor, out_specs):
  del algorithm, bias, axis_name
  contract = w.ndim - 1
  *lead, m = x.shape[:x.ndim - contract]
  n = w.shape[0] if w_kmajor else w.shape[-1]
  (z_spec,) = _specs(out_specs, 1)
  return _result(x, (*lead, m // axis_size, n), z_spec)


def _gather_abstract_eval(x, *, axis_name, axis_size):
  del axis_name
  *lead, m, c = x.shape
  return x.update(shape=(*lead, axis_size * m, c))


# --- batching ---------------------------------------------------------------
# x may carry any leading batch dims, so a batched x alone folds into them.
# Batched weights or bias mean a different matrix per element: the reference
# decomposition, vmapped.

def _batch_rule(prim, reference_fn, args, dims, **params):
  x, *rest = args
  dx, *drest = dims
  if all(d is None for d in drest):
    return prim.bind(jnp.moveaxis(x, dx, 0), *rest, **params), (0, 0) if prim.multiple_results else 0
  fn = functools.partial(_reference_call, reference_fn, **params)
  out = jax.vmap(fn, in_axes=tuple(dims))(*args)
  return out, (0, 0) if prim.multiple_results else 0


def _reference_call(reference_fn, x, w, *bias, axis_name, axis_size, algorithm, w_kmajor, out_specs=None):
  del axis_size, algorithm, out_specs
  return reference_fn(x, w, bias[0] if bias else None, axis_name=axis_name, w_kmajor=w_kmajor)


def _gather_batch_rule(args, dims, *, axis_name, axis_size):
  (x,), (dx,) = args, dims
  return all_gather_p.bind(jnp.moveaxis(x, dx, 0), axis_name=axis_name, axis_size=axis_size), 0


# --- lowering ---------------------------------------------------------------

def _lower_reference(ctx, *args, op, **params):
  reference_fn = reference.ag_matmul if op == "ag_matmul" else reference.matmul_rs
  fn = functools.partial(_reference_call, reference_fn, **params)
  return mlir.lower_fun(fn, multiple_results=op == "ag_matmul")(ctx, *args)


def _default_lowering(ctx, *args, op, **params):
  platforms = ", ".join(ctx.module_context.platforms)
  if params["algorithm"] == "fused":
    raise ValueError(f"jax_overlap.{op}: algorithm='fused' runs on GPU, but this computation is lowered for "
                     f"{platforms}; use algorithm='auto' or 'xla'")
  log.debug("jax_overlap.%s: XLA path (lowered for %s)", op, platforms)
  return _lower_reference(ctx, *args, op=op, **params)


def _matrix_lowering(ctx, *args, op, out_specs, **params):
  """The GPU lowering, which takes w as a matrix: other weights are reshaped around it (row-major views, free)."""
  del out_specs  # types only the global-array trace, never a lowered (local) call
  if params["algorithm"] == "xla":
    log.debug("jax_overlap.%s: XLA path (algorithm='xla')", op)
  if ctx.avals_in[1].ndim == 2:
    return _gpu_lowering(ctx, *args, op=op, **params)
  fn = functools.partial(_ag_as_matrix if op == "ag_matmul" else _rs_as_matrix, **params)
  return mlir.lower_fun(fn, multiple_results=op == "ag_matmul")(ctx, *args)


def _ag_as_matrix(x, w, *bias, w_kmajor, **params):
  n = w.shape[:-1] if w_kmajor else w.shape[1:]
  w2 = w.reshape(-1, w.shape[-1]) if w_kmajor else w.reshape(w.shape[0], -1)
  y, gathered = ag_matmul(x, w2, bias[0].reshape(-1) if bias else None, w_kmajor=w_kmajor, **params)
  return y.reshape(*y.shape[:-1], *n), gathered


def _rs_as_matrix(x, w, *bias, w_kmajor, **params):
  contract = w.ndim - 1
  k = math.prod(w.shape[1:] if w_kmajor else w.shape[:-1])
  w2 = w.reshape(w.shape[0], k) if w_kmajor else w.reshape(k, w.shape[-1])
  x2 = x.reshape(*x.shape[:x.ndim - contract], k)
  return matmul_rs(x2, w2, bias[0] if bias else None, w_kmajor=w_kmajor, **params)


def _group_ids(ctx, axis_name) -> tuple[tuple[tuple[int, ...], ...] | None, str]:
  """Global device ids of every group of `axis_name`, each in rank order (axis_index order)."""
  from jax._src import sharding_impls  # the lowering's axis context (mesh and manual axes)
  axis_ctx = ctx.module_context.axis_context
  if not isinstance(axis_ctx, sharding_impls.SPMDAxisContext):
    return None, "not inside shard_map or a custom partitioning"
  mesh = axis_ctx.mesh
  devices = getattr(mesh, "devices", None)
  if devices is None:
    return None, "the mesh has no concrete devices at lowering"
  auto = [a for a in mesh.axis_names if a not in axis_ctx.manual_axes and mesh.shape[a] > 1]
  if auto:
    return None, f"mesh axes {auto} are not manual here (partially manual shard_map)"
  names = list(mesh.axis_names)
  ids = np.vectorize(lambda d: d.id, otypes=[np.int64])(np.asarray(devices))
  group_axes = [names.index(a) for a in axis_name]
  other_axes = [i for i in range(len(names)) if i not in group_axes]
  size = math.prod(mesh.shape[a] for a in axis_name)
  ids = ids.transpose(other_axes + group_axes).reshape(-1, size)
  return tuple(tuple(int(i) for i in g) for g in ids), ""


def _fused_call(ctx, op: str, x_aval, w_aval, axis_name, axis_size, algorithm, w_kmajor):
  """(plan, groups) when the fused kernel takes this call, else (None, reason)."""
  if native.platform() is None:
    return None, "the native extension is not built"
  if ctx.module_context.platforms != (native.platform(),):
    return None, f"the extension is built for {native.platform()}"
  if axis_name is None:
    groups, world = (), 1
  else:
    groups, why = _group_ids(ctx, axis_name)
    if groups is None:
      return None, why
    world = axis_size
  runtime.initialize()
  if not runtime.is_active():
    return None, "no GPU workspace"
  if groups and not runtime.reachable({i for g in groups for i in g}):
    return None, "the group spans devices this process cannot reach (another host)"
  *lead, m, k = x_aval.shape
  batch = math.prod(lead)
  n = _n_of(w_aval, w_kmajor)
  planner = config.plan_ag_matmul if op == "ag_matmul" else config.plan_matmul_rs
  plan, why = planner(dtype_name=np.dtype(x_aval.dtype).name, rows=batch * m, k=k, n=n, world=world,
                      device=runtime.device_props(), tiles=native.tile_shapes(), algorithm=algorithm)
  if plan is None:
    return None, why
  return (plan, groups, world, batch, m, k, n), ""


def _gpu_lowering(ctx, x, w, *bias, op, axis_name, axis_size, algorithm, w_kmajor):
  params = dict(axis_name=axis_name, axis_size=axis_size, algorithm=algorithm, w_kmajor=w_kmajor)
  if algorithm == "xla":
    return _lower_reference(ctx, x, w, *bias, op=op, **params)
  x_aval, w_aval = ctx.avals_in[:2]
  fused, why = _fused_call(ctx, op, x_aval, w_aval, axis_name, axis_size, algorithm, w_kmajor)
  if fused is None:
    if algorithm == "fused":
      raise ValueError(f"jax_overlap.{op}: algorithm='fused' cannot take this call: {why}")
    log.debug("jax_overlap.%s: XLA path (%s)", op, why)
    return _lower_reference(ctx, x, w, *bias, op=op, **params)
  plan, groups, world, batch, m, k, n = fused
  nat = native.module()
  elem = np.dtype(x_aval.dtype).itemsize
  if op == "ag_matmul":
    region_bytes = nat.ag_matmul_region_bytes(world, batch * m, k, plan.tile, plan.chunk_k, elem)
  else:
    region_bytes = nat.matmul_rs_region_bytes(world, batch, m, n, plan.tile, elem)
  region_offset = runtime.region(op, groups, (batch, m, k, n, plan.tile, plan.chunk_k), region_bytes) \
      if world > 1 else 0
  native.ensure_registered()
  empty = jax.core.ShapedArray((0,), x_aval.dtype)
  bias_value = bias[0] if bias else mlir.ir_constant(np.zeros((0,), x_aval.dtype))
  avals_in = [x_aval, w_aval, ctx.avals_in[2] if bias else empty]
  if op == "ag_matmul":
    avals_out = [ctx.avals_out[0], ctx.avals_out[1] if world > 1 else empty]
  else:
    avals_out = list(ctx.avals_out)
  sub_ctx = ctx.replace(avals_in=avals_in, avals_out=avals_out)
  tile = next(t for t in native.tile_shapes() if t.index == plan.tile)
  slots = config.tail_slots(tile, batch * m, n, k, runtime.device_props()) if world == 1 else 0
  attrs = {**plan.attribute(), "w_kmajor": np.int64(w_kmajor), "region_offset": np.int64(region_offset),
           "region_bytes": np.int64(region_bytes), "tail_slots": np.int64(slots)}
  log.debug("jax_overlap.%s: fused (world %d, tile %d, workers %d, chunk_k %d; model %.0f us vs xla %.0f us)",
            op, world, plan.tile, plan.workers, plan.chunk_k, plan.est_fused_us, plan.est_xla_us)
  if world == 1:
    # No protocol: the stateless, command-buffer-compatible target, so XLA
    # can keep the call inside its CUDA/HIP graph.
    # The second result is the stream-K tail's scratch (config.tail_slots).
    scratch = jax.core.ShapedArray((nat.tail_scratch_bytes(plan.tile, slots),), np.uint8)
    sub_ctx = sub_ctx.replace(avals_out=[avals_out[0], scratch])
    y = jax.ffi.ffi_lowering(native.target(op + "_local"))(sub_ctx, x, w, bias_value, config=attrs)[0]
    return [y, x] if op == "ag_matmul" else [y]  # a group of one gathers x itself
  group_ids = np.array([i for g in groups for i in g], np.int64)
  return jax.ffi.ffi_lowering(native.target(op))(sub_ctx, x, w, bias_value, config=attrs, groups=group_ids,
                                                 world=np.int64(world))


def _gather_default_lowering(ctx, x, *, axis_name, axis_size):
  del axis_size
  fn = lambda v: jax.lax.all_gather(v, axis_name, axis=v.ndim - 2, tiled=True)
  return mlir.lower_fun(fn, multiple_results=False)(ctx, x)


def _gather_gpu_lowering(ctx, x, *, axis_name, axis_size):
  x_aval = ctx.avals_in[0]
  groups, why = _group_ids(ctx, axis_name)
  if groups is not None and native.platform() is not None:
    runtime.initialize()
    if not runtime.is_active() or not runtime.reachable({i for g in groups for i in g}):
      groups, why = None, "no workspace, or peers on another host"
  row_bytes = x_aval.shape[-1] * np.dtype(x_aval.dtype).itemsize
  if groups is None or axis_size < 2 or row_bytes % 16:
    log.debug("jax_overlap.all_gather: XLA path (%s)", why or "group of one or rows not 16-byte multiples")
    return _gather_default_lowering(ctx, x, axis_name=axis_name, axis_size=axis_size)
  rows = math.prod(x_aval.shape[:-1])
  region_bytes = native.module().all_gather_region_bytes(axis_size, rows, row_bytes)
  offset = runtime.region("all_gather", groups, tuple(x_aval.shape) + (np.dtype(x_aval.dtype).name,),
                          region_bytes)
  native.ensure_registered()
  ids = np.array([i for g in groups for i in g], np.int64)
  return jax.ffi.ffi_lowering(native.target("all_gather"))(
      ctx, x, config={"region_offset": np.int64(offset), "region_bytes": np.int64(region_bytes)}, groups=ids,
      world=np.int64(axis_size))


def _register():
  from jax._src import dispatch  # eager application and device assignment at lowering
  for prim, abstract_eval, op, ref in ((ag_matmul_p, _ag_abstract_eval, "ag_matmul", reference.ag_matmul),
                                       (matmul_rs_p, _rs_abstract_eval, "matmul_rs", reference.matmul_rs)):
    prim.def_impl(functools.partial(dispatch.apply_primitive, prim))
    prim.def_abstract_eval(abstract_eval)
    batching.primitive_batchers[prim] = functools.partial(_batch_rule, prim, ref)
    mlir.register_lowering(prim, functools.partial(_default_lowering, op=op))
    for platform in ("cuda", "rocm"):
      mlir.register_lowering(prim, functools.partial(_matrix_lowering, op=op), platform=platform)
  all_gather_p.def_impl(functools.partial(dispatch.apply_primitive, all_gather_p))
  all_gather_p.def_abstract_eval(_gather_abstract_eval)
  batching.primitive_batchers[all_gather_p] = _gather_batch_rule
  mlir.register_lowering(all_gather_p, _gather_default_lowering)
  for platform in ("cuda", "rocm"):
    mlir.register_lowering(all_gather_p, _gather_gpu_lowering, platform=platform)


_register()
