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
  """pcast `x` to varying over every axis of `axes` it does not vary over yet."""
  missing = tuple(a for a in axes if a not in varying_axes(x))
  if not missing:
    return x
  return lax.pcast(x, missing, to="varying")


def axis_size(axis_name) -> int:
  return lax.axis_size(axis_name)


def bound_axis_names() -> tuple:
  """The axis names bound where this is traced (shard_map's manual mesh axes, vmap and pmap axis names)."""
  from jax._src import core  # not exported
  return tuple(core.get_axis_env().axis_names())


def forward_mode(*values) -> bool:
  """Whether a value is being differentiated in forward mode (jax.jvp, jax.jacfwd) here: a JVP tracer. Reverse
  mode (jax.grad, jax.vjp, jax.linearize) traces with linearize tracers, unless jax_use_direct_linearize is off."""
  from jax._src.interpreters import ad  # not exported
  return jax.config.jax_use_direct_linearize and any(isinstance(v, ad.JVPTracer) for v in values)


def apply_primitive(prim):
  """The eager implementation of a primitive: JAX's own dispatch (device assignment, a jitted call)."""
  from jax._src import dispatch  # not exported
  return functools.partial(dispatch.apply_primitive, prim)


def spmd_axis_context_type():
  """The lowering's axis-context class inside shard_map and custom partitioning (mesh and manual axes)."""
  from jax._src import sharding_impls  # not exported
  return sharding_impls.SPMDAxisContext


def named_spec(s, mesh, ndim: int):
  """The PartitionSpec on `mesh` of a sharding custom partitioning hands over undecoded (decode_shardings=False: a
  GSPMDSharding of an HloSharding), or None where no PartitionSpec of the mesh gives it (Shardy splits an axis into
  sub-axes through reshapes, e.g. 2 blocks of a block scale on an axis of 4; JAX's decoding then raises)."""
  from jax._src import sharding_impls  # the decoding custom partitioning applies (not exported)
  hlo = getattr(s, "_hlo_sharding", None)
  if hlo is None:
    return None
  try:
    (spec,) = sharding_impls.parse_flatten_op_sharding(hlo, mesh)
  except (ValueError, KeyError, StopIteration, NotImplementedError, AssertionError):
    return None
  # its parse of an unusual device order may name another layout: only one that gives the same shards counts
  return spec if s.is_equivalent_to(jax.sharding.NamedSharding(mesh, spec), ndim) else None


def kv_client():
  """The jax.distributed coordination service's key-value client, or None before jax.distributed.initialize()."""
  from jax._src import distributed  # not exported
  return distributed.global_state.client


def remat_rank(case) -> int:
  """How much a jax.checkpoint policy's answer keeps: save 2, offload 1, recompute 0."""
  from jax._src.interpreters import partial_eval as pe  # the policy answer types (not exported)
  case = pe.ensure_enum(case)
  if isinstance(case, pe.SaveableType):
    return 2
  return 1 if isinstance(case, pe.Offloadable) else 0


try:
  from jax.experimental.shard_alike import shard_alike as _shard_alike
except ImportError:  # jax 0.11 dropped the module
  _shard_alike = None

HAS_SHARD_ALIKE = _shard_alike is not None


def shard_alike(x, y):
  """Ties x's and y's shardings (jax.experimental.shard_alike) where the installed JAX has it. Without it
  (jax 0.11 dropped the module) the pair comes back as it is: the values are the same, only XLA may then
  pick another layout for x."""
  return (x, y) if _shard_alike is None else _shard_alike(x, y)
