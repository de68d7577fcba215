"""The float8 arithmetic: an operand's value from its scales, and the quantization the fp8 layers apply.

The XLA path's products take the form XLA rewrites into its fp8 GEMM: each operand in float32 times its scale,
into one dot with float32 results; dequantizing to bfloat16 instead is not rewritten (docs/performance.md). Scales
are powers of two, so rescaling an fp8 value by a ratio of two scales is exact (how the layers fold per-shard
scales).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_overlap import _sharding
from jax_overlap.quantization.scaling import BLOCK_SIZE


def dequantized(x, scale):
  """x in float32 times its scale (None: x), each element taking the scale of its block."""
  if scale is None:
    return x
  if scale.ndim:
    scale = _sharding.blocks_like(scale, x)
  # On an Explicit mesh jnp.repeat takes the layout of its result: the scale's, which blocks_like made x's.
  layout = {"out_sharding": jax.typeof(scale).sharding} if _sharding.explicit_mesh(jax.typeof(scale)) else {}
  for d in range(scale.ndim):
    if scale.shape[d] != x.shape[d]:
      scale = jnp.repeat(scale, x.shape[d] // scale.shape[d], axis=d, **layout)
  return x.astype(jnp.float32) * scale


def fp8_max(dtype) -> float:
  return float(jnp.finfo(dtype).max)


def fp8_scale(amax, dtype):
  """The least 2^e with amax <= max * 2^e, within [2^-126, 2^127]; 1 for an amax of zero, 2^127 for an infinite one.

  e comes from frexp of amax and max, not from amax / max: that ratio is a float32 subnormal for a tiny amax, which
  XLA on CPU flushes to zero (every element would quantize to zero)."""
  m_max, b = np.frexp(fp8_max(dtype))
  amax = amax.astype(jnp.float32)
  mantissa, _ = jnp.frexp(amax)
  # Float arithmetic only, all of it exact: amax = mantissa * 2^e, so amax * 2^-b / mantissa is 2^(e-b) (a product
  # below 2^-126 only meets the clip's floor). Integer arithmetic on e fails jax 0.12's varying-axes check when
  # jax.checkpoint recomputes it inside shard_map, and jnp.ldexp fails under a vmap sharded on an Explicit mesh.
  step = jnp.where(mantissa > m_max, jnp.float32(2.0 ** (1 - b)), jnp.float32(2.0 ** -b))
  scale = jnp.clip(amax * step / mantissa, jnp.float32(2.0 ** -126), jnp.float32(2.0 ** 127))
  scale = jnp.where(amax == jnp.inf, jnp.float32(2.0 ** 127), scale)
  return jnp.where(amax > 0, scale, jnp.float32(1))


def to_fp8(x, dtype):
  """x rounded to `dtype`. The barrier stops XLA on GPU (xla_allow_excess_precision) from folding a float8 round
  trip into no rounding, which would run the dots on unquantized values."""
  return lax.optimization_barrier(x.astype(dtype))


def quantize(x, dtype, scale):
  """x / scale rounded to `dtype` (nearest even); with |x| <= amax every element is in range."""
  return to_fp8(x.astype(jnp.float32) * (1 / scale), dtype)


def quantize_saturated(x, dtype, scale):
  """quantize, saturated to the largest finite value (NaN stays NaN): delayed scaling's scale comes from earlier
  steps' amaxes and need not cover x. Bit for bit quantize's value within range."""
  limit = jnp.float32(fp8_max(dtype))
  return to_fp8(jnp.clip(x.astype(jnp.float32) * (1 / scale), -limit, limit), dtype)


def amax(x):
  """max |x| as float32 (0 for an empty x)."""
  return jnp.max(jnp.abs(x), initial=0).astype(jnp.float32)


def current_scaling(x, dtype, layout=lambda v: v):
  """(x quantized, its scale) from the amax of all of x. layout: a transpose fused into the cast's pass."""
  scale = fp8_scale(jnp.max(jnp.abs(x)), dtype)
  return quantize(layout(x), dtype, scale), scale


def rows_times(a, scales, axis: int):
  """a in float32, its len(scales) blocks along `axis` (gathered shards) each times its own scale."""
  shards = scales.shape[0]
  blocks = _sharding.reshape(a.astype(jnp.float32), (*a.shape[:axis], shards, a.shape[axis] // shards,
                                                     *a.shape[axis + 1:]))
  return _sharding.reshape(blocks * scales.reshape(shards, *([1] * (a.ndim - axis))), a.shape, like=a)


def rescaled_rows(a8, scales, axis: int, layout=lambda v: v) -> tuple:
  """(a8 under one scale, the largest of `scales`): each block times its scale over the largest, exact with
  power-of-two scales down to the format's smallest normal."""
  if scales.shape[0] == 1:
    return layout(a8), scales[0]
  top = jnp.max(scales)
  return to_fp8(layout(rows_times(a8, scales / top, axis)), a8.dtype), top


def block_scaling(x, dtype):
  """(x quantized, its scales [..., n/BLOCK_SIZE]): one scale per 1 x BLOCK_SIZE block of the last dim."""
  blocks = _sharding.reshape(x, (*x.shape[:-1], x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)).astype(jnp.float32)
  scale = fp8_scale(jnp.max(jnp.abs(blocks), axis=-1), dtype)
  return to_fp8(_sharding.reshape(blocks * (1 / scale)[..., None], x.shape, like=x), dtype), scale


def tile_scaling(w, dtype, scale=None):
  """(w [a, b] quantized, its scales [a/BLOCK_SIZE, b/BLOCK_SIZE]): one per tile, from its amax unless given."""
  a, b = w.shape
  tiles = _sharding.reshape(w, (a // BLOCK_SIZE, BLOCK_SIZE, b // BLOCK_SIZE, BLOCK_SIZE)).astype(jnp.float32)
  if scale is None:
    scale = fp8_scale(jnp.max(jnp.abs(tiles), axis=(1, 3)), dtype)
  return to_fp8(_sharding.reshape(tiles * (1 / scale)[:, None, :, None], (a, b), like=w), dtype), scale
