"""A float64 NumPy reference of the float8 features on global arrays, where a call quantizes each whole array once
(block scales per 128 block or 128x128 tile of the whole array), so the float8 values do not depend on the sharding
and what is left to compare is the float32 accumulation; and the helpers the sharding tests share to run a case
(tests/test_fp8_sharding_random.py, tests/test_fp8_sharding_regressions.py)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_overlap.quantization import scaling

B = scaling.BLOCK_SIZE
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"


def scale_of(amax, fmt) -> np.float32:
  """quantization/numerics.fp8_scale as documented (2^ceil(log2(amax / max)) within [2^-126, 2^127], 1 for 0), in float64."""
  amax = float(amax)
  if amax == 0:
    return np.float32(1)
  m, e = np.frexp(amax / float(jnp.finfo(fmt).max))
  return np.float32(np.clip(np.ldexp(1.0, int(e) - (m == 0.5)), 2.0 ** -126, 2.0 ** 127))


def value(q, scale=1.0):
  return np.asarray(np.asarray(q).astype(np.float32), np.float64) * scale


def tensor_q(a, fmt):
  s = scale_of(np.max(np.abs(a)), fmt)
  return value((np.asarray(a, np.float32) * (np.float32(1) / s)).astype(jnp.dtype(fmt)), np.float64(s))


def blocks_q(a, fmt, rows: int):
  """a [r, c] quantized per block of `rows` x 128 (1 x 128 blocks, or 128 x 128 tiles), as its float64 value."""
  r, c = a.shape
  t = np.asarray(a, np.float32).reshape(r // rows, rows, c // B, B)
  s = np.vectorize(lambda m: scale_of(m, fmt), otypes=[np.float32])(np.max(np.abs(t), axis=(1, 3)))
  q = (t * (np.float32(1) / s)[:, None, :, None]).astype(jnp.dtype(fmt))
  return (value(q) * s[:, None, :, None]).reshape(r, c)


def dequantized(q, scale):
  v, s = value(q), np.asarray(scale, np.float64)
  for d in range(s.ndim):
    if s.shape[d] != v.shape[d]:
      s = np.repeat(s, v.shape[d] // s.shape[d], axis=d)
  return v * s


def layer_reference(target: str, scaling_name: str, x, w, ct):
  """(y, dx, dW) of the layer `target` on global arrays, the kernel flattened to [K, N] (the layers' own view of
  it)."""
  ag = target == "Fp8AgDotGeneral"
  k = x.shape[-1] if ag else math.prod(w.shape[:-1])
  x2, w2 = np.asarray(x, np.float32).reshape(-1, k), np.asarray(w, np.float32).reshape(k, -1)
  ct2 = np.asarray(ct, np.float32).reshape(x2.shape[0], -1)
  if scaling_name == "tensor":
    xv, wv, cv = tensor_q(x2, E4M3), tensor_q(w2, E4M3), tensor_q(ct2, E5M2)
    dw = xv.T @ cv
  else:  # dW: x from its float8 value, the cotangent from its 16-bit value (ag) or its float8 one (rs), by rows
    xv, wv, cv = blocks_q(x2, E4M3, 1), blocks_q(w2, E4M3, B), blocks_q(ct2, E5M2, 1)
    rows = ct2 if ag else cv
    dw = blocks_q(xv.T.astype(np.float32), E4M3, 1) @ blocks_q(rows.T.astype(np.float32), E5M2, B).T
  return (xv @ wv).reshape(ct.shape), (cv @ wv.T).reshape(x.shape), dw.reshape(w.shape)


def mesh_of(shape: tuple, names: tuple, explicit: bool):
  kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(names), devices=jax.devices()[:math.prod(shape)])


def vjp(f, x, w, ct):
  y, back = jax.vjp(f, x, w)
  if any(t == jax.sharding.AxisType.Explicit for t in getattr(jax.typeof(y).sharding.mesh, "axis_types", ())):
    ct = jax.sharding.reshard(ct, jax.typeof(y).sharding)  # a cotangent has its primal's type
  return (y, *back(ct))


def check(got, want, k: int, what: str, assert_close):
  """tolerance.py's float32 tolerance for k terms of the result's magnitude, and at least k * 2^-126 absolute: XLA
  on CPU flushes float32 subnormals (a product or a sum below 2^-126), which only tiny operands come near."""
  rtol = float(jnp.finfo(jnp.float32).eps / 2) ** (2 / 3)
  scale = max(float(np.sqrt(np.mean(np.square(want)) / k)), k * 2.0 ** -126 / (rtol * math.sqrt(k))) or 1.0
  assert_close(np.asarray(got, np.float32), want, "float32", k, scale=scale, what=what)
