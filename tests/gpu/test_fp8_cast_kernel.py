"""The float8 cast kernel (jax_overlap/ops/fp8_cast.py, csrc/kernels/fp8_cast.cu) against XLA's form of the same cast,
bit for bit: each input dtype and OCP format, sizes with and without a tail past the last 8-element vector, values
over many binades (so that some round into the format's subnormals or to zero, of either sign), the scale current
scaling gives and an arbitrary power of two, NaN inputs. Every element is compared, so an element the kernel left
unwritten would have to hold the expected byte by chance (random data: about one in 256 per element). Also: the
kernel is what the fp8 layers run on one GPU, and the layer's forward has the same value as with XLA's cast.

  python -m pytest -q tests/gpu/test_fp8_cast_kernel.py     (seconds on the H200)
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_overlap
from jax_overlap.ops import fp8_cast
from jax_overlap.quantization import numerics
from gpu_util import requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

FORMATS = [jnp.float8_e4m3fn, jnp.float8_e5m2]
SHAPES = [(1,), (7,), (8,), (9,), (1001,), (3, 5, 7), (4096, 1027), (1024, 4096)]


def _values(rng, shape, dtype):
  """Normal values times 10^u, u uniform in [-7, 0]: the cast's subnormals and zeros as well as its normals."""
  v = rng.standard_normal(shape) * 10.0 ** rng.uniform(-7, 0, shape)
  return jnp.asarray(v.astype(np.float32)).astype(dtype)


def _both(x, scale, fmt):
  kernel = jax.jit(lambda x, s: fp8_cast.cast(x, s, fmt))
  xla = jax.jit(lambda x, s: fp8_cast.cast(x, s, fmt, algorithm="xla"))
  text = kernel.lower(x, scale).as_text()
  assert "jax_overlap_fp8_cast" in text, "the cast did not lower to the kernel"
  assert "jax_overlap_fp8_cast" not in xla.lower(x, scale).as_text()
  return np.asarray(kernel(x, scale)).view(np.uint8), np.asarray(xla(x, scale)).view(np.uint8)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda d: np.dtype(d).name)
def test_kernel_is_xlas_cast_bit_for_bit(fmt, x_dtype, shape):
  rng = np.random.default_rng(hash((np.dtype(fmt).name, np.dtype(x_dtype).name, shape)) % 2**32)
  x = _values(rng, shape, x_dtype)
  current = numerics.fp8_scale(jnp.max(jnp.abs(x)), fmt)
  for scale in (current, jnp.float32(2.0 ** -3)):
    got, want = _both(x, scale, fmt)
    assert got.shape == want.shape == tuple(shape)
    np.testing.assert_array_equal(got, want, err_msg=f"scale {float(scale)}")


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda d: np.dtype(d).name)
def test_nan_stays_nan(fmt):
  rng = np.random.default_rng(5)
  x = np.array(_values(rng, (4099,), jnp.float32))
  x[[0, 17, 4098]] = np.nan
  got, want = _both(jnp.asarray(x), jnp.float32(1.0), fmt)
  got_f = got.view(np.dtype(fmt)).astype(np.float32)
  assert np.isnan(got_f[[0, 17, 4098]]).all()
  finite = ~np.isnan(x)
  np.testing.assert_array_equal(got[finite], want[finite])


def test_the_fp8_layer_runs_the_kernel_and_matches_xlas_cast():
  """Fp8AgDotGeneral on one GPU: its forward lowers the x cast to the kernel, and its value and gradients equal
  those of the same layer with algorithm="xla" up to the GEMMs' rounding (the casts themselves are equal)."""
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.standard_normal((256, 512)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((512, 384)) / 23, jnp.bfloat16)
  dims = (((1,), (0,)), ((), ()))

  def loss(dot):
    return lambda x, w: jnp.sum(dot(x, w, dims).astype(jnp.float32) ** 2)

  auto = jax.jit(jax.value_and_grad(loss(jax_overlap.Fp8AgDotGeneral()), argnums=(0, 1)))
  casts = re.findall(r"custom_call @jax_overlap_fp8_cast", auto.lower(x, w).as_text())
  assert len(casts) == 3, casts  # x, dy, and w for the dual op
  xla = jax.jit(jax.value_and_grad(loss(jax_overlap.Fp8AgDotGeneral(algorithm="xla")), argnums=(0, 1)))
  (v1, (dx1, dw1)), (v2, (dx2, dw2)) = auto(x, w), xla(x, w)
  np.testing.assert_allclose(float(v1), float(v2), rtol=1e-2)
  for a, b in ((dx1, dx2), (dw1, dw2)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b)
