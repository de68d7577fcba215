"""The numerics every op's reference decomposition shares (ops/<op>.py reference): the XLA path (the fallback,
algorithm="xla") and the test oracle.

`w_kmajor` means w is stored with the contraction last ([*n, K], [N, *k]): the
backward passes use it so that w is never transposed in memory.

Numerics follow the GPU algorithms: products accumulate in float32 (float64 for
float64), the bias is added in that type and the sum is rounded once to x's
dtype. A reduction over the group rounds each rank's partial product to
formats.partial(x's dtype) (what the kernels exchange: float32 for float16, whose
65504 a partial may pass where the sum does not), moves the partials with an
all-to-all (the bytes of a reduce-scatter), and sums them locally in float32 in
rank order, adding the bias once, with one rounding: bitwise the GPU paths'
reduction of the same partials. XLA's own reduce-scatter would sum the rounded
partials in x's dtype, rounding at every step: with bfloat16 that failed
Transformer Engine's collective-GEMM tolerance (rtol 1e-2, atol 0.125) on 5 of
1M elements.

Float8 operands come with their Scales and the result in out_dtype, which
takes x's dtype's place above. Their
products are the dequantized operands' (quantization/numerics.py), one dot per
gathered shard of tensor-scaled x (rows of different scales), the form XLA
rewrites into its fp8 GEMM, at the precision that gives its accumulation
(Scaling.precision: HIGHEST promotes the sums to float32 as the GPU paths do,
DEFAULT is XLA's fast accumulation).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jax_overlap import _compat
from jax_overlap.quantization import formats, numerics


def local_matmul(x, w, *, w_kmajor: bool = False, contract: int = 1, scales=None, out_sharding=None):
  """x's last `contract` dims times w's first (or, w_kmajor, last) `contract` dims, in the accumulator type.

  scales: the Scales of float8 operands, or None.
  out_sharding: the result's layout, for global arrays on a mesh with Explicit axes.
  """
  precision = None
  if scales is not None:
    x, w = numerics.dequantized(x, scales.x), numerics.dequantized(w, scales.w)
    precision = scales.scaling.precision
  x_dims = tuple(range(x.ndim - contract, x.ndim))
  w_dims = tuple(range(w.ndim - contract, w.ndim)) if w_kmajor else tuple(range(contract))
  dims = ((x_dims, w_dims), ((), ()))
  if scales is None and x.dtype.itemsize == 2:
    return _accumulated(x, w, dims, out_sharding)
  return lax.dot_general(x, w, dims, precision=precision, preferred_element_type=formats.accumulator(x.dtype),
                         out_sharding=out_sharding)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _accumulated(x, w, dims, out_sharding):
  """A 16-bit product in float32."""
  return lax.dot_general(x, w, dims, preferred_element_type=jnp.float32, out_sharding=out_sharding)


@_accumulated.defjvp
def _accumulated_jvp(dims, out_sharding, primals, tangents):
  # The tangent's products are rounded to the operands' dtype (their GEMMs still accumulate in float32). JAX's own
  # tangent would be float32, and its transpose, the backward pass, would multiply a float32 cotangent by a 16-bit
  # operand: XLA converts both to float32 and runs float32 GEMMs, where stock lax.dot_general runs 16-bit ones.
  x, w = primals
  dx, dw = tangents
  dot = functools.partial(lax.dot_general, dimension_numbers=dims, out_sharding=out_sharding)
  return _accumulated(x, w, dims, out_sharding), dot(dx, w).astype(jnp.float32) + dot(x, dw).astype(jnp.float32)


def gathered_matmul(gathered, w, *, w_kmajor: bool = False, gather: int = -2, scales=None):
  """local_matmul of a gathered x whose shards along dim `gather` (negative) carry scales of their own.

  scales: the Scales of the gathered x (gathered_scales: tensor scales (T,), one per shard in gathered order;
  block scales gathered with x, which take one dot) and w, or None. One dot per shard keeps each in the form XLA
  rewrites into its fp8 GEMM; the products are joined along the gathered dim of the result (x's leading dims
  come first in it). Shards that share one scale (Scaling.x_shared) take one dot.
  """
  if scales is None or scales.scaling.follows_x:
    return local_matmul(gathered, w, w_kmajor=w_kmajor, scales=scales)
  if scales.scaling.x_shared:
    return local_matmul(gathered, w, w_kmajor=w_kmajor, scales=dataclasses.replace(scales, x=scales.x[0]))
  axis = gathered.ndim + gather
  shards = scales.x.shape[0]
  rows = gathered.shape[axis] // shards
  products = [local_matmul(lax.slice_in_dim(gathered, s * rows, (s + 1) * rows, axis=axis), w, w_kmajor=w_kmajor,
                           scales=dataclasses.replace(scales, x=scales.x[s])) for s in range(shards)]
  return products[0] if shards == 1 else lax.concatenate(products, axis)


def finish(acc, bias, dtype):
  """acc (+ bias in the accumulator type), rounded once to dtype."""
  if bias is not None:
    acc = acc.astype(formats.accumulator(dtype)) + bias.astype(formats.accumulator(dtype))
  return acc.astype(dtype)


def group_size(axis_name) -> int:
  names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
  return math.prod(lax.axis_size(a) for a in names)


def reduce_scatter(partial, axis_name, dim: int, bias=None, dtype=None):
  """psum_scatter(partial, dim, tiled) + bias in `dtype` (None: partial's), summed as the GPU algorithms do
  (module docstring): the blocks added in rank order, ((p0 + p1) + p2) + ..., which XLA does not reassociate.
  dim is negative."""
  size, axis = group_size(axis_name), partial.ndim + dim
  blocks = partial.reshape(*partial.shape[:axis], size, partial.shape[axis] // size, *partial.shape[axis + 1:])
  blocks = lax.all_to_all(blocks, axis_name, axis, axis, tiled=True)
  acc = lax.index_in_dim(blocks, 0, axis, keepdims=False).astype(formats.accumulator(partial.dtype))
  for rank in range(1, size):
    acc = acc + lax.index_in_dim(blocks, rank, axis, keepdims=False).astype(acc.dtype)
  return finish(acc, bias, dtype or partial.dtype)


def all_reduce(partial, axis_name, bias=None, dtype=None):
  """psum(partial) + bias with reduce_scatter's numerics: the all-reduce as a reduce-scatter of the flattened
  partial (padded to a multiple of the group) and an all-gather of the rounded sums, so the same bytes as a
  ring all-reduce cross the links, and every element equals what a scatter plan would give it."""
  size, shape = group_size(axis_name), partial.shape
  total = math.prod(shape)
  chunk = -(-total // size)
  flat = jnp.pad(partial.reshape(-1), (0, size * chunk - total))
  if bias is not None:  # this rank's elements of the flattened output, and the bias column of each
    start = lax.axis_index(axis_name) * chunk
    bias = bias[(start + jnp.arange(chunk)) % bias.shape[-1]]
  mine = reduce_scatter(flat, axis_name, -1, bias, dtype)
  return lax.all_gather(mine, axis_name, tiled=True)[:total].reshape(shape)


def empty_product(shape, dtype, bias, axes):
  """The product of a call with an empty dim: the bias (or zeros) in the output's shape, varying over the group's
  axes inside shard_map as the product would."""
  out = jnp.zeros(shape, dtype)
  if bias is not None:
    out = out + bias.astype(dtype)
  return out if axes is None else _compat.make_varying(out, axes)
