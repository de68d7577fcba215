"""matmul_rs, z = reduce_scatter(x @ w) + bias, as one Op; each rank's partial is staged in formats.partial."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import NamedTuple

import jax
from jax import lax
from jax.extend import core as jex_core
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_overlap import _sharding, remat
from jax_overlap.integration import autodiff, primitives
from jax_overlap.integration.results import Kind, Results
from jax_overlap.integration.operands import operands, split_operands
from jax_overlap.ops import reference as ref
from jax_overlap.ops.op import Arguments, Backward, Op, PlanningFigures, Rules, Sharding, XlaPath
from jax_overlap.planning import pipelined
from jax_overlap.quantization import formats
from jax_overlap.quantization.scaling import mode

log = logging.getLogger("jax_overlap")

DUAL = "ag_matmul"

primitive = jex_core.Primitive("jax_overlap_matmul_rs")


def bind(x, w, bias, scales, *, axis_name, axis_size, algorithm, w_kmajor, out_dtype, out_specs=None):
  return primitive.bind(*operands(x, w, bias, scales), axis_name=axis_name, axis_size=axis_size,
                        algorithm=algorithm, w_kmajor=w_kmajor, has_bias=bias is not None, scaling=mode(scales),
                        out_dtype=out_dtype, out_specs=out_specs)


def abstract_eval(x, w, *rest, axis_name, axis_size, algorithm, w_kmajor, has_bias, scaling, out_dtype, out_specs):
  del algorithm, rest, axis_name, has_bias, scaling
  contract = w.ndim - 1
  *lead, m = x.shape[:x.ndim - contract]
  n = w.shape[0] if w_kmajor else w.shape[-1]
  (z_spec,) = primitives.result_specs(out_specs, 1)
  return primitives.result_aval(x, (*lead, m // axis_size, n), z_spec, out_dtype)


def as_matrix(*args, w_kmajor, has_bias, scaling, **params):
  x, w, bias, scales = split_operands(args, has_bias, scaling)
  contract = w.ndim - 1
  k = math.prod(w.shape[1:] if w_kmajor else w.shape[:-1])
  w2 = w.reshape(w.shape[0], k) if w_kmajor else w.reshape(k, w.shape[-1])
  x2 = x.reshape(*x.shape[:x.ndim - contract], k)
  return bind(x2, w2, bias, scales, w_kmajor=w_kmajor, **params)


def reference(x, w, bias=None, scales=None, *, axis_name=None, w_kmajor: bool = False, scatter: int = -2,
              out_dtype=None):
  """The XLA decomposition, summed as the GPU algorithms sum; axis_name None: the local product."""
  out_dtype = out_dtype or x.dtype
  contract = w.ndim - 1
  acc = ref.local_matmul(x, w, w_kmajor=w_kmajor, contract=contract, scales=scales)
  if axis_name is None:
    return ref.finish(acc, bias, out_dtype)
  if scatter == -1 and bias is not None:
    n = acc.shape[-1] // ref.group_size(axis_name)
    bias = lax.dynamic_slice_in_dim(bias, lax.axis_index(axis_name) * n, n)
  return ref.reduce_scatter(acc.astype(formats.partial(out_dtype)), axis_name, scatter, bias, out_dtype)


def reference_all_reduce(x, w, bias=None, scales=None, *, axis_name, w_kmajor: bool = False, out_dtype=None):
  out_dtype = out_dtype or x.dtype
  acc = ref.local_matmul(x, w, w_kmajor=w_kmajor, contract=w.ndim - 1, scales=scales)
  return ref.all_reduce(acc.astype(formats.partial(out_dtype)), axis_name, bias, out_dtype)


def global_results(results, scales):
  del scales
  return results


def on_shards(x, w, bias, scales, *, axes, size, algorithm, w_kmajor, out_dtype, axis=-2):
  contract = w.ndim - 1
  if axis == -1:
    log.debug("jax_overlap.matmul_rs: XLA path (scatter over the output columns; the fused kernels scatter rows)")
    return reference(x, w, bias, scales, axis_name=axes, w_kmajor=w_kmajor, scatter=-1, out_dtype=out_dtype)
  params = dict(axis_name=axes, axis_size=size, algorithm=algorithm, w_kmajor=w_kmajor, out_dtype=out_dtype)
  if axis == -2:
    return bind(x, w, bias, scales, **params)
  out_lead = x.shape[:x.ndim - contract]
  if scales is not None and scales.scaling.follows_x:
    scales = dataclasses.replace(scales, x=_sharding.fold(scales.x, axis, -1))
  z = bind(_sharding.fold(x, axis + 1 - contract, -contract), w, bias, scales, **params)
  start = len(out_lead) + axis + 1
  return z.reshape(*out_lead[:start], out_lead[start] // size, *out_lead[start + 1:], z.shape[-1])


# Global arrays, x [..., M, *k] @ w [*k, N] (or [N, *k]):
#   scatter  x's and w's k dims sharded alike, on axes A: reduce over A onto one output dim (scatter_axis, else
#            the dim the requested output sharding puts A on, else the rows), which keeps its own axes as major.
#   reduce   as scatter, but the request has A nowhere, or the dim is no multiple of its axes' size: all-reduce.
#   plain    the contraction not sharded alike: K unsharded (XLA gathers it), a local product.

class Plan(NamedTuple):
  axes: tuple | None
  scatter: int | None  # None: an all-reduce
  x: P
  w: P
  bias: P
  out: P
  why: str

  @property
  def results(self) -> tuple:
    return (self.out,)


def sharding_plan(mesh, x_spec, w_spec, x_shape, w_shape, w_kmajor: bool, scatter: int | None = None,
                  request=None) -> Plan:
  x_spec, w_spec = _sharding.even(mesh, x_spec, x_shape), _sharding.even(mesh, w_spec, w_shape)
  contract = len(w_shape) - 1
  free, xk = x_spec[:len(x_spec) - contract], x_spec[len(x_spec) - contract:]
  wk, n_spec = (w_spec[1:], w_spec[0]) if w_kmajor else (w_spec[:-1], w_spec[-1])
  free, (n_kept,) = _sharding.settle(free, [n_spec], request)
  axes = tuple(a for s in xk for a in (s or ()))
  if not axes or xk != wk:
    none_k = [None] * contract
    why = "the contraction is not sharded" if not axes else f"x's contraction dims {xk} and w's {wk} differ"
    return Plan(None, None, P(*free, *none_k), _sharding.w_spec(none_k, [n_kept], w_kmajor), P(n_kept),
                P(*free, n_kept), why)
  out = [*free, n_kept]
  x_sh, w_sh = P(*free, *xk), _sharding.w_spec(wk, [n_kept], w_kmajor)
  dim = _scatter_dim(out, axes, scatter, request)
  if dim is None:
    return Plan(axes, None, x_sh, w_sh, P(n_kept), P(*out), f"all-reduce over {axes}: the requested output "
                f"sharding {request} does not shard over them")
  out_shape = (*x_shape[:len(x_shape) - contract], w_shape[0] if w_kmajor else w_shape[-1])
  on_dim = (*(out[dim] or ()), *axes)
  if out_shape[dim] % _sharding.size(mesh, on_dim):
    return Plan(axes, None, x_sh, w_sh, P(n_kept), P(*out), f"all-reduce over {axes}: output dim "
                f"{dim - len(out)} ({out_shape[dim]}) is not a multiple of the size of {on_dim}")
  out[dim] = on_dim
  bias = P(on_dim) if dim == len(out) - 1 else P(n_kept)
  return Plan(axes, dim - len(out), x_sh, w_sh, bias, P(*out), f"reduce-scatter over {axes} onto dim "
              f"{dim - len(out)}")


def _scatter_dim(out, axes, scatter, request) -> int | None:
  if scatter is not None:
    return len(out) + scatter
  if request is None:
    return len(out) - 2
  for d, s in enumerate(request):
    if s and len(s) >= len(axes) and tuple(s[len(s) - len(axes):]) == axes:
      return d
  return None


def sharding_rule(ndim: int, w_ndim: int, has_bias: bool, scaling, w_kmajor: bool, scatter) -> tuple[str, tuple]:
  del scatter
  contract = w_ndim - 1
  batch, k = _sharding.factors("b", result_ndim(ndim, w_ndim) - 1), _sharding.factors("k", contract)
  w_f = ["n", *k] if w_kmajor else [*k, "n"]
  scale_f, reduced = [], tuple(k)
  if scaling is not None:
    x_scale_f, w_scale_f, k_blocks = scaling.shardy_factors([*batch, *k], w_kmajor)
    scale_f, reduced = [x_scale_f, w_scale_f], (*k, *k_blocks)
  args = [" ".join([*batch, *k]), " ".join(w_f)] + (["n"] if has_bias else []) + scale_f
  return f"{', '.join(args)} -> {' '.join([*batch, 'n'])}", reduced


def result_ndim(ndim: int, w_ndim: int) -> int:
  return ndim - (w_ndim - 1) + 1


def partitioned(plan: Plan, *, size: int, algorithm: str, w_kmajor: bool, axis, has_bias: bool, scaling,
                out_dtype: str):
  del axis
  if plan.scatter is None:
    def multiply_and_reduce(*args):
      x, w, bias, scales = split_operands(args, has_bias, scaling)
      return reference_all_reduce(x, w, bias, scales, axis_name=plan.axes, w_kmajor=w_kmajor, out_dtype=out_dtype)
    return multiply_and_reduce

  def multiply_and_scatter(*args):
    x, w, bias, scales = split_operands(args, has_bias, scaling)
    return on_shards(x, w, bias, scales, axes=plan.axes, size=size, algorithm=algorithm, w_kmajor=w_kmajor,
                     out_dtype=out_dtype, axis=plan.scatter)
  return multiply_and_scatter


def check_operands(x, w, bias, w_kmajor: bool) -> tuple:
  k = tuple(w.shape[1:] if w_kmajor else w.shape[:-1])
  if x.ndim < len(k) + 1:
    raise ValueError(f"jax_overlap.matmul_rs: x must have rank >= {len(k) + 1} (rows and w's {len(k)} contracted "
                     f"dims {k}), got shape {x.shape}")
  if tuple(x.shape[x.ndim - len(k):]) != k:
    if len(k) == 1:
      which = "last" if w_kmajor else "first"
      raise ValueError(f"jax_overlap.matmul_rs: w's {which} dim must equal x's last dim (k = {x.shape[-1]}"
                       f"{', w_kmajor=True' if w_kmajor else ''}), got w of shape {w.shape}")
    which = "trailing" if w_kmajor else "leading"
    raise ValueError(f"jax_overlap.matmul_rs: w's {which} dims {k} must equal x's trailing dims, got x of shape "
                     f"{x.shape}")
  n = w.shape[0] if w_kmajor else w.shape[-1]
  if bias is not None and tuple(bias.shape) != (n,):
    raise ValueError(f"jax_overlap.matmul_rs: bias must have shape ({n},) to match w's columns, got {bias.shape}")
  return (*x.shape[:x.ndim - len(k)], n)


def grouped(scatter, x, out_shape: tuple, size: int, axis_name) -> tuple:
  del x
  scatter = -2 if scatter is None else scatter
  out_shape = list(out_shape)
  if out_shape[scatter] % size:
    what = "x's rows" if scatter == -2 else f"the output's dim {scatter}"
    raise ValueError(f"jax_overlap.matmul_rs: {what} ({out_shape[scatter]}) must be divisible by the size of axis "
                     f"{axis_name!r} ({size})")
  out_shape[scatter] //= size
  return scatter, tuple(out_shape)


def empty(x, w, bias, scales, call, out_shape) -> tuple:
  del x, w, scales
  if call.axes is not None and call.axis == -1 and bias is not None:
    bias = lax.dynamic_slice_in_dim(bias, lax.axis_index(call.axes) * out_shape[-1], out_shape[-1])
  return (ref.empty_product(out_shape, call.out_dtype, bias, call.axes),)


def xla_only(call) -> bool:
  return call.axes is not None and call.axis == -1


def plain(x, w, bias, scales, call):
  log.debug("jax_overlap.matmul_rs: XLA path (%s, as JAX ops)", "algorithm='xla'" if call.algorithm == "xla" else
            "a scatter over the output columns; the GPU algorithms scatter rows")
  params = dict(w_kmajor=call.w_kmajor, out_dtype=call.out_dtype)
  if call.axes is not None:
    return reference(x, w, bias, scales, axis_name=call.axes, scatter=call.axis, **params)
  mesh = _sharding.explicit_mesh(jax.typeof(x))
  if mesh is None:
    return reference(x, w, bias, scales, **params)
  p = sharding_plan(mesh, _sharding.spec_of(jax.typeof(x).sharding, x.ndim),
                    _sharding.spec_of(jax.typeof(w).sharding, w.ndim), x.shape, w.shape, call.w_kmajor, call.axis,
                    call.request)
  z = ref.local_matmul(x, w, w_kmajor=call.w_kmajor, contract=w.ndim - 1, scales=scales,
                            out_sharding=NamedSharding(mesh, p.out))
  return ref.finish(z, _sharding.resharded(bias, mesh, p.bias), call.out_dtype)


def residual(x, results):
  del results
  return x


def backward(call, residuals, cotangents, dual):
  """(dx, AG(dz)) by `dual`, dW = x^T @ AG(dz)."""
  x, w, bias, (x_layout, w_layout, bias_layout) = residuals
  (dz,) = cotangents
  # After a scatter of the columns no dim of dz matches w's output axes: the plain plan gathers dz through XLA.
  gather = -2 if call.axis in (None, -1) else call.axis
  dx, dz_gathered = dual(dz, w, None, None, call.dual(DUAL, gather, outputs=2))
  return (autodiff.like(dx, x_layout),
          autodiff.weight_grad(x, dz_gathered, w.ndim - 1, w_layout, call.w_kmajor, w.dtype),
          autodiff.bias_grad(dz, bias, bias_layout))


def eligible(rows: int, world: int) -> str | None:
  if rows % world:
    return f"rows={rows} not divisible by the group size {world}"
  return None


def chunk_rows(rows: int, world: int) -> int:
  return rows // world


def chunk_bytes(rows: int, k: int, n: int, world: int, itemsize: int) -> int:
  del k
  return rows // world * n * itemsize


def stage_candidates(world: int) -> list:
  return list(pipelined.compositions(world))


def check_stages(stages: tuple, text: str) -> None:
  del stages, text


def pipelined_us(stages: tuple, f) -> float:
  """The GEMMs back to back; peers run the same schedule, so the peer at ring distance i has my block ready when
  its stage holding position i - 1 ends; then the reduction."""
  world = sum(stages)
  ready, t = [], 0.0
  for size in stages:
    t += f.stage_overhead_us + pipelined.gemm_us(f, size)
    ready += [t] * size
  pull, pulled = f.chunk_bytes / f.link_bytes_per_us, 0.0
  if f.pulls_on_sms:
    pulled = t + (1 - f.sm_pull_hidden) * (world - 1) * pull
  else:
    for i in range(1, world):
      pulled = max(pulled, ready[i - 1] + f.stage_overhead_us) + pull
  reduce = f.reduce_us
  if reduce is None:  # a copy moves each byte twice (read and write); the reduction reads world blocks, writes one
    reduce = (world + 1) * f.chunk_bytes / (2 * f.local_bytes_per_us)
  return max(t, pulled) + reduce + f.call_overhead_us


def fused_traffic(rows: int, k: int, n: int, world: int, itemsize: int) -> tuple:
  block = rows // world * n * itemsize
  return world * block, (world - 1) * block, 2.0 * rows * n * k


def fused_chunk_k(tile, k: int) -> int:
  """No ready flags along K: partials are staged whole."""
  del tile, k
  return 0


def fused_units(rows: int, k: int, n: int, world: int, tile, chunk_k: int) -> int:
  del k, chunk_k
  return math.ceil(rows // world / tile.bm) * math.ceil(n / tile.bn)


OP = Op(
    name="matmul_rs", dual=DUAL,
    results=Results((Kind.PRODUCT,), (remat.RS_OUTPUT,)),
    rules=Rules(primitive, bind, abstract_eval, as_matrix),
    xla=XlaPath(reference, plain, xla_only),
    on_shards=on_shards,
    sharding=Sharding(Plan, sharding_plan, sharding_rule, result_ndim, partitioned, global_results),
    planning=PlanningFigures(("pipelined", "fused"), eligible, chunk_rows, chunk_bytes, True, stage_candidates,
                             check_stages, pipelined_us, "reducers", fused_traffic, fused_chunk_k, fused_units),
    backward=Backward(residual, backward),
    arguments=Arguments(check_operands, "scatter_axis", False, -1, True, grouped, empty))
