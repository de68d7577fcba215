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

import jax
import jax.numpy as jnp

from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding

from jax_overlap import primitives, reference
from jax_overlap.sharding_plan import ag_plan, rs_plan, spec_of


def _named(mesh, *specs):
  return tuple(NamedSharding(mesh, s) for s in specs)


@functools.cache
def _ag_function(ndim: int, has_bias: bool, w_kmajor: bool, algorithm: str):
  def local(x, w, *bias):
    return primitives.ag_matmul(x, w, bias[0] if bias else None, axis_name=None, axis_size=1,
                                algorithm=algorithm, w_kmajor=w_kmajor)

  fn = custom_partitioning(local)

  def shardings(mesh, arg_shapes):
    return ag_plan(mesh, spec_of(arg_shapes[0].sharding, ndim), spec_of(arg_shapes[1].sharding, 2), w_kmajor)

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
    return rs_plan(mesh, spec_of(arg_shapes[0].sharding, ndim), spec_of(arg_shapes[1].sharding, 2), w_kmajor, m)

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


# vmap: custom_partitioning has no batching rule, so each global op is a
# custom_vmap whose rule folds a batched x into the leading dims (the ops take
# any) and sends batched weights or bias to the reference product.

def _batch_rule(partitioned, reference_fn, w_kmajor: bool):
  def rule(axis_size, in_batched, x, w, *bias):
    x_batched, w_batched, *bias_batched = in_batched
    if x_batched and not w_batched and not any(bias_batched):
      out = partitioned(x, w, *bias)
      return out, jax.tree.map(lambda _: True, out)
    args = [a if b else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, b in zip((x, w, *bias), in_batched)]
    local = lambda x, w, *b: reference_fn(x, w, b[0] if b else None, axis_name=None, w_kmajor=w_kmajor)
    out = jax.vmap(local)(*args)
    return out, jax.tree.map(lambda _: True, out)
  return rule


@functools.cache
def _ag_vmappable(has_bias: bool, w_kmajor: bool, algorithm: str):
  def partitioned(x, w, *bias):
    return _ag_function(x.ndim, has_bias, w_kmajor, algorithm)(x, w, *bias)

  fn = jax.custom_batching.custom_vmap(partitioned)
  fn.def_vmap(_batch_rule(partitioned, reference.ag_matmul, w_kmajor))
  return fn


@functools.cache
def _rs_vmappable(has_bias: bool, w_kmajor: bool, algorithm: str):
  def partitioned(x, w, *bias):
    return _rs_function(x.ndim, has_bias, w_kmajor, algorithm, x.shape[-2])(x, w, *bias)

  fn = jax.custom_batching.custom_vmap(partitioned)
  fn.def_vmap(_batch_rule(partitioned, reference.matmul_rs, w_kmajor))
  return fn


def ag_matmul(x, w, bias, *, algorithm: str, w_kmajor: bool = False):
  y, gathered = _ag_vmappable(bias is not None, w_kmajor, algorithm)(x, w, *(() if bias is None else (bias,)))
  return y, gathered


def matmul_rs(x, w, bias, *, algorithm: str, w_kmajor: bool = False):
  return _rs_vmappable(bias is not None, w_kmajor, algorithm)(x, w, *(() if bias is None else (bias,)))
