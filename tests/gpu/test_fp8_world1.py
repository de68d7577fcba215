"""Float8 calls of a group of one through JAX (the public API, algorithm="pipelined"): the vendor float8 GEMM as
an FFI call, against float64 of the dequantized operands (x.astype(float64) * x_scale): every format pair the
H200 runs, each output dtype, no bias, a bias in the output's dtype (the GEMM's epilogue adds it) or in float32
(XLA adds it after a float32 GEMM: jax_overlap/integration/operands.py bias_by_xla), batch dims, odd rows, w given
[K, N] (transposed by the lowering: Hopper's float8 GEMM takes K-major operands only) or K-major. Tolerances as in
test_fp8_pipelined.py (float16's for a float32 output).

  python -m pytest -q tests/gpu/test_fp8_world1.py     (about two minutes on the H200: one compile per case)
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_overlap as jo
from gpu_util import random, requires_gpu, vendor_gemm_runs
from tolerance import assert_close

pytestmark = [pytest.mark.gpu, requires_gpu]

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# (x, w formats, out dtype, bias: None / "out" / "float32", batch dims, rows, k, n, w_kmajor): every format pair
# with every output dtype, each bias kind, batch dims and odd rows among them, both layouts of w.
CASES = [
    (E4M3, E4M3, jnp.bfloat16, None, (), 256, 512, 384, False),
    (E4M3, E4M3, jnp.bfloat16, "out", (2, 3), 100, 1024, 272, True),
    (E4M3, E4M3, jnp.float16, "float32", (), 1000, 8192, 3584, False),
    (E4M3, E4M3, jnp.float32, "float32", (2,), 96, 512, 512, True),
    (E4M3, E5M2, jnp.bfloat16, "float32", (2,), 100, 1024, 272, False),
    (E4M3, E5M2, jnp.float16, "out", (), 256, 512, 384, True),
    (E4M3, E5M2, jnp.float32, None, (), 1000, 8192, 3584, True),
    (E5M2, E4M3, jnp.bfloat16, "out", (), 1000, 8192, 3584, False),
    (E5M2, E4M3, jnp.float16, None, (2, 3), 100, 1024, 272, False),
    (E5M2, E4M3, jnp.float32, "float32", (), 256, 512, 384, True),
]


def _mesh():
  return Mesh(np.array(jax.devices()[:1]), ("tp",))


def _f64(a):
  return np.asarray(np.asarray(a).astype(np.float32), np.float64)


def _tolerance_dtype(out_dtype):
  return jnp.float16 if np.dtype(out_dtype) == np.float32 else out_dtype


def _case_id(case):
  xf, wf, out, bias, lead, m, k, n, kmajor = case
  names = "x".join(np.dtype(d).name.removeprefix("float8_") for d in (xf, wf))
  return f"{names}-{np.dtype(out).name}-bias_{bias}-{lead}x{m}x{k}x{n}-{'kmajor' if kmajor else 'kn'}"


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_group_of_one_fp8_is_the_vendor_gemm(op, case):
  _check_group_of_one(op, case, fast_accumulation=False)


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
@pytest.mark.parametrize("case", [CASES[2], CASES[7]], ids=_case_id)
def test_group_of_one_fp8_with_fast_accumulation(op, case):
  """The vendor GEMM with fast accumulation (K = 8192) against float64, at fast accumulation's tolerance
  (tests/tolerance.py: 0.129% of the elements exceeded float16's at K = 8192 on the H200)."""
  _check_group_of_one(op, case, fast_accumulation=True)


def _check_group_of_one(op, case, fast_accumulation: bool):
  x_format, w_format, out_dtype, bias_kind, lead, m, k, n, w_kmajor = case
  rng = np.random.default_rng(zlib.crc32(repr((op, _case_id(case))).encode()))
  x = random(rng, (*lead, m, k), x_format)
  w_kn = random(rng, (k, n), w_format)
  w = np.ascontiguousarray(w_kn.T) if w_kmajor else w_kn
  sx, sw = np.float32(rng.uniform(0.3, 0.9)), np.float32(rng.uniform(0.3, 0.9) / k ** 0.5)
  bias_dtype = {None: None, "out": out_dtype, "float32": jnp.float32}[bias_kind]
  b = random(rng, (n,), bias_dtype) if bias_dtype is not None else None
  fn = getattr(jo, op)
  none = [None] * len(lead)
  gathers = op == "ag_matmul"
  if gathers:
    x_spec, w_spec, b_spec = P(*none, "tp", None), P("tp", None) if w_kmajor else P(None, "tp"), P("tp")
    out_specs = (P(*none, None, "tp"), P(*none, "tp", None), P("tp"))
  else:
    x_spec, w_spec, b_spec = P(*none, None, "tp"), P(None, "tp") if w_kmajor else P("tp", None), P()
    out_specs = P(*none, "tp", None)

  def body(x, w, b, sx, sw):
    extra = dict(return_gathered=True) if gathers else {}
    return fn(x, w, b, x_scale=sx, w_scale=sw, out_dtype=out_dtype, fast_accumulation=fast_accumulation,
              w_kmajor=w_kmajor, axis_name="tp", algorithm="pipelined", **extra)

  f = jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=(x_spec, w_spec, b_spec if b is not None else None, P(), P()),
                            out_specs=out_specs))
  args = (x, w, b, sx, sw)
  lowered = f.lower(*args).as_text()
  assert "jax_overlap_vendor_gemm" in lowered and f"fast_accumulation = {int(fast_accumulation)}" in lowered
  results = f(*args)
  y = results[0] if gathers else results
  ref = (_f64(x) * sx) @ (_f64(w_kn) * sw) + (0.0 if b is None else _f64(b))
  assert y.shape == ref.shape and y.dtype == out_dtype
  assert_close(y, ref, _tolerance_dtype(out_dtype), k, sx * sw, fast_accumulation=fast_accumulation)
  if gathers:
    np.testing.assert_array_equal(np.asarray(results[1]).view(np.uint8), np.asarray(x).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(results[2]), np.array([sx], np.float32))


def test_fp8_vendor_gemm_calls_sit_in_a_command_buffer_and_replay_right():
  """Four chained float8 calls (each y requantized to e4m3 with a scale for the next) recorded into a command
  buffer (the handler runs under stream capture) and replayed; every run matches the float64 reference of the
  same quantized chain."""
  rng = np.random.default_rng(11)
  k = 1024
  x, w = random(rng, (512, k), E4M3), random(rng, (k, k), E4M3)  # w K-major: its transpose is the [K, N] weight
  sx, sw, sy = np.float32(0.5), np.float32(0.75 / k ** 0.5), np.float32(0.25)
  call = jax.shard_map(lambda x, w, sx, sw: jo.ag_matmul(x, w, x_scale=sx, w_scale=sw, out_dtype=jnp.bfloat16,
                                                         w_kmajor=True, axis_name="tp", algorithm="pipelined"),
                       mesh=_mesh(), in_specs=(P("tp", None), P("tp", None), P(), P()), out_specs=P(None, "tp"))

  def chain(x, w, sx, sw):
    out = []
    for _ in range(4):
      y = call(x, w, sx, sw)
      out.append(y)
      x, sx = (y.astype(jnp.float32) / sy).astype(E4M3), sy
    return out

  f = jax.jit(chain)
  assert "jax_overlap_vendor_gemm" in f.lower(x, w, sx, sw).compile().as_text()
  counts = []
  for run in range(3):
    cur, scale, ys = x, sx, []
    counts.append(vendor_gemm_runs(lambda: ys.extend(jax.block_until_ready(f(x, w, sx, sw)))))
    for step, y in enumerate(ys):
      ref = (_f64(cur) * scale) @ (_f64(w).T * sw)
      assert_close(y, ref, jnp.bfloat16, k, scale * sw, f"run {run} step {step}")
      cur, scale = (np.asarray(y).astype(np.float32) / sy).astype(E4M3), sy
  # Each run either ran the calls or recorded them (gpu_util.vendor_gemm_runs); some run recorded them all.
  assert all(runs <= 4 and captured in (0, runs) for runs, captured in counts), counts
  assert sum(captured for _, captured in counts) >= 4, counts
