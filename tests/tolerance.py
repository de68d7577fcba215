"""The tests' one tolerance scheme: a result against its float64 reference, element by element, at a tolerance
derived from the dtype and the reduction (conftest.py's `assert_close` fixture, the GPU tests and the
multi-process scenarios, which run as scripts from tests/gpu and put this directory on their path).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def tolerances(dtype, k: int, scale: float = 1.0) -> tuple[float, float]:
  """(rtol, atol) for a length-k reduction computed in `dtype`, against float64 on the same inputs.

  u = finfo(dtype).eps / 2 is the unit roundoff (bf16 2^-8, f16 2^-11, f32 2^-24).
  rtol = u^(2/3): bf16 0.025, f16 6.2e-3, f32 1.5e-5, i.e. a few ulps for the
    16-bit types (output rounding, reductions over the group in the dtype) and
    room for the f32 accumulation error, which grows like u * sqrt(k).
  atol = rtol * sqrt(k) * scale: a sum of k terms of magnitude `scale` (1 for
    unit-normal operands) has magnitude ~ sqrt(k) * scale, so entries that
    cancel to near zero keep the error of their terms.
  """
  u = float(jnp.finfo(dtype).eps) / 2
  rtol = u ** (2 / 3)
  return rtol, rtol * math.sqrt(k) * scale


# Hopper's fp8 fast accumulation keeps the tensor cores' partial sums in a narrower accumulator over the whole K
# loop (about 14 bits of mantissa: DeepSeek-V3's measurement). Each of k additions then errs by up to 2^-14 of a
# partial sum of magnitude ~ sqrt(k) * scale, a walk of ~ k * 2^-14 * scale; the worst of 3.6M elements on the
# H200 at k = 8192 was 5.5 times that. 16 times it: no flaky failure, and a wrong tile (an error of the whole
# sum's magnitude, sqrt(k) * scale) still fails for k below 2^20.
FAST_ACCUMULATION_UNIT = 2.0 ** -14 * 16


def fast_accumulation_atol(k: int, scale: float = 1.0) -> float:
  """The absolute error a length-k fp8 product with fast accumulation may carry (terms of magnitude `scale`)."""
  return FAST_ACCUMULATION_UNIT * k * scale


def rms(a) -> float:
  """The root mean square of `a`: the magnitude of one entry of a result made of several rounded stages
  (gradients through a layer), for tolerances(dtype, 1, stages * rms(expected))."""
  return float(np.sqrt(np.mean(np.square(np.asarray(a, np.float64)))))


def assert_close(actual, expected, dtype, k: int, scale: float = 1.0, what: str = "",
                 fast_accumulation: bool = False) -> None:
  """actual within tolerances(dtype, k, scale) of expected, every element (with fast_accumulation, atol at least
  fast_accumulation_atol's)."""
  rtol, atol = tolerances(dtype, k, scale)
  if fast_accumulation:
    atol = max(atol, fast_accumulation_atol(k, scale))
  actual = np.asarray(np.asarray(actual).astype(np.float64))
  expected = np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
  np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=what)


def close(actual, expected, dtype, k: int, scale: float = 1.0) -> tuple[bool, str]:
  """assert_close's verdict without raising, and the worst element's error as a share of its tolerance: for a
  check that is recorded (the multi-process scenarios) rather than asserted."""
  rtol, atol = tolerances(dtype, k, scale)
  actual = np.asarray(np.asarray(actual).astype(np.float64))
  expected = np.asarray(expected, np.float64)
  if actual.shape != expected.shape:
    return False, f"shape {actual.shape} != {expected.shape}"
  share = np.abs(actual - expected) / (atol + rtol * np.abs(expected))
  worst = float(np.max(share)) if np.all(np.isfinite(share)) else math.inf
  return worst <= 1.0, f"worst error {worst:.2f} of its tolerance (rtol {rtol:.1e}, atol {atol:.1e})"
