"""ag_matmul, y = all_gather(x) @ w + bias, as one Op; a float8 shard's x_scale travels with it."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_overlap import _sharding, remat
from jax_overlap.integration import autodiff, primitives
from jax_overlap.integration.results import Kind, Results
from jax_overlap.integration.operands import Operands, operands, split_operands
from jax_overlap.ops import reference as ref
from jax_overlap.ops.op import Arguments, Backward, Op, PlanningFigures, Rules, Sharding, XlaPath
from jax_overlap.planning import pipelined
from jax_overlap.quantization.scaling import mode

log = logging.getLogger("jax_overlap")

DUAL = "matmul_rs"

primitive = jex_core.Primitive("jax_overlap_ag_matmul")
primitive.multiple_results = True


def bind(x, w, bias, scales, *, axis_name, axis_size, algorithm, w_kmajor, out_dtype, out_specs=None):
  return tuple(primitive.bind(*operands(x, w, bias, scales), axis_name=axis_name, axis_size=axis_size,
                              algorithm=algorithm, w_kmajor=w_kmajor, has_bias=bias is not None,
                              scaling=mode(scales), out_dtype=out_dtype, out_specs=out_specs))


def abstract_eval(*args, axis_name, axis_size, algorithm, w_kmajor, has_bias, scaling, out_dtype, out_specs):
  del algorithm, axis_name
  x, w, _, x_scale, _ = Operands.of(args, has_bias, scaling)
  *lead, m, k = x.shape
  n = w.shape[:-1] if w_kmajor else w.shape[1:]
  y_spec, g_spec, s_spec = primitives.result_specs(out_specs, 3)
  gathered_shape = (*lead, axis_size * m, k)
  results = (primitives.result_aval(x, (*lead, axis_size * m, *n), y_spec, out_dtype),
             primitives.result_aval(x, gathered_shape, g_spec))
  if scaling is None:
    return results
  shape = scaling.gathered_shape(x_scale.shape, gathered_shape, axis_size)
  return results + (primitives.result_aval(x, shape, s_spec, jnp.float32),)


def as_matrix(*args, w_kmajor, has_bias, scaling, **params):
  x, w, bias, scales = split_operands(args, has_bias, scaling)
  n = w.shape[:-1] if w_kmajor else w.shape[1:]
  w2 = w.reshape(-1, w.shape[-1]) if w_kmajor else w.reshape(w.shape[0], -1)
  y, *rest = bind(x, w2, None if bias is None else bias.reshape(-1), scales, w_kmajor=w_kmajor, **params)
  return (y.reshape(*y.shape[:-1], *n), *rest)


def reference(x, w, bias=None, scales=None, *, axis_name=None, w_kmajor: bool = False, gather: int = -2,
              out_dtype=None):
  gathered, x_scales = _gathered(x, scales, axis_name, gather)
  return _product(gathered, w, bias, x_scales, scales, w_kmajor=w_kmajor, gather=gather, out_dtype=out_dtype)


def _gathered(x, scales, axis_name, gather: int) -> tuple:
  gathered = x if axis_name is None else lax.all_gather(x, axis_name, axis=x.ndim + gather, tiled=True)
  if scales is None:
    return gathered, None
  if axis_name is None:
    return gathered, scales.scaling.of_whole_x(scales.x)
  return gathered, scales.scaling.gather(scales.x, axis_name, gather)


def _product(gathered, w, bias, x_scales, scales, *, w_kmajor: bool, gather: int, out_dtype) -> tuple:
  out_dtype = out_dtype or gathered.dtype
  if scales is None:
    return ref.finish(ref.local_matmul(gathered, w, w_kmajor=w_kmajor), bias, out_dtype), gathered
  acc = ref.gathered_matmul(gathered, w, w_kmajor=w_kmajor, gather=gather,
                            scales=dataclasses.replace(scales, x=x_scales))
  return ref.finish(acc, bias, out_dtype), gathered, x_scales


def global_results(results, scales):
  y, gathered = results[:2]
  if scales is None:
    return y, gathered
  return y, gathered, scales.scaling.of_whole_x(scales.x)


def on_shards(x, w, bias, scales, *, axes, size, algorithm, w_kmajor, out_dtype, axis=-2):
  params = dict(axis_name=axes, axis_size=size, algorithm=algorithm, w_kmajor=w_kmajor, out_dtype=out_dtype)
  if axis == -2:
    return bind(x, w, bias, scales, **params)
  follows = scales is not None and scales.scaling.follows_x
  if follows:
    scales = dataclasses.replace(scales, x=_sharding.fold(scales.x, axis, -1))
  y, gathered, *rest = bind(_sharding.fold(x, axis, -1), w, bias, scales, **params)
  mid = x.shape[x.ndim + axis + 1:-1]
  gathered_shape = (*x.shape[:x.ndim + axis], size * x.shape[axis], *mid)
  n_ndim = w.ndim - 1
  if follows:
    rest = [rest[0].reshape(*gathered_shape, rest[0].shape[-1])]
  return (y.reshape(*gathered_shape, *y.shape[y.ndim - n_ndim:]),
          gathered.reshape(*gathered_shape, x.shape[-1]), *rest)


# Global arrays, x [..., m, K] @ w [K, *n] (or [*n, K]); `gather` is the x dim gathered (default -2):
#   gather  exactly one of w's n dims is sharded, on axes A, and x's gather dim on (*others, *A): gather x over A;
#           y keeps `others` on that dim and A on w's sharded dim.
#   plain   x keeps its sharding but K's, w its n dims' where they do not collide with x's: the local product.
# The Shardy rule "b.. g k, k n.. -> b.. p n.., b.. p q" gives the gathered dim (p) and the gathered K (q) factors of
# their own, so propagation copies no sharding of x onto the results: no plan shards K, and XLA mends a promise the
# result breaks with an "Involuntary full rematerialization".

class Plan(NamedTuple):
  axes: tuple | None
  x: P
  w: P
  bias: P
  y: P
  gathered: P
  why: str

  @property
  def results(self) -> tuple:
    return self.y, self.gathered


def sharding_plan(mesh, x_spec, w_spec, x_shape, w_shape, w_kmajor: bool, gather: int = -2, request=None) -> Plan:
  """The requested y spec settles which of x's batch dims and w's output dims keeps an axis they share."""
  x_spec, w_spec = _sharding.even(mesh, x_spec, x_shape), _sharding.even(mesh, w_spec, w_shape)
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
      return Plan(axes, P(*free, None), _sharding.w_spec([None], n_out, w_kmajor), P(*n_out), P(*kept, *n_out),
                  P(*kept, None), f"gather dim {gather} over {axes}")
    why = f"x's dim {gather} is sharded on {rows or 'nothing'}, not ending with w's output axes {axes}"
  else:
    why = "none of w's output dims is sharded" if not sharded else "more than one of w's output dims is sharded"
  free, n_kept = _sharding.settle(free, n_specs, request)
  return Plan(None, P(*free, None), _sharding.w_spec([None], n_kept, w_kmajor), P(*n_kept), P(*free, *n_kept),
              P(*free, None), why)


def sharding_rule(ndim: int, w_ndim: int, has_bias: bool, scaling, w_kmajor: bool, gather: int) -> tuple[str, tuple]:
  batch = _sharding.factors("b", ndim - 1)
  x_f, out_f = list(batch), list(batch)
  x_f[ndim + gather], out_f[ndim + gather] = "g", "p"
  n = _sharding.factors("n", w_ndim - 1)
  w_f = [*n, "k"] if w_kmajor else ["k", *n]
  scale_f = [] if scaling is None else list(scaling.shardy_factors([*x_f, "k"], w_kmajor)[:2])
  args = [" ".join([*x_f, "k"]), " ".join(w_f)] + ([" ".join(n)] if has_bias else []) + scale_f
  return f"{', '.join(args)} -> {' '.join([*out_f, *n])}, {' '.join([*out_f, 'q'])}", ()


def result_ndim(ndim: int, w_ndim: int) -> int:
  return ndim - 1 + w_ndim - 1


def partitioned(plan: Plan, *, size: int, algorithm: str, w_kmajor: bool, axis: int, has_bias: bool, scaling,
                out_dtype: str):
  def gather_and_multiply(*args):
    x, w, bias, scales = split_operands(args, has_bias, scaling)
    return global_results(on_shards(x, w, bias, scales, axes=plan.axes, size=size, algorithm=algorithm,
                                    w_kmajor=w_kmajor, out_dtype=out_dtype, axis=axis), None)
  return gather_and_multiply


def check_operands(x, w, bias, w_kmajor: bool) -> tuple:
  k_dim, which = (-1, "last") if w_kmajor else (0, "first")
  if w.shape[k_dim] != x.shape[-1]:
    raise ValueError(f"jax_overlap.ag_matmul: w's {which} dim must equal x's last dim (K = {x.shape[-1]}"
                     f"{', w_kmajor=True' if w_kmajor else ''}), got w of shape {w.shape}")
  n = tuple(w.shape[:-1] if w_kmajor else w.shape[1:])
  if bias is not None and tuple(bias.shape) != n:
    raise ValueError(f"jax_overlap.ag_matmul: bias must have shape {n} to match w's columns, got {bias.shape}")
  return (*x.shape[:-1], *n)


def grouped(gather: int, x, out_shape: tuple, size: int, axis_name) -> tuple:
  del axis_name
  out_shape = list(out_shape)
  out_shape[x.ndim + gather] *= size
  return gather, tuple(out_shape)


def empty(x, w, bias, scales, call, out_shape) -> tuple:
  del w
  gathered_shape = list(x.shape)
  gathered_shape[call.axis] *= call.size
  y = ref.empty_product(out_shape, call.out_dtype, bias, call.axes)
  if 0 in x.shape:
    gathered = jnp.zeros(gathered_shape, x.dtype)
  elif call.axes is None:
    gathered = x
  else:
    gathered = lax.all_gather(x, call.axes, axis=x.ndim + call.axis, tiled=True)
  if scales is None:
    return y, gathered
  if call.axes is None:
    return y, gathered, scales.scaling.of_whole_x(scales.x)
  return y, gathered, scales.scaling.gather(scales.x, call.axes, call.axis)


def xla_only(call) -> bool:
  del call
  return False


def plain(x, w, bias, scales, call) -> tuple:
  """Inside shard_map the reference; on global arrays the dot, typed on an Explicit mesh with the plan's layouts."""
  log.debug("jax_overlap.ag_matmul: XLA path (algorithm='xla', as JAX ops)")
  if call.axes is not None:
    gathered, x_scales = _gathered(x, scales, call.axes, call.axis)
    return _product(remat.tag(gathered, remat.AG_GATHERED), w, bias, x_scales, scales, w_kmajor=call.w_kmajor,
                    gather=call.axis, out_dtype=call.out_dtype)
  mesh = _sharding.explicit_mesh(jax.typeof(x))
  if mesh is None:
    return global_results(reference(x, w, bias, scales, w_kmajor=call.w_kmajor, out_dtype=call.out_dtype), scales)
  p = sharding_plan(mesh, _sharding.spec_of(jax.typeof(x).sharding, x.ndim),
                    _sharding.spec_of(jax.typeof(w).sharding, w.ndim), x.shape, w.shape, call.w_kmajor, call.axis)
  y = ref.local_matmul(x, w, w_kmajor=call.w_kmajor, scales=scales, out_sharding=NamedSharding(mesh, p.y))
  return global_results((ref.finish(y, _sharding.resharded(bias, mesh, p.bias), call.out_dtype), x), scales)


def residual(x, results):
  return remat.tag(results[1], remat.AG_GATHERED)


def backward(call, residuals, cotangents, dual):
  """dx = RS(dy @ W^T) by `dual`, dW = gathered^T @ dy: no second gather."""
  gathered, w, bias, (x_layout, w_layout, bias_layout) = residuals
  dy, *rest = cotangents
  dx = dual(dy, w, None, None, call.dual(DUAL, call.axis if call.axes else None,
                                         autodiff.request(x_layout, gathered.ndim)))
  if rest:  # the gathered x's cotangent: the all-gather's transpose
    (dgathered,) = rest
    dx = dx + (dgathered if call.axes is None else ref.reduce_scatter(dgathered, call.axes, call.axis))
  return (autodiff.like(dx, x_layout), autodiff.weight_grad(gathered, dy, 1, w_layout, call.w_kmajor, w.dtype),
          autodiff.bias_grad(dy, bias, bias_layout))


def eligible(rows: int, world: int) -> str | None:
  del rows, world
  return None


def chunk_rows(rows: int, world: int) -> int:
  del world
  return rows


def chunk_bytes(rows: int, k: int, n: int, world: int, itemsize: int) -> int:
  del n, world
  return rows * k * itemsize


def stage_candidates(world: int) -> list:
  """The own shard alone first (it is here at once), then any split of the peers'."""
  return [(1,) + rest for rest in pipelined.compositions(world - 1)] if world > 1 else [(1,)]


def check_stages(stages: tuple, text: str) -> None:
  if stages[0] != 1:
    raise ValueError(f"stage plan {text!r}: ag_matmul's first stage is its own shard alone (1)")


def pipelined_us(stages: tuple, f) -> float:
  """Stage j starts once its last shard has arrived (publish, then one pull per ring position in order); copies
  on the SMs delay the GEMMs instead, less the share the GEMMs' last waves hide."""
  pull = f.chunk_bytes / f.link_bytes_per_us
  publish = f.chunk_bytes / f.local_bytes_per_us
  end = (publish if f.publish_on_sms else 0.0) + pipelined.gemm_us(f, stages[0])
  position = stages[0]
  for size in stages[1:]:
    if f.pulls_on_sms:
      end += (1 - f.sm_pull_hidden) * size * pull
    else:
      end = max(end, publish + (position + size - 1) * pull)
    end += f.stage_overhead_us + pipelined.gemm_us(f, size)
    position += size
  return end + f.call_overhead_us


def fused_traffic(rows: int, k: int, n: int, world: int, itemsize: int) -> tuple:
  pull_bytes = (world - 1) * rows * k * itemsize
  return pull_bytes, pull_bytes, 2.0 * world * rows * n * k


def fused_chunk_k(tile, k: int) -> int:
  """About 8 ready flags along K: a tile starts once its first chunk lands, without a flag wait every k-tile."""
  return tile.bk * max(1, math.ceil(math.ceil(k / tile.bk) / 8))


def fused_units(rows: int, k: int, n: int, world: int, tile, chunk_k: int) -> int:
  del n, world
  return math.ceil(rows / tile.bm) * math.ceil(k / chunk_k)


OP = Op(
    name="ag_matmul", dual=DUAL,
    results=Results((Kind.PRODUCT, Kind.GATHERED, Kind.GATHERED_SCALES),
                    (remat.AG_OUTPUT, remat.AG_GATHERED, remat.AG_GATHERED_SCALES)),
    rules=Rules(primitive, bind, abstract_eval, as_matrix),
    xla=XlaPath(reference, plain, xla_only),
    on_shards=on_shards,
    sharding=Sharding(Plan, sharding_plan, sharding_rule, result_ndim, partitioned, global_results),
    planning=PlanningFigures(("pipelined", "fused"), eligible, chunk_rows, chunk_bytes, False, stage_candidates,
                             check_stages, pipelined_us, "fetchers", fused_traffic, fused_chunk_k, fused_units),
    backward=Backward(residual, backward),
    arguments=Arguments(check_operands, "gather_axis", True, -2, False, grouped, empty))
