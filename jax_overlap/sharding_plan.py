"""How the global-array mode partitions each op, from its operands' specs and shapes (pure functions).

Used by the custom partitioning (partitioning.py), and on meshes with Explicit
axes also at trace time, to type the outputs the way they will be laid out.

Specs are lists with one entry per dim: a tuple of mesh axes, or None. A dim
whose size is not a multiple of its axes' size is treated as unsharded (XLA
pads uneven shards with values that must not reach a product or a gather), so
every plan partitions evenly.

ag_matmul  x [..., m, K], w [K, *n] (or [*n, K]), bias [*n]; `gather` is the x dim gathered (default -2)
  gather   exactly one of w's n dims is sharded, on axes A, and x's gather dim is sharded on
           (*others, *A): gather x over A; y keeps `others` on that dim and A on w's sharded dim.
  plain    x keeps its sharding but K, w its n dims' sharding where it does not collide with x's;
           y is the local product.
matmul_rs  x [..., M, *k], w [*k, N] (or [N, *k]), bias [N]
  scatter  x's and w's k dims are sharded alike, on axes A: reduce over A, scattered onto one output
           dim (`scatter`: the scatter_axis argument, else the dim the requested output sharding puts
           A on, else the rows, -2), which keeps its own sharding as the major part.
  reduce   as scatter, but the requested output sharding has A nowhere, or the scatter dim is not a
           multiple of its new axes' size: an all-reduce over A.
  plain    the contraction is not sharded alike: K unsharded (XLA gathers it), a local product.
Axes on x's other dims pass through as batch in every case.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from jax.sharding import PartitionSpec as P


class AgPlan(NamedTuple):
  axes: tuple | None  # mesh axes x is gathered over; None: a plain partitioning
  x: P
  w: P
  bias: P
  y: P
  gathered: P
  why: str  # what decided it, for the DEBUG log


class RsPlan(NamedTuple):
  axes: tuple | None  # mesh axes the partial products are reduced over; None: a plain partitioning
  scatter: int | None  # negative output dim the reduction scatters onto; None: an all-reduce
  x: P
  w: P
  bias: P
  out: P
  why: str


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


def _size(mesh, axes) -> int:
  return math.prod(mesh.shape[a] for a in axes or ())


def _even(mesh, spec, shape) -> list:
  """spec with every dim that its axes do not divide evenly unsharded."""
  return [s if s and n % _size(mesh, s) == 0 else None for s, n in zip(spec, shape)]


def _axes_in(specs) -> set:
  return {a for s in specs if s for a in s}


def _disjoint(specs, taken: set) -> list:
  """specs, each left unsharded where its axes collide with `taken` or with an earlier kept spec."""
  out, used = [], set(taken)
  for s in specs:
    keep = s if s and not set(s) & used else None
    used |= set(keep or ())
    out.append(keep)
  return out


def _w_spec(k_specs, n_specs, w_kmajor: bool) -> P:
  return P(*n_specs, *k_specs) if w_kmajor else P(*k_specs, *n_specs)


def ag_plan(mesh, x_spec, w_spec, x_shape, w_shape, w_kmajor: bool, gather: int = -2) -> AgPlan:
  x_spec, w_spec = _even(mesh, x_spec, x_shape), _even(mesh, w_spec, w_shape)
  free = x_spec[:-1]
  g = len(x_spec) + gather
  n_specs = w_spec[:-1] if w_kmajor else w_spec[1:]
  n_none = [None] * len(n_specs)
  sharded = [(i, s) for i, s in enumerate(n_specs) if s]
  rows = x_spec[g] or ()
  if len(sharded) == 1:
    i, axes = sharded[0]
    if len(rows) >= len(axes) and rows[len(rows) - len(axes):] == axes:
      kept = list(free)
      kept[g] = rows[:len(rows) - len(axes)] or None
      n_out = list(n_none)
      n_out[i] = axes
      return AgPlan(axes, P(*free, None), _w_spec([None], n_out, w_kmajor), P(*n_out), P(*kept, *n_out),
                    P(*kept, None), f"gather dim {gather} over {axes}")
    why = f"x's dim {gather} is sharded on {rows or 'nothing'}, not ending with w's output axes {axes}"
  else:
    why = "none of w's output dims is sharded" if not sharded else "more than one of w's output dims is sharded"
  n_kept = _disjoint(n_specs, _axes_in(free))
  return AgPlan(None, P(*free, None), _w_spec([None], n_kept, w_kmajor), P(*n_kept), P(*free, *n_kept),
                P(*free, None), why)


def rs_plan(mesh, x_spec, w_spec, x_shape, w_shape, w_kmajor: bool, scatter: int | None = None,
            request=None) -> RsPlan:
  """`scatter`: the output dim asked for (negative), or None; `request`: a requested output spec, or None."""
  x_spec, w_spec = _even(mesh, x_spec, x_shape), _even(mesh, w_spec, w_shape)
  contract = len(w_shape) - 1
  free, xk = x_spec[:len(x_spec) - contract], x_spec[len(x_spec) - contract:]
  wk, n_spec = (w_spec[1:], w_spec[0]) if w_kmajor else (w_spec[:-1], w_spec[-1])
  (n_kept,) = _disjoint([n_spec], _axes_in(free))
  axes = tuple(a for s in xk for a in (s or ()))
  if not axes or xk != wk:
    none_k = [None] * contract
    why = "the contraction is not sharded" if not axes else f"x's contraction dims {xk} and w's {wk} differ"
    return RsPlan(None, None, P(*free, *none_k), _w_spec(none_k, [n_kept], w_kmajor), P(n_kept),
                  P(*free, n_kept), why)
  out = [*free, n_kept]
  x_sh, w_sh = P(*free, *xk), _w_spec(wk, [n_kept], w_kmajor)
  dim = _scatter_dim(out, axes, scatter, request)
  if dim is None:
    return RsPlan(axes, None, x_sh, w_sh, P(n_kept), P(*out), f"all-reduce over {axes}: the requested output "
                  f"sharding {request} does not shard over them")
  out_shape = (*x_shape[:len(x_shape) - contract], w_shape[0] if w_kmajor else w_shape[-1])
  on_dim = (*(out[dim] or ()), *axes)
  if out_shape[dim] % _size(mesh, on_dim):
    return RsPlan(axes, None, x_sh, w_sh, P(n_kept), P(*out), f"all-reduce over {axes}: output dim "
                  f"{dim - len(out)} ({out_shape[dim]}) is not a multiple of the size of {on_dim}")
  out[dim] = on_dim
  bias = P(on_dim) if dim == len(out) - 1 else P(n_kept)
  return RsPlan(axes, dim - len(out), x_sh, w_sh, bias, P(*out), f"reduce-scatter over {axes} onto dim "
                f"{dim - len(out)}")


def _scatter_dim(out, axes, scatter, request) -> int | None:
  """The output dim (non-negative) the reduced axes go to, or None for an all-reduce."""
  if scatter is not None:
    return len(out) + scatter
  if request is None:
    return len(out) - 2
  for d, s in enumerate(request):
    if s and len(s) >= len(axes) and tuple(s[len(s) - len(axes):]) == axes:
      return d
  return None
