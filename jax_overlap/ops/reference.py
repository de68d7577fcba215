"""The numerics of the ops' XLA path and test oracle, as the GPU algorithms': float32 accumulation and bias, one
rounding. A reduction exchanges each rank's partial (formats.partial) by all-to-all and sums in float32 in rank
order, bitwise the GPU's: XLA's own reduce-scatter rounds every step, which in bfloat16 fails Transformer Engine's
collective-GEMM tolerance. Float8 products are dot_generals XLA rewrites into its fp8 GEMM (Scaling.precision)."""

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
  """x's last `contract` dims times w's first (w_kmajor: last), in the accumulator type."""
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
  # Tangent products in the operands' dtype: JAX's float32 tangent would make the backward's GEMMs float32 where
  # stock lax.dot_general's are 16-bit.
  x, w = primals
  dx, dw = tangents
  dot = functools.partial(lax.dot_general, dimension_numbers=dims, out_sharding=out_sharding)
  return _accumulated(x, w, dims, out_sharding), dot(dx, w).astype(jnp.float32) + dot(x, dw).astype(jnp.float32)


def gathered_matmul(gathered, w, *, w_kmajor: bool = False, gather: int = -2, scales=None):
  """local_matmul of a gathered x of per-shard tensor scales: a dot per shard (one if shared), each XLA's fp8 GEMM."""
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
  if bias is not None:
    acc = acc.astype(formats.accumulator(dtype)) + bias.astype(formats.accumulator(dtype))
  return acc.astype(dtype)


def group_size(axis_name) -> int:
  names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
  return math.prod(lax.axis_size(a) for a in names)


def reduce_scatter(partial, axis_name, dim: int, bias=None, dtype=None):
  """psum_scatter(partial, dim, tiled) + bias, added in rank order (XLA does not reassociate it)."""
  size, axis = group_size(axis_name), partial.ndim + dim
  blocks = partial.reshape(*partial.shape[:axis], size, partial.shape[axis] // size, *partial.shape[axis + 1:])
  blocks = lax.all_to_all(blocks, axis_name, axis, axis, tiled=True)
  acc = lax.index_in_dim(blocks, 0, axis, keepdims=False).astype(formats.accumulator(partial.dtype))
  for rank in range(1, size):
    acc = acc + lax.index_in_dim(blocks, rank, axis, keepdims=False).astype(acc.dtype)
  return finish(acc, bias, dtype or partial.dtype)


def all_reduce(partial, axis_name, bias=None, dtype=None):
  """psum(partial) + bias as reduce-scatter and all-gather: a ring all-reduce's bytes, each sum a scatter plan's."""
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
  out = jnp.zeros(shape, dtype)
  if bias is not None:
    out = out + bias.astype(dtype)
  return out if axes is None else _compat.make_varying(out, axes)
