"""Float8 block scales (1x128 for x, 128x128 for w) in a group of one through JAX (the public API,
algorithm="pipelined": cuBLASLt's block-scaled GEMM as an FFI call) against float64 of the dequantized operands
(each element times its block's scale, scales random per block): the OCP format pairs, each output dtype, no bias,
a bias in the output's dtype or in float32 (both added by XLA after a float32 GEMM: cuBLASLt has no bias epilogue
with block scales), batch dims (folded into the rows), K/128 = 5 (w's scale rows padded to 8), w given [K, N]
(transposed by the lowering) or K-major. Rows that are not a multiple of 4 take the XLA path under "auto" and are
an error for "pipelined". Multi-rank schedules: tests/gpu/scenarios/fp8_blocks.py, in processes.

  python -m pytest -q tests/gpu/test_fp8_world1_blocks.py     (about a minute on the H200: one compile per case)
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_overlap as jo
from block_scales import dequantized as _value
from gpu_util import random, requires_gpu
from tolerance import assert_close

pytestmark = [pytest.mark.gpu, requires_gpu]

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
B = 128
# (x, w formats, out dtype, bias: None / "out" / "float32", batch dims, rows, k, n, w_kmajor)
CASES = [
    (E4M3, E4M3, jnp.bfloat16, None, (), 256, 512, 384, False),
    (E4M3, E4M3, jnp.bfloat16, "out", (2, 3), 100, 640, 256, True),
    (E4M3, E4M3, jnp.float16, "float32", (), 1000, 8192, 3584, False),
    (E4M3, E4M3, jnp.float32, None, (2,), 96, 512, 512, True),
    (E4M3, E5M2, jnp.bfloat16, "float32", (), 1000, 8192, 3584, True),
    (E5M2, E4M3, jnp.bfloat16, "out", (), 256, 640, 384, False),
]


def _case_id(case):
  xf, wf, out, bias, lead, m, k, n, kmajor = case
  names = "x".join(np.dtype(d).name.removeprefix("float8_") for d in (xf, wf))
  return f"{names}-{np.dtype(out).name}-bias_{bias}-{lead}x{m}x{k}x{n}-{'kmajor' if kmajor else 'kn'}"


def _operands(rng, case):
  x_format, w_format, out_dtype, bias_kind, lead, m, k, n, w_kmajor = case
  x = random(rng, (*lead, m, k), x_format)
  w_kn = random(rng, (k, n), w_format)
  sx = rng.uniform(0.3, 0.9, (*lead, m, k // B)).astype(np.float32)
  sw_kn = (rng.uniform(0.3, 0.9, (k // B, n // B)) / k ** 0.5).astype(np.float32)
  bias_dtype = {None: None, "out": out_dtype, "float32": jnp.float32}[bias_kind]
  b = random(rng, (n,), bias_dtype) if bias_dtype is not None else None
  w, sw = (np.ascontiguousarray(w_kn.T), np.ascontiguousarray(sw_kn.T)) if w_kmajor else (w_kn, sw_kn)
  want = _value(x, sx) @ _value(w_kn, sw_kn) + (0.0 if b is None else np.asarray(b, np.float64))
  return (x, w, b, sx, sw), want


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_group_of_one_block_scales(op, case):
  out_dtype, k, w_kmajor = case[2], case[6], case[8]
  rng = np.random.default_rng(zlib.crc32(repr((op, _case_id(case))).encode()))
  (x, w, b, sx, sw), want = _operands(rng, case)
  f = jax.jit(lambda x, w, b, sx, sw: getattr(jo, op)(x, w, b, x_scale=sx, w_scale=sw, out_dtype=out_dtype,
                                                      w_kmajor=w_kmajor, algorithm="pipelined"))
  assert "jax_overlap_vendor_gemm" in f.lower(x, w, b, sx, sw).as_text()
  y = f(x, w, b, sx, sw)
  assert y.shape == want.shape and y.dtype == out_dtype
  # Hopper's float8 MMA adds in about 14 bits between promotions: float16's tolerance for a float32 output.
  tolerance = jnp.float16 if np.dtype(out_dtype) == np.float32 else out_dtype
  assert_close(y, want, tolerance, k, float(sx.max() * sw.max()))


def test_rows_not_a_multiple_of_four():
  """cuBLASLt's block-scaled GEMM takes rows in fours: "auto" takes the XLA path (right all the same),
  "pipelined" says why it cannot."""
  rng = np.random.default_rng(5)
  case = (E4M3, E4M3, jnp.bfloat16, None, (), 98, 256, 256, False)
  (x, w, _, sx, sw), want = _operands(rng, case)
  auto = jax.jit(lambda x, w, sx, sw: jo.ag_matmul(x, w, x_scale=sx, w_scale=sw))
  assert "jax_overlap_vendor_gemm" not in auto.lower(x, w, sx, sw).as_text()
  assert_close(auto(x, w, sx, sw), want, jnp.bfloat16, 256, float(sx.max() * sw.max()))
  with pytest.raises(ValueError, match=r"block scales with 98 rows per GEMM \(cuBLASLt takes multiples of 4\)"):
    jax.jit(lambda x, w, sx, sw: jo.ag_matmul(x, w, x_scale=sx, w_scale=sw, algorithm="pipelined")).lower(
        x, w, sx, sw)
