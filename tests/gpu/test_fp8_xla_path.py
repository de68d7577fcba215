"""Float8 on one GPU through XLA: XLA runs the XLA path's GEMM on the float8 operands, and the ops and the fp8
layers compute right there (the XLA path's numerics, against float64).

  JAX_PLATFORMS=cuda python -m pytest -q tests/gpu/test_fp8_xla_path.py
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_overlap as jo
from jax_overlap.quantization import formats
from jax_overlap.runtime import workspace
from gpu_util import requires_gpu
from test_fp8_layers import ag_layer_reference, rs_layer_reference
from tolerance import assert_close

pytestmark = [pytest.mark.gpu, requires_gpu]


def _formats():
  """(e4m3, e5m2) of this GPU's family; skip where it runs none."""
  (_, arch), *_ = workspace.local_gpus() or ((None, ""),)
  family = formats.fp8_family_of(arch)
  if family is None:
    pytest.skip(f"this GPU ({arch}) runs no float8 format")
  return formats.fp8_formats(family)


def _fp8_gemms(compiled: str) -> list:
  """XLA's GEMMs that read float8 operands: its cuBLASLt fp8 GEMM, or a Triton GEMM fusion of the operands'
  converts from float8 (the autotuner's pick for some shapes, split-K among them)."""
  cublas = re.findall(r'custom_call_target="([^"]*\$f8[^"]*)"', compiled)
  triton = [name for name, params in re.findall(r"^%(gemm_fusion\S*) \(([^)]*)\)", compiled, re.M) if "f8e" in params]
  return cublas + triton


def _mesh():
  return Mesh(np.array(jax.devices()[:1]), ("tp",))


@pytest.mark.parametrize("fast", [False, True], ids=["promoted", "fast_accumulation"])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_xla_path_is_xlas_fp8_gemm(op, fast):
  """algorithm="xla" in shard_map over one GPU: float8 operands converted to float32 and scaled, into one dot per
  shard: XLA runs a GEMM on the float8 operands for it, at precision HIGHEST (float32 sums) or DEFAULT (fast
  accumulation), and the result matches float64."""
  e4m3, e5m2 = _formats()
  rng = np.random.default_rng(0)
  m, k, n = 512, 1024, 768
  x = rng.standard_normal((m, k)).astype(jnp.dtype(e4m3))
  w = rng.standard_normal((k, n)).astype(jnp.dtype(e5m2))
  sx, sw = np.float32(0.75), np.float32(1 / 32)
  x_spec, w_spec, out_spec = ((P("tp"), P(None, "tp"), P(None, "tp")) if op == "ag_matmul" else
                              (P(None, "tp"), P("tp"), P("tp")))
  f = jax.jit(jax.shard_map(
      lambda x, w, sx, sw: getattr(jo, op)(x, w, x_scale=sx, w_scale=sw, fast_accumulation=fast, axis_name="tp",
                                           algorithm="xla"),
      mesh=_mesh(), in_specs=(x_spec, w_spec, P(), P()), out_specs=out_spec))
  y = f(x, w, sx, sw)
  want = (np.asarray(x.astype(np.float32), np.float64) * sx) @ (np.asarray(w.astype(np.float32), np.float64) * sw)
  assert_close(y, want, jnp.bfloat16, k, float(sx * sw))
  compiled = f.lower(x, w, sx, sw).compile().as_text()
  assert len(_fp8_gemms(compiled)) == 1, compiled


@pytest.mark.parametrize("algorithm", ["xla", "auto"])
@pytest.mark.parametrize("layer", ["ag", "rs"])
def test_fp8_layer_on_one_gpu(layer, algorithm):
  """Fp8AgDotGeneral / Fp8RsDotGeneral from bf16 inputs: value, dx and dW against the float64 reference of the
  same quantized computation (tests/test_fp8_layers.py). Before numerics.to_fp8 XLA folded the layers'
  quantize-dequantize round trips away on the GPU (dW off by a quarter of its RMS with either algorithm). Which of
  the three GEMMs XLA then runs on float8 operands is its own choice (on jax 0.11.2 at these sizes: dW's)."""
  _formats()
  rng = np.random.default_rng(1)
  b, s, k, n = 2, 256, 1024, 512
  x = rng.standard_normal((b, s, k)).astype(jnp.bfloat16)
  w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
  ct = rng.standard_normal((b, s, n)).astype(jnp.bfloat16)
  dot = (jo.Fp8AgDotGeneral if layer == "ag" else jo.Fp8RsDotGeneral)(algorithm=algorithm)

  def step(x, w, ct):
    y, vjp = jax.vjp(lambda x, w: dot(x, w, (((2,), (0,)), ((), ()))), x, w)
    return (y, *vjp(ct))
  f = jax.jit(step)
  reference = ag_layer_reference if layer == "ag" else rs_layer_reference
  for name, got, want, terms in zip(("value", "dx", "dW"), f(x, w, ct), reference(x, w, ct, 1, 1), (k, n, b * s)):
    assert_close(got, want, jnp.bfloat16, terms, float(np.sqrt(np.mean(np.square(want)) / terms)), what=name)


@pytest.mark.parametrize("layer", ["ag", "rs"])
def test_fp8_layer_gemms_are_the_vendors(layer):
  """With "auto" on one GPU the layer's three GEMMs (forward, dx, dW) are the vendor's fp8 GEMM, and XLA runs none
  on float8 operands: dW's operands reach it transposed (contraction last), which Hopper's fp8 GEMM needs."""
  _formats()
  rng = np.random.default_rng(2)
  x = rng.standard_normal((2, 256, 1024)).astype(jnp.bfloat16)
  w = (rng.standard_normal((1024, 512)) / 32).astype(jnp.bfloat16)
  ct = rng.standard_normal((2, 256, 512)).astype(jnp.bfloat16)
  dot = (jo.Fp8AgDotGeneral if layer == "ag" else jo.Fp8RsDotGeneral)()

  def step(x, w, ct):
    y, vjp = jax.vjp(lambda x, w: dot(x, w, (((2,), (0,)), ((), ()))), x, w)
    return (y, *vjp(ct))
  compiled = jax.jit(step).lower(x, w, ct).compile().as_text()
  assert len(re.findall(r'custom_call_target="jax_overlap_vendor_gemm', compiled)) == 3, compiled
  assert _fp8_gemms(compiled) == [], compiled


def test_transformer_block_in_fp8():
  """examples/transformer_block.py --fp8 on this GPU: PASS at the float8 tolerance, and both step times."""
  import pathlib
  import subprocess
  import sys
  root = pathlib.Path(__file__).resolve().parents[2]
  run = subprocess.run([sys.executable, str(root / "examples" / "transformer_block.py"), "--fp8", "--steps", "3",
                        "--seq", "512", "--embed", "512", "--heads", "8", "--ffn", "1024"],
                       cwd=root, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stdout + run.stderr
  assert run.stdout.strip().splitlines()[-1].startswith("PASS: "), run.stdout
  assert "fp8 auto against the bf16 block on XLA" in run.stdout, run.stdout
