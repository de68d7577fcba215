"""How the global-array mode partitions each op, from its operands' specs (pure functions).

Used by the custom partitioning (partitioning.py) and, on meshes with Explicit
axes, by the primitives' abstract eval to type the outputs the same way.
"""

from __future__ import annotations

import math

from jax.sharding import PartitionSpec as P


def spec_of(sharding, ndim: int) -> list:
  """Per-dim mesh axes (a tuple, or None) of a sharding."""
  spec = list(getattr(sharding, "spec", ()))
  spec += [None] * (ndim - len(spec))
  out = []
  for s in spec[:ndim]:
    if s is None or s == ():
      out.append(None)
    else:
      out.append(tuple(s) if isinstance(s, (tuple, list)) else (s,))
  return out


def _axes_in(specs) -> set:
  return {a for s in specs if s for a in s}


def ag_plan(mesh, x_spec, w_spec, w_kmajor: bool):
  """(axes or None, x, w, bias, y, gathered specs)."""
  *batch, rows, _ = x_spec
  n_spec = w_spec[0] if w_kmajor else w_spec[1]
  taken = _axes_in(batch)
  if rows and rows == n_spec and not set(rows) & taken:
    axes = rows
    w_sh = P(axes, None) if w_kmajor else P(None, axes)
    return axes, P(*batch, axes, None), w_sh, P(axes), P(*batch, None, axes), P(*batch, None, None)
  if rows and set(rows) & taken:
    rows = None
  cols = n_spec if n_spec and not set(n_spec) & (taken | set(rows or ())) else None
  w_sh = P(cols, None) if w_kmajor else P(None, cols)
  return None, P(*batch, rows, None), w_sh, P(cols), P(*batch, rows, cols), P(*batch, rows, None)


def rs_plan(mesh, x_spec, w_spec, w_kmajor: bool, m: int):
  """(axes or None, x, w, bias, out specs)."""
  *batch, rows, kx = x_spec
  kw = w_spec[1] if w_kmajor else w_spec[0]
  n_spec = w_spec[0] if w_kmajor else w_spec[1]
  taken = _axes_in(batch)
  if kx and kx == kw and not set(kx) & taken and m % math.prod(mesh.shape[a] for a in kx) == 0:
    axes = kx
    w_sh = P(None, axes) if w_kmajor else P(axes, None)
    return axes, P(*batch, None, axes), w_sh, P(None), P(*batch, axes, None)
  if rows and set(rows) & taken:
    rows = None
  cols = n_spec if n_spec and not set(n_spec) & (taken | set(rows or ())) else None
  w_sh = P(cols, None) if w_kmajor else P(None, cols)
  return None, P(*batch, rows, None), w_sh, P(cols), P(*batch, rows, cols)


