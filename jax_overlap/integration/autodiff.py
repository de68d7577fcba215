"""What the ops' backward passes share. The ops are each other's gradient (the kernels read w in either layout):
  ag_matmul  y = AG(x) @ W + b:  dx = RS(dy @ W^T),  dW = AG(x)^T @ dy
  matmul_rs  z = RS(x @ W) + b:  dx = AG(dz) @ W^T,  dW = x^T @ AG(dz)"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax
from jax.sharding import NamedSharding

from jax_overlap import _compat, _sharding
from jax_overlap.quantization import formats


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Layout:
  sharding: NamedSharding


def varying(axes, *values):
  """Casts every operand to vary over the group's axes and every axis any operand varies over, so cotangents have
  their primal's type and the cast's transpose sums the gradients of replicated operands."""
  union = set(axes)
  for v in values:
    if v is not None:
      union |= _compat.varying_axes(v)
  ordered = tuple(axes) + tuple(sorted(union - set(axes)))
  return tuple(None if v is None else _compat.make_varying(v, ordered) for v in values)


def explicit_sharding(v):
  aval = jax.typeof(v)
  return aval.sharding if _sharding.explicit_mesh(aval) is not None else None


def layout(v, axes):
  """v's cotangent layout: its type on an Explicit mesh, v itself (shard_alike) on an Auto mesh, None inside
  shard_map (`axes` set), where cotangents have their primal's type already."""
  if axes is not None or v is None:
    return None
  found = explicit_sharding(v)
  return v if found is None else Layout(found)


def like(ct, primal_layout):
  if ct is None or primal_layout is None:
    return ct
  if isinstance(primal_layout, Layout):
    if jax.typeof(ct).sharding == primal_layout.sharding:
      return ct
    return jax.sharding.reshard(ct, primal_layout.sharding)
  return _compat.shard_alike(ct, primal_layout)[0]


def request(primal_layout, ndim: int):
  return tuple(_sharding.spec_of(primal_layout.sharding, ndim)) if isinstance(primal_layout, Layout) else None


def weight_grad(a, b, a_free: int, w_layout, w_kmajor: bool, dtype):
  """dW for out = a @ W: a^T @ b (b^T @ a when w_kmajor) over every dim but a's last a_free and b's own."""
  lead = tuple(range(a.ndim - a_free))
  first, second = (b, a) if w_kmajor else (a, b)
  out_sharding = w_layout.sharding if isinstance(w_layout, Layout) else None
  dw = lax.dot_general(first, second, ((lead, lead), ((), ())),
                       preferred_element_type=formats.accumulator(a.dtype), out_sharding=out_sharding)
  return like(dw.astype(dtype), w_layout)


def bias_grad(dy, bias, bias_layout):
  if bias is None:
    return None
  db = dy.astype(formats.accumulator(dy.dtype)).sum(axis=tuple(range(dy.ndim - bias.ndim))).astype(bias.dtype)
  return like(db, bias_layout)
