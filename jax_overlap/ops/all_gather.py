"""all_gather inside shard_map on the symmetric workspace (the runtime's end-to-end test), else lax.all_gather. Not
differentiable, no global-array mode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.interpreters import mlir

from jax_overlap.integration import lowering, primitives

NAME = "all_gather"

primitive = jex_core.Primitive("jax_overlap_all_gather")


def bind(x, *, axis_name, axis_size):
  return primitive.bind(x, axis_name=axis_name, axis_size=axis_size)


def abstract_eval(x, *, axis_name, axis_size):
  del axis_name
  *lead, m, c = x.shape
  return x.update(shape=(*lead, axis_size * m, c))


def _gather_batch_rule(args, dims, *, axis_name, axis_size):
  (x,), (dx,) = args, dims
  return bind(jnp.moveaxis(x, dx, 0), axis_name=axis_name, axis_size=axis_size), 0


def _gather_default_lowering(ctx, x, *, axis_name, axis_size):
  del axis_size
  fn = lambda v: jax.lax.all_gather(v, axis_name, axis=v.ndim - 2, tiled=True)
  return mlir.lower_fun(fn, multiple_results=False)(ctx, x)


def _gather_gpu_lowering(ctx, x, *, axis_name, axis_size):
  out = lowering.gather_rule(ctx, x, axis_name=axis_name, axis_size=axis_size)
  return _gather_default_lowering(ctx, x, axis_name=axis_name, axis_size=axis_size) if out is None else out


def register() -> None:
  primitives.register_rules(primitive, abstract_eval, _gather_batch_rule, _gather_default_lowering,
                            _gather_gpu_lowering)
