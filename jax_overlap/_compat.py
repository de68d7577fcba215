"""The few JAX internals whose spelling differs between supported JAX versions."""

from __future__ import annotations

import functools

import jax
import numpy as np
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


def kv_client():
  """The jax.distributed coordination service's key-value client, or None before jax.distributed.initialize()."""
  from jax._src import distributed  # not exported
  return distributed.global_state.client


def hlo_reshape(value, shape: tuple, dtype):
  """stablehlo.reshape of an MLIR value to `shape` (of `dtype`, its own), inside a lowering rule."""
  from jax._src.lib.mlir.dialects import hlo  # not exported
  from jax.interpreters import mlir
  return hlo.reshape(mlir.ir.RankedTensorType.get(shape, mlir.dtype_to_ir_type(np.dtype(dtype))), value)


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
