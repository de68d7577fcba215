"""Float8 operands in the pipelined schedule on one GPU, driven through the native module (no JAX op): the
one-GPU loopback at T = 2, 4, 8 and simulated ranks (SimGroup) with each rank's own scales, against float64 of
the dequantized operands (x.astype(float64) * x_scale); matmul_rs's reduction bitwise equal to a rank-order
float32 oracle (bfloat16); the cost model's float8 timings. Outputs are poisoned with NaN before every call.

Formats: the OCP pairs the H200 runs (e5m2 on both sides is refused by the API; the fnuz formats are gfx942's,
which no NVIDIA GPU runs). Tolerances (tests/tolerance.py) are the output dtype's, and float16's for a float32
output: Hopper's float8 MMA adds its products in about 14 bits before each promotion to fp32 (DeepSeek-V3
report, section 3.3.2), so a float8 GEMM is no float32 GEMM whatever it writes. SimGroup cases run every stage
alone ((1,) * world), the plans test_pipelined.py found reliable in simulated ranks (stage plans are checked in
processes: tests/gpu/scenarios/fp8.py). Even so, one of them timed out once on 2026-12-02 (ag_matmul, 4 ranks,
float32 out; 1 run of 3): the shared hardware queues csrc/testing/sim_group.h describes. The fp8 scenario checks
the same per-rank scales in processes of their own.

  python -m pytest -q tests/gpu/test_fp8_pipelined.py     (about a minute on the H200)
"""

from __future__ import annotations

import zlib

import jax.numpy as jnp
import numpy as np
import pytest

from gpu_util import on_gpu as _dev, pointer as _ptr, poisoned as _poisoned, random, requires_gpu
from tolerance import assert_close
from jax_overlap.quantization import formats
from jax_overlap.runtime import native
import native_testing

harness = native_testing.module()

pytestmark = [pytest.mark.gpu, requires_gpu]

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FORMATS = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)]
OUT_DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]


def _f64(a):
  return np.asarray(np.asarray(a).astype(np.float32), np.float64)


def _name(dtype) -> str:
  return np.dtype(dtype).name


def _tolerance_dtype(out_dtype):
  """The dtype whose tolerance a float8 GEMM's output is held to (module docstring)."""
  return jnp.float16 if np.dtype(out_dtype) == np.float32 else out_dtype


def _quantized(rng, shape, dtype):
  """(q, scale): a float8 operand and its float32 scale, q's values about unit normal (never all zeros), the
  scale no power of two (the GEMM must multiply by it, not shift)."""
  return random(rng, shape, dtype), np.float32(rng.uniform(0.3, 0.9))


def _scratch(op, world, batch, m, n, out_dtype, loopback=False):
  nbytes = native.module().pipelined_scratch_bytes(op, world, batch, m, n, formats.partial(out_dtype).itemsize,
                                                   loopback)
  return _dev(jnp.zeros((nbytes,), jnp.uint8))


# --- the loopback: the schedule's GEMMs, copies and streams with this GPU's data for every peer's -------------

@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("formats", FORMATS, ids=lambda f: f"{_name(f[0])}x{_name(f[1])}")
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("op,shared", [("ag_matmul", False), ("ag_matmul", True), ("matmul_rs", False)],
                         ids=["ag_matmul", "ag_matmul-x_scale_shared", "matmul_rs"])
def test_loopback_fp8_schedule(op, shared, world, formats, out_dtype):
  """ag_matmul gives [x; x; ...] @ w with every shard's scale gathered (x_scale_shared: a stage's shards in one
  GEMM with the call's own scale); matmul_rs world times its own block's partial, staged in
  formats.partial(out_dtype). A bias in
  out_dtype (ag_matmul, a 16-bit output: the GEMM epilogue adds it) or float32 (matmul_rs: the reduction adds it);
  odd shard rows, two batch elements."""
  rng = np.random.default_rng(zlib.crc32(repr((op, world, formats, _name(out_dtype))).encode()))
  batch, k, n = 2, 512, 1024
  m = 100 if op == "ag_matmul" else 24 * world  # x's rows per batch element
  (x, sx), (w, sw) = _quantized(rng, (batch, m, k), formats[0]), _quantized(rng, (n, k), formats[1])
  if op == "ag_matmul":
    bias_dtype = None if np.dtype(out_dtype) == np.float32 else out_dtype
  else:
    bias_dtype = jnp.float32
  b = random(rng, (n,), bias_dtype) if bias_dtype is not None else None
  rows = world * m if op == "ag_matmul" else m // world
  out = _poisoned((batch, rows, n), out_dtype)
  gathered = _poisoned((batch, world * m, k), formats[0]) if op == "ag_matmul" else None
  scales = _poisoned((world,), jnp.float32) if op == "ag_matmul" else None
  # Every device array the call reads or writes stays referenced here until it returned: a buffer freed while
  # its pointer is in use may be handed to the next allocation.
  xs_dev, ws_dev = _dev(np.array([sx])), _dev(np.array([sw]))
  x_dev, w_dev, b_dev = _dev(x), _dev(w), (_dev(b) if b is not None else None)
  scratch = _scratch(op, world, batch, m, n, out_dtype, loopback=True)
  call = dict(dtype=_name(formats[0]), w_dtype=_name(formats[1]), out_dtype=_name(out_dtype), x=_ptr(x_dev),
              w=_ptr(w_dev), bias=_ptr(b_dev), x_scale=_ptr(xs_dev),
              w_scale=_ptr(ws_dev), out=_ptr(out), gathered=_ptr(gathered), gathered_scales=_ptr(scales),
              scratch=_ptr(scratch), batch=batch, m=m, k=k, n=n,
              w_kmajor=True, stages=[1, world - 1] if op == "ag_matmul" else [world // 2, world - world // 2],
              x_scale_shared=shared)
  if bias_dtype is not None:
    call["bias_dtype"] = _name(bias_dtype)
  assert harness.time_loopback(0, op, world, call, 3) > 0
  w64 = _f64(w).T * sw
  bias = _f64(b) if b is not None else 0.0
  if op == "ag_matmul":
    ref = np.concatenate([_f64(x) * sx] * world, axis=1) @ w64 + bias
    np.testing.assert_array_equal(np.asarray(gathered).view(np.uint8),
                                  np.concatenate([np.asarray(x)] * world, axis=1).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scales), np.full((world,), sx, np.float32))
  else:
    ref = world * ((_f64(x)[:, :m // world] * sx) @ w64) + bias
  assert out.dtype == out_dtype
  terms = k if op == "ag_matmul" else world * k
  assert_close(out, ref, _tolerance_dtype(out_dtype), terms, sx * sw)


def test_loopback_refuses_a_float32_bias_the_gemm_epilogue_cannot_add():
  """cuBLASLt's float8 epilogue takes a bias in the 16-bit output's dtype only: the call fails naming it (the
  lowering never makes such a call: it adds such a bias itself, jax_overlap/integration/operands.py bias_by_xla)."""
  rng = np.random.default_rng(5)
  x, w = random(rng, (1, 64, 256), E4M3), random(rng, (256, 256), E4M3)
  one = _dev(np.ones((1,), np.float32))
  buffers = dict(x=_dev(x), w=_dev(w), bias=_dev(np.ones((256,), np.float32)),
                 out=_poisoned((1, 128, 256), jnp.bfloat16), gathered=_poisoned((1, 128, 256), E4M3),
                 gathered_scales=_poisoned((2,), jnp.float32),
                 scratch=_scratch("ag_matmul", 2, 1, 64, 256, jnp.bfloat16, loopback=True))  # referenced to the end
  call = dict(dtype="float8_e4m3fn", out_dtype="bfloat16", bias_dtype="float32", x_scale=_ptr(one),
              w_scale=_ptr(one), batch=1, m=64, k=256, n=256, w_kmajor=True, stages=[1, 1],
              **{name: _ptr(v) for name, v in buffers.items()})
  with pytest.raises(RuntimeError, match="float8 GEMM takes no such bias"):
    harness.time_loopback(0, "ag_matmul", 2, call, 1)


# --- simulated ranks: the protocol, each rank with scales of its own ----------------------------------------

def _group(world, watchdog=10.0):
  return harness.SimGroup(0, world, bytes_per_rank=512 << 20, watchdog_seconds=watchdog)


class Fp8Ranks:
  """One call's per-rank float8 operands and scales (device arrays) of either op, with the float64 reference."""

  def __init__(self, op, world, formats, out_dtype, batch, m, k, n, rng, bias_dtype=None):
    self.op, self.world, self.formats, self.out_dtype = op, world, formats, out_dtype
    self.batch, self.m, self.k, self.n = batch, m, k, n
    xs = [_quantized(rng, (batch, m, k), formats[0]) for _ in range(world)]
    ws = [_quantized(rng, (n, k), formats[1]) for _ in range(world)]  # K-major: [n, k]
    self.x_host, self.sx = [x for x, _ in xs], [s for _, s in xs]
    self.w_host, self.sw = [w for w, _ in ws], [s for _, s in ws]
    self.xs, self.ws = [_dev(x) for x in self.x_host], [_dev(w) for w in self.w_host]
    self.x_scales = [_dev(np.array([s])) for s in self.sx]
    self.w_scales = [_dev(np.array([s])) for s in self.sw]
    self.bias_dtype = bias_dtype
    self.bs = [_dev(random(rng, (n,), bias_dtype)) if bias_dtype is not None else None for _ in range(world)]
    self.scratch = [_scratch(op, world, batch, m, n, out_dtype) for _ in range(world)]
    self.poison()

  def poison(self):
    rows = self.world * self.m if self.op == "ag_matmul" else self.m // self.world
    self.outs = [_poisoned((self.batch, rows, self.n), self.out_dtype) for _ in range(self.world)]
    gathers = self.op == "ag_matmul"
    self.gathered = [_poisoned((self.batch, self.world * self.m, self.k), self.formats[0])
                     for _ in range(self.world)] if gathers else []
    self.gathered_scales = [_poisoned((self.world,), jnp.float32) for _ in range(self.world)] if gathers else []

  def run(self, group, **extra):
    call = dict(dtype=_name(self.formats[0]), w_dtype=_name(self.formats[1]), out_dtype=_name(self.out_dtype),
                tile=0, comm_workgroups=0, w_kmajor=True, batch=self.batch, m=self.m, k=self.k, n=self.n,
                x=[_ptr(v) for v in self.xs], w=[_ptr(v) for v in self.ws], bias=[_ptr(v) for v in self.bs],
                x_scale=[_ptr(v) for v in self.x_scales], w_scale=[_ptr(v) for v in self.w_scales],
                out=[_ptr(v) for v in self.outs], gathered=[_ptr(v) for v in self.gathered],
                gathered_scales=[_ptr(v) for v in self.gathered_scales],
                scratch=[_ptr(v) for v in self.scratch], stages=[1] * self.world, **extra)
    if self.bias_dtype is not None:
      call["bias_dtype"] = _name(self.bias_dtype)
    (group.pipelined_ag_matmul if self.op == "ag_matmul" else group.pipelined_matmul_rs)(call)

  def value(self, q):
    """Rank q's (x, w [k, n]) as float64 values."""
    return _f64(self.x_host[q]) * self.sx[q], _f64(self.w_host[q]).T * self.sw[q]

  def reference(self, rank):
    bias = 0.0 if self.bs[rank] is None else _f64(self.bs[rank])
    if self.op == "ag_matmul":
      return np.concatenate([self.value(q)[0] for q in range(self.world)], axis=1) @ self.value(rank)[1] + bias
    total = sum(x @ w for x, w in map(self.value, range(self.world)))
    rows = self.m // self.world
    return total[:, rank * rows:(rank + 1) * rows] + bias

  def check(self, what=""):
    terms = self.k if self.op == "ag_matmul" else self.world * self.k
    scale = max(self.sx) * max(self.sw)
    for r in range(self.world):
      assert_close(self.outs[r], self.reference(r), _tolerance_dtype(self.out_dtype), terms, scale,
                   f"{what} rank {r}")
      if self.op == "ag_matmul":
        np.testing.assert_array_equal(
            np.asarray(self.gathered[r]).view(np.uint8),
            np.concatenate([np.asarray(x) for x in self.x_host], axis=1).view(np.uint8), err_msg=f"{what} rank {r}")
        np.testing.assert_array_equal(np.asarray(self.gathered_scales[r]), np.array(self.sx, np.float32))


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("formats", FORMATS[:2], ids=lambda f: f"{_name(f[0])}x{_name(f[1])}")
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_ranks_with_scales_of_their_own(op, world, formats, out_dtype):
  """Every rank quantized its shard with its own scale: ag_matmul's shard s is multiplied by rank s's x scale
  (it travels with the shard and comes back in gathered_scales), matmul_rs's partials by their stager's."""
  rng = np.random.default_rng(zlib.crc32(repr((op, world, formats, _name(out_dtype), "ranks")).encode()))
  bias_dtype = jnp.float32 if op == "matmul_rs" else (None if np.dtype(out_dtype) == np.float32 else out_dtype)
  ranks = Fp8Ranks(op, world, formats, out_dtype, 2, 48 * world, 256, 512, rng, bias_dtype)
  g = _group(world)
  ranks.run(g)
  assert g.errors() == []
  ranks.check()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_fp8_matmul_rs_bits_repeat(world):
  rng = np.random.default_rng(90 + world)
  ranks = Fp8Ranks("matmul_rs", world, (E4M3, E4M3), jnp.bfloat16, 1, 64 * world, 512, 512, rng, jnp.bfloat16)
  g = _group(world)
  ranks.run(g)
  first = [np.asarray(o).view(np.uint16).copy() for o in ranks.outs]
  ranks.poison()
  ranks.run(g)
  for a, b in zip(first, ranks.outs):
    np.testing.assert_array_equal(a, np.asarray(b).view(np.uint16))
  ranks.check()


# --- the reduction under the last GEMM: the same bits as without it, and as a rank-order fold ---------------

def _one_product_per_element(rng, world, m, k, n):
  """Per rank, bfloat16 x [1, m, k] with one nonzero per row and w [k, n], both of exponents spread over
  2^-20 .. 2^20: every partial x @ w is one exact product rounded once to bfloat16, whatever the GEMM's algorithm
  (so both schedules stage the same bits), while the float32 sum of the ranks' partials is inexact (so its order
  shows)."""
  def spread(shape):
    return (rng.choice([-1.0, 1.0], shape) * np.exp2(rng.integers(-20, 21, shape)) *
            rng.uniform(1, 2, shape)).astype(jnp.bfloat16)
  xs, ws = [], []
  for _ in range(world):
    x = np.zeros((1, m, k), jnp.bfloat16)
    x[0, np.arange(m), rng.integers(0, k, m)] = spread((m,))
    xs.append(x)
    ws.append(spread((k, n)))
  return xs, ws


@pytest.mark.parametrize("world", [2, 4, 8])
def test_the_reduction_keeps_the_bits(world):
  """matmul_rs's reduction is bitwise the rank-order float32 fold of the ranks' bfloat16 partials plus the bias,
  rounded once (the XLA path's and the fused kernel's numerics)."""
  rng = np.random.default_rng(100 + world)
  m, k, n = 32 * world, 256, 1024
  xs, ws = _one_product_per_element(rng, world, m, k, n)
  bias = random(rng, (n,), jnp.bfloat16)
  partials = [(x[0].astype(np.float32) @ w.astype(np.float32)).astype(jnp.bfloat16) for x, w in zip(xs, ws)]
  g = _group(world)
  outs = [_poisoned((1, m // world, n), jnp.bfloat16) for _ in range(world)]
  scratch = [_scratch("matmul_rs", world, 1, m, n, jnp.bfloat16) for _ in range(world)]
  dev_x, dev_w, dev_b = [_dev(x) for x in xs], [_dev(w) for w in ws], [_dev(bias) for _ in range(world)]
  g.pipelined_matmul_rs(dict(dtype="bfloat16", tile=0, comm_workgroups=0, w_kmajor=False, batch=1, m=m, k=k, n=n,
                             x=[_ptr(v) for v in dev_x], w=[_ptr(v) for v in dev_w], bias=[_ptr(v) for v in dev_b],
                             out=[_ptr(v) for v in outs], scratch=[_ptr(v) for v in scratch], stages=[1] * world))
  assert g.errors() == []
  rows = m // world
  for r in range(world):
    acc = np.zeros((rows, n), np.float32)
    for q in range(world):  # rank order, in float32
      acc = acc + partials[q][r * rows:(r + 1) * rows].astype(np.float32)
    want = (acc + bias.astype(np.float32)).astype(jnp.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(np.asarray(outs[r])[0].view(np.uint16), want, err_msg=f"rank {r}")


# --- the cost model's figures -----------------------------------------------------------------------------

def test_fp8_gemm_timings_for_the_cost_model():
  nat = native.module()
  fp8 = nat.time_gemms(0, "float8_e4m3fn", [2048, 4096], 4096, 4096, w_kmajor=True, w_dtype="float8_e4m3fn",
                       out_dtype="bfloat16")
  bf16 = nat.time_gemms(0, "bfloat16", [4096], 4096, 4096)
  assert len(fp8) == 2 and 0 < fp8[0] < fp8[1] < bf16[0]
  with pytest.raises(RuntimeError, match="K-major"):
    nat.time_gemms(0, "float8_e4m3fn", [1024], 1024, 1024, w_kmajor=False, out_dtype="bfloat16")
  assert 0 < nat.time_reduce(0, "float32", 4, 1024, 4096)
