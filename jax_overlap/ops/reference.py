"""The numerics the ops' reference decompositions share: the XLA path (algorithm="xla") and the test oracle.

As the GPU algorithms: products accumulate in float32, the bias is added in it, one rounding to the result's
dtype. A reduction rounds each rank's partial to formats.partial(dtype) (float32 for float16: a partial may pass
65504 where the sum does not), exchanges the partials by all-to-all and sums them in float32 in rank order:
bitwise the GPU paths' reduction. XLA's own reduce-scatter rounds at every step, which in bfloat16 fails
Transformer Engine's collective-GEMM tolerance. Float8 products are the dequantized operands' in the form XLA
rewrites into its fp8 GEMM, at the precision that gives its accumulation (Scaling.precision).
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
  """x's last `contract` dims times w's first (w_kmajor: last) `contract` dims, in the accumulator type."""
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
  return lax.dot_general(x, w, dims, preferred_element_type=jnp.float32, out_sharding=out_sharding)


@_accumulated.defjvp
def _accumulated_jvp(dims, out_sharding, primals, tangents):
  # The tangent's products are rounded to the operands' dtype: with JAX's float32 tangent the backward pass would
  # run float32 GEMMs where stock lax.dot_general runs 16-bit ones.
  x, w = primals
  dx, dw = tangents
  dot = functools.partial(lax.dot_general, dimension_numbers=dims, out_sharding=out_sharding)
  return _accumulated(x, w, dims, out_sharding), dot(dx, w).astype(jnp.float32) + dot(x, dw).astype(jnp.float32)


def gathered_matmul(gathered, w, *, w_kmajor: bool = False, gather: int = -2, scales=None):
  """local_matmul of a gathered x whose shards along dim `gather` carry tensor scales of their own: one dot per
  shard keeps each in the form XLA rewrites into its fp8 GEMM (shards of one shared scale take one dot)."""
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
  """psum_scatter(partial, dim, tiled) + bias, the blocks added in rank order, which XLA does not reassociate."""
  size, axis = group_size(axis_name), partial.ndim + dim
  blocks = partial.reshape(*partial.shape[:axis], size, partial.shape[axis] // size, *partial.shape[axis + 1:])
  blocks = lax.all_to_all(blocks, axis_name, axis, axis, tiled=True)
  acc = lax.index_in_dim(blocks, 0, axis, keepdims=False).astype(formats.accumulator(partial.dtype))
  for rank in range(1, size):
    acc = acc + lax.index_in_dim(blocks, rank, axis, keepdims=False).astype(acc.dtype)
  return finish(acc, bias, dtype or partial.dtype)


def all_reduce(partial, axis_name, bias=None, dtype=None):
  """psum(partial) + bias as a reduce-scatter of the flattened partial and an all-gather: a ring all-reduce's
  bytes, and every element what a scatter plan would give it."""
  size, shape = group_size(axis_name), partial.shape
  total = math.prod(shape)
  chunk = -(-total // size)
  flat = jnp.pad(partial.reshape(-1), (0, size * chunk - total))
  if bias is not None:
    start = lax.axis_index(axis_name) * chunk
    bias = bias[(start + jnp.arange(chunk)) % bias.shape[-1]]
  mine = reduce_scatter(flat, axis_name, -1, bias, dtype)
  return lax.all_gather(mine, axis_name, tiled=True)[:total].reshape(shape)


def empty_product(shape, dtype, bias, axes):
  """The bias (or zeros) in the output's shape, varying over `axes` as the product would."""
  out = jnp.zeros(shape, dtype)
  if bias is not None:
    out = out + bias.astype(dtype)
  return out if axes is None else _compat.make_varying(out, axes)
