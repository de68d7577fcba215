"""The float8 arithmetic: an operand's value from its scales, and the quantization the fp8 layers apply.

A float8 operand's value is x.astype(float32) times its scale, each element
taking the scale of its block (dequantized: one formula for every scaling
mode, scaling.py). The products of the XLA path are written in the form XLA
rewrites into its own fp8 GEMM (cuBLASLt's on NVIDIA): each operand converted
to float32 and multiplied by its scale, into one dot with float32 results
(ops/reference.py). Dequantizing to bfloat16 instead is not rewritten and runs
at bfloat16 speed (1355-1539 us against 778 us at 16384x3584x8192 on an H200,
jax 0.11.2); per-row scales are not rewritten either, and no fp8 GEMM of XLA's
takes block scales, whose dot runs in float32.

Current scaling (the fp8 layers, layers/fp8.py): a power-of-two scale from the
amax, so that rescaling an fp8 value by a ratio of two scales is exact (the
layers fold per-shard scales that way); block scaling the same per block.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_overlap import _sharding
from jax_overlap.quantization.scaling import BLOCK_SIZE


def dequantized(x, scale):
  """A float8 operand's value: x.astype(float32) times its scale (scale None: x as it is). A scale of x's rank
  has each dim x's or a whole fraction of it: each element takes the scale of its block."""
  if scale is None:
    return x
  if scale.ndim:  # laid out as x is, where x's type is Explicit (scales laid out otherwise cannot multiply it)
    scale = _sharding.blocks_like(scale, x)
  for d in range(scale.ndim):
    if scale.shape[d] != x.shape[d]:
      scale = jnp.repeat(scale, x.shape[d] // scale.shape[d], axis=d)
  return x.astype(jnp.float32) * scale


# --- current scaling (the fp8 layers) -------------------------------------------------

def fp8_max(dtype) -> float:
  return float(jnp.finfo(dtype).max)


def fp8_scale(amax, dtype):
  """The power-of-two float32 scale that maps amax within the fp8 format's range: the least 2^e with
  amax <= max * 2^e, exact; 1 for an amax of zero. Bounded to float32's normal range [2^-126, 2^127], where it
  stays a power of two.

  The exponent comes from the amax itself: amax = m * 2^a and max = m_max * 2^b (frexp, m in [0.5, 1)) give
  e = a - b + (m > m_max). The ratio amax / max would be a float32 subnormal for an amax below max * 2^-126
  (5.3e-36 for e4m3, 6.7e-34 for e5m2), which XLA on CPU flushes to zero: every element would then quantize to
  zero."""
  m_max, b = np.frexp(fp8_max(dtype))
  mantissa, exponent = jnp.frexp(amax.astype(jnp.float32))
  # Float arithmetic only: integer arithmetic on the exponent fails jax 0.12's varying-axes check when
  # jax.checkpoint recomputes it inside shard_map. 2^-b is a normal float32 for every float8 format.
  step = jnp.where(mantissa > m_max, jnp.float32(2.0 ** (1 - b)), jnp.float32(2.0 ** -b))
  scale = jnp.clip(jnp.ldexp(step, exponent), jnp.float32(2.0 ** -126), jnp.float32(2.0 ** 127))
  return jnp.where(amax > 0, scale, jnp.float32(1))


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


def quantize_saturated(x, dtype, scale):
  """x / scale rounded to the fp8 format `dtype`, values beyond its largest finite one saturated to it (a NaN stays
  NaN): the quantization of delayed scaling, whose scale comes from earlier steps' amaxes and need not cover x.
  Within the format's range it is quantize's value, bit for bit (the same product and rounding)."""
  limit = jnp.float32(fp8_max(dtype))
  return to_fp8(jnp.clip(x.astype(jnp.float32) * (1 / scale), -limit, limit), dtype)


def amax(x):
  """max |x| as float32 (0 for an empty x; a NaN if x has one)."""
  return jnp.max(jnp.abs(x), initial=0).astype(jnp.float32)


def current_scaling(x, dtype, layout=lambda v: v):
  """(x quantized to `dtype`, its float32 scale) with the scale from the amax of all of x: current scaling.
  layout: a function of x (a transpose) applied before the cast, in the same pass over x."""
  scale = fp8_scale(jnp.max(jnp.abs(x)), dtype)
  return quantize(layout(x), dtype, scale), scale


def rows_times(a, scales, axis: int):
  """a in float32, each of its len(scales) blocks along dim `axis` (non-negative) times its scale: rows of
  shards that carry scales of their own (gathered order)."""
  shards = scales.shape[0]
  blocks = _sharding.reshape(a.astype(jnp.float32), (*a.shape[:axis], shards, a.shape[axis] // shards,
                                                     *a.shape[axis + 1:]))
  return _sharding.reshape(blocks * scales.reshape(shards, *([1] * (a.ndim - axis))), a.shape, like=a)


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
  """(x quantized to `dtype`, its float32 scales [..., n/BLOCK_SIZE]): a power-of-two scale per BLOCK_SIZE
  consecutive elements of the last dim (1x128 blocks: x's BLOCK scales), from each block's amax."""
  blocks = _sharding.reshape(x, (*x.shape[:-1], x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)).astype(jnp.float32)
  scale = fp8_scale(jnp.max(jnp.abs(blocks), axis=-1), dtype)
  return to_fp8(_sharding.reshape(blocks * (1 / scale)[..., None], x.shape, like=x), dtype), scale


def tile_scaling(w, dtype, scale=None):
  """(w [a, b] quantized to `dtype`, its float32 scales [a/BLOCK_SIZE, b/BLOCK_SIZE]): a power-of-two scale per
  BLOCK_SIZE x BLOCK_SIZE tile (w's BLOCK scales), from each tile's amax, or `scale` where given."""
  a, b = w.shape
  tiles = _sharding.reshape(w, (a // BLOCK_SIZE, BLOCK_SIZE, b // BLOCK_SIZE, BLOCK_SIZE)).astype(jnp.float32)
  if scale is None:
    scale = fp8_scale(jnp.max(jnp.abs(tiles), axis=(1, 3)), dtype)
  return to_fp8(_sharding.reshape(tiles * (1 / scale)[:, None, :, None], (a, b), like=w), dtype), scale
