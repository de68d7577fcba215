"""Global-array mode (axis_name=None under jit): custom partitioning with Shardy rules.

The partitioned body is exactly the shard_map form when the input shardings
ask for the collective; any other sharding gets a plain partitioning whose
body is a local product, so the answer is right either way.

ag_matmul  x [..., M, K], w [K, N] (or [N, K] when w_kmajor), bias [N]
  fused:  x rows and w's N dim sharded on the same mesh axes (K unsharded)
          -> gather x's rows over those axes; y [..., M, N] sharded on N;
             the gathered x comes back replicated over them.
  plain:  x keeps its batch/row sharding, w keeps its N sharding when it is
          on other axes, K is replicated; y = local product.
matmul_rs  x [..., M, K], w [K, N] (or [N, K]), bias [N]
  fused:  x's K and w's K sharded on the same axes, M divisible by their size
          -> reduce-scatter over them; out [..., M, N] sharded on M.
  plain:  as above, with K replicated (XLA gathers it).
Other mesh axes on leading batch dims pass through in both cases.

Rules: ag_matmul's output rows are their own factor ("p"), so propagation
does not copy x's row sharding onto y (the fused result is column-sharded).
"""

from __future__ import annotations

import functools
import math

from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_overlap import primitives


def _spec(shape_with_sharding, ndim: int) -> list:
  """Per-dim mesh axes (a tuple, or None) of an operand's sharding."""
  spec = list(getattr(shape_with_sharding.sharding, "spec", ()))
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


def _ag_plan(mesh, x_spec, w_spec, w_kmajor: bool):
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


def _rs_plan(mesh, x_spec, w_spec, w_kmajor: bool, m: int):
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


def _named(mesh, *specs):
  return tuple(NamedSharding(mesh, s) for s in specs)


@functools.cache
def _ag_function(ndim: int, has_bias: bool, w_kmajor: bool, algorithm: str):
  def local(x, w, *bias):
    return primitives.ag_matmul(x, w, bias[0] if bias else None, axis_name=None, axis_size=1,
                                algorithm=algorithm, w_kmajor=w_kmajor)

  fn = custom_partitioning(local)

  def shardings(mesh, arg_shapes):
    return _ag_plan(mesh, _spec(arg_shapes[0], ndim), _spec(arg_shapes[1], 2), w_kmajor)

  def infer(mesh, arg_shapes, result_shape):
    _, _, _, _, y, g = shardings(mesh, arg_shapes)
    return _named(mesh, y, g)

  def partition(mesh, arg_shapes, result_shape):
    axes, x, w, b, y, g = shardings(mesh, arg_shapes)
    arg_sh = _named(mesh, x, w, b)[: 3 if has_bias else 2]
    if axes is None:
      return mesh, local, _named(mesh, y, g), arg_sh
    size = math.prod(mesh.shape[a] for a in axes)

    def fused(x, w, *bias):
      return primitives.ag_matmul(x, w, bias[0] if bias else None, axis_name=axes, axis_size=size,
                                  algorithm=algorithm, w_kmajor=w_kmajor)

    return mesh, fused, _named(mesh, y, g), arg_sh

  w_rule = "n k" if w_kmajor else "k n"
  rule = f"... m k, {w_rule}{', n' if has_bias else ''} -> ... p n, ... p k"
  fn.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule)
  return fn


@functools.cache
def _rs_function(ndim: int, has_bias: bool, w_kmajor: bool, algorithm: str, m: int):
  def local(x, w, *bias):
    return primitives.matmul_rs(x, w, bias[0] if bias else None, axis_name=None, axis_size=1,
                                algorithm=algorithm, w_kmajor=w_kmajor)

  fn = custom_partitioning(local)

  def shardings(mesh, arg_shapes):
    return _rs_plan(mesh, _spec(arg_shapes[0], ndim), _spec(arg_shapes[1], 2), w_kmajor, m)

  def infer(mesh, arg_shapes, result_shape):
    return NamedSharding(mesh, shardings(mesh, arg_shapes)[4])

  def partition(mesh, arg_shapes, result_shape):
    axes, x, w, b, out = shardings(mesh, arg_shapes)
    arg_sh = _named(mesh, x, w, b)[: 3 if has_bias else 2]
    if axes is None:
      return mesh, local, NamedSharding(mesh, out), arg_sh
    size = math.prod(mesh.shape[a] for a in axes)

    def fused(x, w, *bias):
      return primitives.matmul_rs(x, w, bias[0] if bias else None, axis_name=axes, axis_size=size,
                                  algorithm=algorithm, w_kmajor=w_kmajor)

    return mesh, fused, NamedSharding(mesh, out), arg_sh

  w_rule = "n k" if w_kmajor else "k n"
  rule = f"... m k, {w_rule}{', n' if has_bias else ''} -> ... m n"
  fn.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                   reduction_factors=("k",))
  return fn


def ag_matmul(x, w, bias, *, algorithm: str, w_kmajor: bool = False):
  fn = _ag_function(x.ndim, bias is not None, w_kmajor, algorithm)
  y, gathered = fn(x, w, *(() if bias is None else (bias,)))
  return y, gathered


def matmul_rs(x, w, bias, *, algorithm: str, w_kmajor: bool = False):
  fn = _rs_function(x.ndim, bias is not None, w_kmajor, algorithm, x.shape[-2])
  return fn(x, w, *(() if bias is None else (bias,)))
