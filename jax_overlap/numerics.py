"""The numerics every op's reference decomposition shares (ops/<op>.py reference): the XLA path (the
fallback, algorithm="xla") and the test oracle.

`w_kmajor` means w is stored with the contraction last ([*n, K], [N, *k]): the
backward passes use it so that w is never transposed in memory.

Numerics follow the GPU algorithms: products accumulate in float32 (float64 for
float64), the bias is added in that type and the sum is rounded once to x's
dtype. A reduction over the group rounds each rank's partial product to x's
dtype (what the kernels exchange), moves the partials with an all-to-all (the
bytes of a reduce-scatter), and sums them locally in float32 in rank order,
adding the bias once, with one rounding: bitwise the GPU paths' reduction of the
same partials. XLA's own reduce-scatter would sum the rounded partials in x's
dtype, rounding at every step: with bfloat16 that failed Transformer Engine's
collective-GEMM tolerance (rtol 1e-2, atol 0.125) on 5 of 1M elements.

Float8 operands come with float32 scales (an operand's value is
x.astype(float32) * scale) and the result in out_dtype, which takes x's dtype's
place above: partials are staged and rounded in it. The products are written
in the form XLA rewrites into its own fp8 GEMM (cuBLASLt's on NVIDIA): each
operand converted to float32 and multiplied by its scalar scale, into one dot
with float32 results. Dequantizing to bfloat16 instead is not rewritten and
runs at bfloat16 speed (1355-1539 us against 778 us at 16384x3584x8192 on an
H200, jax 0.11.2); per-row scales are not rewritten either, so rows of
different scales (ag_matmul's gathered shards) take one dot each. Block
scales (BLOCK) are written the same way, each operand times its scales
repeated over their blocks; no fp8 GEMM of XLA's takes them, so that dot runs
in float32 (benchmarks/bench_fp8.py times it).

The quantization the fp8 layers apply (linear.py) is here too: current
scaling, a power-of-two scale from the amax, so that rescaling an fp8 value by
a ratio of two scales is exact (autodiff.py folds per-shard scales that way).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax


def accumulator(dtype):
  """The type products and sums accumulate in: float32, or float64 for float64 operands."""
  return jnp.promote_types(dtype, jnp.float32)


# Block scales (scales.blocks): one float32 per BLOCK elements of the contraction per row of x (1x128), one per
# BLOCK x BLOCK tile of w (128x128): the DeepSeek-V3 recipe, which cuBLASLt runs on Hopper.
BLOCK = 128


def blocks(scales) -> bool:
  """Whether (x_scale, w_scale) are block scales (arrays shaped like their operands' blocks), not scalars (w's
  tells: x's may be gathered shards' scalars)."""
  return scales is not None and scales[1].ndim > 0


def dequantized(x, scale):
  """A float8 operand's value: x.astype(float32) times its scale (scale None: x as it is). A block scale has x's
  rank, each dim x's or a BLOCK-th of it: each element takes the scale of its block."""
  if scale is None:
    return x
  for d in range(scale.ndim):
    if scale.shape[d] != x.shape[d]:
      scale = jnp.repeat(scale, x.shape[d] // scale.shape[d], axis=d)
  return x.astype(jnp.float32) * scale


def local_matmul(x, w, *, w_kmajor: bool = False, contract: int = 1, scales=None, out_sharding=None):
  """x's last `contract` dims times w's first (or, w_kmajor, last) `contract` dims, in the accumulator type.

  scales: (x_scale, w_scale) float32 scalars of float8 operands, or None.
  out_sharding: the result's layout, for global arrays on a mesh with Explicit axes.
  """
  if scales is not None:
    x, w = dequantized(x, scales[0]), dequantized(w, scales[1])
  x_dims = tuple(range(x.ndim - contract, x.ndim))
  w_dims = tuple(range(w.ndim - contract, w.ndim)) if w_kmajor else tuple(range(contract))
  return lax.dot_general(x, w, ((x_dims, w_dims), ((), ())), preferred_element_type=accumulator(x.dtype),
                         out_sharding=out_sharding)


def gathered_matmul(gathered, w, *, w_kmajor: bool = False, gather: int = -2, scales=None):
  """local_matmul of a gathered x whose shards along dim `gather` (negative) carry scales of their own.

  scales: (x_scales of shape (T,), one per shard in gathered order, w_scale), or None. One dot per shard keeps
  each in the form XLA rewrites into its fp8 GEMM; the products are joined along the gathered dim of the
  result (x's leading dims come first in it). Block scales (gathered with x) take one dot.
  """
  if scales is None or blocks(scales):
    return local_matmul(gathered, w, w_kmajor=w_kmajor, scales=scales)
  x_scales, w_scale = scales
  axis = gathered.ndim + gather
  shards = x_scales.shape[0]
  rows = gathered.shape[axis] // shards
  products = [local_matmul(lax.slice_in_dim(gathered, s * rows, (s + 1) * rows, axis=axis), w, w_kmajor=w_kmajor,
                           scales=(x_scales[s], w_scale)) for s in range(shards)]
  return products[0] if shards == 1 else lax.concatenate(products, axis)


def finish(acc, bias, dtype):
  """acc (+ bias in the accumulator type), rounded once to dtype."""
  if bias is not None:
    acc = acc.astype(accumulator(dtype)) + bias.astype(accumulator(dtype))
  return acc.astype(dtype)


def group_size(axis_name) -> int:
  names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
  return math.prod(lax.axis_size(a) for a in names)


def reduce_scatter(partial, axis_name, dim: int, bias=None):
  """psum_scatter(partial, dim, tiled) + bias, summed as the GPU algorithms do (module docstring).

  partial is this rank's product in x's dtype; dim is negative. Each rank's block
  of dim comes back from every rank (the all-to-all), and the blocks are added
  in rank order: ((p0 + p1) + p2) + ..., with no reassociation (XLA keeps the
  order of floating-point adds).
  """
  size, axis = group_size(axis_name), partial.ndim + dim
  blocks = partial.reshape(*partial.shape[:axis], size, partial.shape[axis] // size, *partial.shape[axis + 1:])
  blocks = lax.all_to_all(blocks, axis_name, axis, axis, tiled=True)
  acc = lax.index_in_dim(blocks, 0, axis, keepdims=False).astype(accumulator(partial.dtype))
  for rank in range(1, size):
    acc = acc + lax.index_in_dim(blocks, rank, axis, keepdims=False).astype(acc.dtype)
  return finish(acc, bias, partial.dtype)


def all_reduce(partial, axis_name, bias=None):
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
  mine = reduce_scatter(flat, axis_name, -1, bias)
  return lax.all_gather(mine, axis_name, tiled=True)[:total].reshape(shape)


# --- current scaling (the fp8 layers) -------------------------------------------------

def fp8_max(dtype) -> float:
  return float(jnp.finfo(dtype).max)


def fp8_scale(amax, dtype):
  """The power-of-two float32 scale that maps amax within the fp8 format's range: 2^ceil(log2(amax / max)),
  exact from frexp; 1 for an amax of zero. Bounded to float32's normal range, where it stays a power of two."""
  ratio = amax.astype(jnp.float32) / fp8_max(dtype)
  mantissa, exponent = jnp.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
  # Float arithmetic only: integer arithmetic on the exponent fails jax 0.12's varying-axes check when
  # jax.checkpoint recomputes it inside shard_map.
  scale = jnp.ldexp(jnp.where(mantissa == 0.5, jnp.float32(0.5), jnp.float32(1)), exponent)
  scale = jnp.clip(scale, jnp.float32(2.0 ** -126), jnp.float32(2.0 ** 127))
  return jnp.where(ratio > 0, scale, jnp.float32(1))


def to_fp8(x, dtype):
  """x rounded to the float8 format `dtype`, as a value XLA keeps. XLA on GPU may skip a narrowing convert
  (xla_allow_excess_precision, on by default): it folds a float8 round trip such as a dequantized quantize
  into no rounding at all, so that its dots would run on the unquantized values (seen on the H200: the fp8
  layers' dW off the quantized reference by a quarter of its RMS). The barrier keeps the float8 value the one
  everything downstream reads."""
  return lax.optimization_barrier(x.astype(dtype))


def quantize(x, dtype, scale):
  """x / scale rounded to the fp8 format `dtype` (round to nearest even): x's quantized value for `scale`. With
  scale a power of two the division is exact, and |x| <= amax keeps every element within the format's range."""
  return to_fp8(x.astype(jnp.float32) * (1 / scale), dtype)


def current_scaling(x, dtype, layout=lambda v: v):
  """(x quantized to `dtype`, its float32 scale) with the scale from the amax of all of x: current scaling.
  layout: a function of x (a transpose) applied before the cast, in the same pass over x."""
  scale = fp8_scale(jnp.max(jnp.abs(x)), dtype)
  return quantize(layout(x), dtype, scale), scale


def rows_times(a, scales, axis: int):
  """a in float32, each of its len(scales) blocks along dim `axis` (non-negative) times its scale: rows of
  shards that carry scales of their own (gathered order)."""
  shards = scales.shape[0]
  blocks = a.astype(jnp.float32).reshape(*a.shape[:axis], shards, a.shape[axis] // shards, *a.shape[axis + 1:])
  return (blocks * scales.reshape(shards, *([1] * (a.ndim - axis)))).reshape(a.shape)


def rescaled_rows(a8, scales, axis: int, layout=lambda v: v) -> tuple:
  """(a8 with each block along `axis` times its scale over the largest, in a8's format; the largest scale): one
  scale for rows whose shards carry scales of their own. With power-of-two scales each product is exact unless
  it falls below the format's smallest normal; one block is a8 itself. layout: as current_scaling's (with one
  block, a pass of its own over a8)."""
  if scales.shape[0] == 1:
    return layout(a8), scales[0]
  top = jnp.max(scales)
  return to_fp8(layout(rows_times(a8, scales / top, axis)), a8.dtype), top


# --- block scaling (the fp8 layers with scaling="block") ---------------------------------

def block_scaling(x, dtype):
  """(x quantized to `dtype`, its float32 scales [..., n/BLOCK]): a power-of-two scale per BLOCK consecutive
  elements of the last dim (1x128 blocks, the x_scale of a block-scaled call), from each block's amax."""
  blocks = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK).astype(jnp.float32)
  scale = fp8_scale(jnp.max(jnp.abs(blocks), axis=-1), dtype)
  return to_fp8((blocks * (1 / scale)[..., None]).reshape(x.shape), dtype), scale


def tile_scaling(w, dtype, scale=None):
  """(w [a, b] quantized to `dtype`, its float32 scales [a/BLOCK, b/BLOCK]): a power-of-two scale per BLOCK x BLOCK
  tile (the w_scale of a block-scaled call), from each tile's amax, or `scale` where given."""
  a, b = w.shape
  tiles = w.reshape(a // BLOCK, BLOCK, b // BLOCK, BLOCK).astype(jnp.float32)
  if scale is None:
    scale = fp8_scale(jnp.max(jnp.abs(tiles), axis=(1, 3)), dtype)
  return to_fp8((tiles * (1 / scale)[:, None, :, None]).reshape(a, b), dtype), scale
