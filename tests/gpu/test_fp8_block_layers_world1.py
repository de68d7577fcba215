"""Fp8AgDotGeneral and Fp8RsDotGeneral with scaling="block" on one GPU (algorithm "auto" and "pipelined": the
vendor's block-scaled fp8 GEMM for the forward, the dual op and dW) against the float64 reference of the same
block-quantized computation (tests/test_fp8_block_layers.py), on data whose magnitude changes from block to block;
float32 results at float16's tolerance, as the fp8 GEMM's other GPU tests (its accumulation).

  python -m pytest -q tests/gpu/test_fp8_block_layers_world1.py     (seconds on the H200)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_overlap
from gpu_util import requires_gpu
from test_fp8_block_layers import B, DN, _blocky, _vjp, ag_reference, rs_reference

pytestmark = [pytest.mark.gpu, requires_gpu]


@pytest.mark.parametrize("algorithm", ["auto", "pipelined"])
@pytest.mark.parametrize("layer", ["ag", "rs"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_block_layers_on_one_gpu(layer, algorithm, dtype, normal, assert_close):
  k, n = (3 * B, 2 * B) if layer == "ag" else (2 * B, 3 * B)
  x = _blocky(normal, (2, 192, k), dtype)
  w = (_blocky(normal, (k, n), np.float32, axis=0 if layer == "ag" else 1) / np.sqrt(k)).astype(dtype)
  ct = _blocky(normal, (2, 192, n), dtype)
  cls = jax_overlap.Fp8AgDotGeneral if layer == "ag" else jax_overlap.Fp8RsDotGeneral
  dot = cls(algorithm=algorithm, scaling="block")
  f = jax.jit(lambda x, w, ct: _vjp(lambda x, w: dot(x, w, DN), x, w, ct))
  assert f.lower(x, w, ct).as_text().count("jax_overlap_vendor_gemm") == 3  # forward, dual op, dW
  want = (ag_reference if layer == "ag" else rs_reference)(x, w, ct, 1)
  # float32 results at float16's tolerance: the vendor's fp8 GEMM accumulates below float32's precision (as in
  # test_fp8_world1.py)
  tolerance = jnp.float16 if dtype == "float32" else dtype
  for name, g, r, terms in zip(("value", "dx", "dW"), f(x, w, ct), want, (k, n, 2 * 192)):
    assert g.dtype == jnp.dtype(dtype), name
    assert_close(g, r, tolerance, terms, scale=float(np.sqrt(np.mean(np.square(r)) / terms)), what=name)
