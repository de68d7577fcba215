"""Shardings the ops' global-array plans share: specs, the pieces of a plan, and meshes with Explicit axes.

Specs are lists with one entry per dim: a tuple of mesh axes, or None. A dim
whose size is not a multiple of its axes' size is treated as unsharded (XLA
pads uneven shards with values that must not reach a product or a gather), so
every plan partitions evenly. Each op's plan is its own module's
(ops/<op>.py sharding_plan); partitioning.py applies it.

Explicit axes. A lowering or a partitioned body is per-shard code, which must
not be typed by the caller's mesh: a call on a one-device mesh is inlined by
JAX with its global operand types (x's rows and w's columns on one axis make
the local dot_general an illegal sharding), and a custom partitioning's body
is lowered under the caller's mesh, where the reducer of a collective would be
typed too (XLA's CPU collectives accept only a plain binary reducer). So they
run with that mesh's Explicit axes Auto: auto_axes(), untyped().
"""

from __future__ import annotations

import contextlib
import math

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


def spec_of(sharding, ndim: int) -> list:
  """Per-dim mesh axes (a tuple, or None) of a sharding or a PartitionSpec."""
  spec = list(sharding if isinstance(sharding, P) else getattr(sharding, "spec", ()))
  spec += [None] * (ndim - len(spec))
  out = []
  for s in spec[:ndim]:
    if s is None or s == ():
      out.append(None)
    else:
      out.append(tuple(s) if isinstance(s, (tuple, list)) else (s,))
  return out


def size(mesh, axes) -> int:
  return math.prod(mesh.shape[a] for a in axes or ())


def even(mesh, spec, shape) -> list:
  """spec with every dim that its axes do not divide evenly unsharded."""
  return [s if s and n % size(mesh, s) == 0 else None for s, n in zip(spec, shape)]


def axes_in(specs) -> set:
  return {a for s in specs if s for a in s}


def disjoint(specs, taken: set) -> list:
  """specs, each left unsharded where its axes collide with `taken` or with an earlier kept spec."""
  out, used = [], set(taken)
  for s in specs:
    keep = s if s and not set(s) & used else None
    used |= set(keep or ())
    out.append(keep)
  return out


def w_spec(k_specs, n_specs, w_kmajor: bool) -> P:
  """w's spec from its contraction dims' and output dims' ([K.., N..], or [N.., K..] when w_kmajor)."""
  return P(*n_specs, *k_specs) if w_kmajor else P(*k_specs, *n_specs)


def factors(prefix: str, count: int) -> list:
  """Names of `count` factors of a Shardy sharding rule."""
  return [f"{prefix}{i}" for i in range(count)]


def fold(a, axis: int, end: int):
  """a with dims axis..end-1 (negative, end exclusive) merged into one: a tiled gather or scatter along `axis`
  moves whole blocks of everything after it, so on row-major arrays it is one along the merged dim (free)."""
  shape = a.shape
  start, stop = a.ndim + axis, a.ndim + end
  return a.reshape(*shape[:start], math.prod(shape[start:stop]), *shape[stop:])


def resharded(v, mesh, spec):
  """v (None passes) in the layout `spec` of `mesh`, resharded only when its type has another."""
  if v is None or spec_of(jax.typeof(v).sharding, v.ndim) == spec_of(spec, v.ndim):
    return v
  return jax.sharding.reshard(v, NamedSharding(mesh, spec))


# --- meshes with Explicit axes --------------------------------------------------

def explicit_mesh(aval):
  """The mesh of an aval typed with a sharding on a mesh with Explicit axes, else None."""
  mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
  types = getattr(mesh, "axis_types", ())
  return mesh if any(t == AxisType.Explicit for t in types) else None


def _auto_axes(mesh):
  explicit = {name: AxisType.Auto for name, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}
  return mesh.update_axis_types(explicit) if explicit else mesh


def untyped(aval):
  """aval without an Explicit sharding in its type."""
  mesh = explicit_mesh(aval)
  if mesh is None:
    return aval
  return aval.update(sharding=aval.sharding.update(mesh=_auto_axes(mesh), spec=P()))


@contextlib.contextmanager
def auto_axes():
  """The current abstract mesh with its Explicit axes Auto: ops traced inside carry no sharding in their types."""
  mesh = jax.sharding.get_abstract_mesh()
  with jax.sharding.use_abstract_mesh(_auto_axes(mesh)):
    yield

