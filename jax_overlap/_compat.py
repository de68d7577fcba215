"""The few JAX internals whose spelling differs between supported JAX versions."""

from __future__ import annotations

import functools

import jax
from jax import lax


def varying_axes(x) -> frozenset:
  """Manual mesh axes over which `x` varies (empty outside shard_map or with check_vma=False)."""
  aval = jax.typeof(x)
  vma = getattr(aval, "vma", None)
  if vma is not None:
    return frozenset(vma)
  mat = getattr(aval, "mat", None) or getattr(aval, "manual_axis_type", None)
  return frozenset(getattr(mat, "varying", ()))


def make_varying(x, axes: tuple):
  missing = tuple(a for a in axes if a not in varying_axes(x))
  if not missing:
    return x
  return lax.pcast(x, missing, to="varying")


def axis_size(axis_name) -> int:
  return lax.axis_size(axis_name)


def bound_axis_names() -> tuple:
  from jax._src import core
  return tuple(core.get_axis_env().axis_names())


def forward_mode(*values) -> bool:
  """Whether a value is a JVP tracer; reverse mode has linearize tracers unless jax_use_direct_linearize is off."""
  from jax._src.interpreters import ad
  return jax.config.jax_use_direct_linearize and any(isinstance(v, ad.JVPTracer) for v in values)


def apply_primitive(prim):
  from jax._src import dispatch
  return functools.partial(dispatch.apply_primitive, prim)


def spmd_axis_context_type():
  from jax._src import sharding_impls
  return sharding_impls.SPMDAxisContext


def named_spec(s, mesh, ndim: int):
  """The PartitionSpec of an undecoded custom-partitioning sharding; None for Shardy's sub-axes."""
  from jax._src import sharding_impls
  hlo = getattr(s, "_hlo_sharding", None)
  if hlo is None:
    return None
  try:
    (spec,) = sharding_impls.parse_flatten_op_sharding(hlo, mesh)
  except (ValueError, KeyError, StopIteration, NotImplementedError, AssertionError):
    return None
  # An unusual device order may parse as another layout.
  return spec if s.is_equivalent_to(jax.sharding.NamedSharding(mesh, spec), ndim) else None


def kv_client():
  from jax._src import distributed
  return distributed.global_state.client


def remat_rank(case) -> int:
  """How much a jax.checkpoint policy's answer keeps: save 2, offload 1, recompute 0."""
  from jax._src.interpreters import partial_eval as pe
  case = pe.ensure_enum(case)
  if isinstance(case, pe.SaveableType):
    return 2
  return 1 if isinstance(case, pe.Offloadable) else 0


try:
  from jax.experimental.shard_alike import shard_alike as _shard_alike
except ImportError:  # jax 0.11 dropped the module
  _shard_alike = None


def shard_alike(x, y):
  """Ties x's and y's shardings: on an Auto mesh the only way to give a gradient its primal's layout."""
  return _group_p.bind(x, y) if _shard_alike is None else _shard_alike(x, y)


def _sharding_group_primitive():
  """A Shardy sharding group standing in for shard_alike in the JAX versions without it."""
  import itertools
  from jax._src import core, dispatch
  from jax._src.interpreters import ad, batching, mlir
  from jax._src.lib.mlir.dialects import sdy

  prim = core.Primitive("jax_overlap_shard_alike")
  prim.multiple_results = True
  prim.def_impl(functools.partial(dispatch.apply_primitive, prim))
  prim.def_abstract_eval(lambda x, y: (x, y))
  # Linear in both: the cotangents are tied alike (a Zero, no array, has no layout to tie).
  ad.deflinear(prim, lambda ct, **_: ct if any(type(c) is ad.Zero for c in ct) else prim.bind(*ct))

  def batch(args, dims):
    (x, y), (xd, yd) = args, dims
    if xd is None:
      x, xd = batching.broadcast(x, y.shape[yd], yd, None), yd
    elif yd is None:
      y = batching.broadcast(y, x.shape[xd], xd, None)
    elif yd != xd:
      y = batching.moveaxis(y, yd, xd)
    return prim.bind(x, y), (xd, xd)

  batching.primitive_batchers[prim] = batch
  groups = itertools.count()

  def lower(ctx, x, y):
    del ctx
    group = next(groups)
    sdy.sharding_group(x, group)
    sdy.sharding_group(y, group)
    return x, y

  mlir.register_lowering(prim, lower)
  return prim


_group_p = _sharding_group_primitive() if _shard_alike is None else None
