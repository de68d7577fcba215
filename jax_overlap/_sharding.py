"""Specs (per dim a tuple of mesh axes, or None), the global-array plans' pieces, and Explicit meshes. A dim its
axes do not divide is unsharded: XLA's padding of uneven shards must not reach a product. Per-shard code runs with
Explicit axes Auto (auto_axes, untyped): typed, a one-device call inlines with global operand types (an illegal
local dot_general), and XLA's CPU collectives refuse a typed reducer."""

from __future__ import annotations

import contextlib
import math

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jax_overlap import _compat


def spec_of(sharding, ndim: int) -> list:
  spec = list(sharding if isinstance(sharding, P) else getattr(sharding, "spec", ()))
  spec += [None] * (ndim - len(spec))
  out = []
  for s in spec[:ndim]:
    if s is None or s == ():
      out.append(None)
    else:
      out.append(tuple(s) if isinstance(s, (tuple, list)) else (s,))
  return out


def spec_on(mesh, s, ndim: int) -> list | None:
  """spec_of an undecoded custom-partitioning sharding; None for Shardy's sub-axes (_compat.named_spec)."""
  if isinstance(s, (NamedSharding, P)):
    return spec_of(s, ndim)
  spec = _compat.named_spec(s, mesh, ndim)
  return None if spec is None else spec_of(spec, ndim)


def size(mesh, axes) -> int:
  return math.prod(mesh.shape[a] for a in axes or ())


def even(mesh, spec, shape) -> list:
  return [s if s and n % size(mesh, s) == 0 else None for s, n in zip(spec, shape)]


def axes_in(specs) -> set:
  return {a for s in specs if s for a in s}


def disjoint(specs, taken: set) -> list:
  out, used = [], set(taken)
  for s in specs:
    keep = s if s and not set(s) & used else None
    used |= set(keep or ())
    out.append(keep)
  return out


def settle(free, n_specs, request) -> tuple[list, list]:
  """(free, n_specs) with no axis in both: the output dims win where the request has them (XLA reshards a result
  by replicating it, an "Involuntary full rematerialization"), else the batch dims."""
  n_specs = list(n_specs)
  if request is not None and axes_in(free) & axes_in(n_specs):
    asked = list(request[len(request) - len(n_specs):])
    if all(not s or tuple(s) == tuple(a or ()) for s, a in zip(n_specs, asked)):
      return disjoint(free, axes_in(n_specs)), n_specs
  return list(free), disjoint(n_specs, axes_in(free))


def w_spec(k_specs, n_specs, w_kmajor: bool) -> P:
  return P(*n_specs, *k_specs) if w_kmajor else P(*k_specs, *n_specs)


def factors(prefix: str, count: int) -> list:
  return [f"{prefix}{i}" for i in range(count)]


def fold(a, axis: int, end: int):
  """a with dims axis..end-1 merged: a tiled gather or scatter along `axis` is one along the merged dim."""
  shape = a.shape
  start, stop = a.ndim + axis, a.ndim + end
  return a.reshape(*shape[:start], math.prod(shape[start:stop]), *shape[stop:])


def reshape(a, shape, like=None):
  """a.reshape(shape), typed on an Explicit mesh, where JAX refuses most splits or merges of a sharded dim ([B, S,
  K] -> [B*S, K] with S sharded). The result takes `like`'s layout, else merged dims keep their axes in order and a
  split dim's go to the first part they divide (none: gathered)."""
  if -1 in shape:
    rest = math.prod(d for d in shape if d != -1)
    shape = tuple(math.prod(a.shape) // rest if d == -1 else d for d in shape)
  aval = jax.typeof(a)
  if explicit_mesh(aval) is None or 0 in a.shape:
    return a.reshape(shape)
  if like is not None:
    out = spec_of(jax.typeof(like).sharding, len(shape))
  else:
    out = _reshaped_spec(aval.sharding.mesh, tuple(a.shape), spec_of(aval.sharding, a.ndim), tuple(shape))
  return jax.lax.reshape(a, tuple(shape), out_sharding=aval.sharding.update(spec=P(*out)))


def _reshaped_spec(mesh, old: tuple, spec: list, new: tuple) -> list:
  out, i, j = [None] * len(new), 0, 0
  while i < len(old) and j < len(new):
    olds, news, po, pn = [i], [j], old[i], new[j]
    i, j = i + 1, j + 1
    while po != pn:
      if po < pn:
        olds.append(i)
        po, i = po * old[i], i + 1
      else:
        news.append(j)
        pn, j = pn * new[j], j + 1
    axes = tuple(a for d in olds for a in (spec[d] or ()))
    if not axes or (len(olds) > 1 and len(news) > 1):
      continue
    if len(olds) > 1:
      out[news[0]] = axes
      continue
    first = next((d for d in news if new[d] > 1), news[0])
    fits = [d for d in news if new[d] % size(mesh, axes) == 0]
    if fits:
      out[first if first in fits else fits[0]] = axes
  return out


def resharded(v, mesh, spec):
  if v is None or spec_of(jax.typeof(v).sharding, v.ndim) == spec_of(spec, v.ndim):
    return v
  return jax.sharding.reshard(v, NamedSharding(mesh, spec))


def blocks_like(scale, x):
  """A block scale in x's layout on an Explicit mesh, where its product with x is illegal otherwise (small reshard)."""
  aval = jax.typeof(x)
  mesh = explicit_mesh(aval)
  if mesh is None:
    return scale
  return resharded(scale, mesh, P(*even(mesh, spec_of(aval.sharding, x.ndim), scale.shape)))


def has_explicit_axes(mesh) -> bool:
  return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def explicit_mesh(aval):
  mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
  return mesh if has_explicit_axes(mesh) else None


def _auto_axes(mesh):
  explicit = {name: AxisType.Auto for name, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}
  return mesh.update_axis_types(explicit) if explicit else mesh


def untyped(aval):
  mesh = explicit_mesh(aval)
  if mesh is None:
    return aval
  return aval.update(sharding=aval.sharding.update(mesh=_auto_axes(mesh), spec=P()))


@contextlib.contextmanager
def auto_axes():
  mesh = jax.sharding.get_abstract_mesh()
  with jax.sharding.use_abstract_mesh(_auto_axes(mesh)):
    yield

