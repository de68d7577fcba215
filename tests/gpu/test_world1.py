"""The FFI path on one GPU through JAX: world-1 fused calls, both layouts, tracing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_overlap as jo
from jax_overlap.runtime import backend
from gpu_util import random, requires_gpu
from tolerance import assert_close, rms, tolerances

pytestmark = [pytest.mark.gpu, requires_gpu]

DTYPES = [jnp.bfloat16, jnp.float16]
# (batch dims, rows, k, n): aligned, rows not a tile multiple, k not a multiple of BK.
SHAPES = [((), 256, 512, 384), ((2,), 100, 1032, 264), ((), 1000, 8184, 3576)]


def _mesh():
  return Mesh(np.array(jax.devices()[:1]), ("tp",))


def _hlo_targets(fn, *args) -> str:
  return fn.lower(*args).as_text()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,m,k,n", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_ag_matmul_fused(dtype, lead, m, k, n, with_bias):
  rng = np.random.default_rng(zlib.crc32(repr((lead, m, k, n, with_bias)).encode()))
  x, w = random(rng, (*lead, m, k), dtype), random(rng, (k, n), dtype, k ** -0.5)
  b = random(rng, (n,), dtype) if with_bias else None

  def body(x, w, b):
    return jo.ag_matmul(x, w, b, axis_name="tp", algorithm="fused", return_gathered=True)

  spec_x = P(*([None] * len(lead)), "tp", None)
  f = jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=(spec_x, P(None, "tp"), P("tp") if with_bias else None),
                            out_specs=(P(*([None] * len(lead)), None, "tp"), spec_x)))
  assert "jax_overlap_ag_matmul" in _hlo_targets(f, x, w, b)
  y, g = f(x, w, b)
  ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  if with_bias:
    ref = ref + np.asarray(b, np.float64)
  assert y.shape == ref.shape and y.dtype == dtype
  assert_close(y, ref, dtype, k, k ** -0.5)
  np.testing.assert_array_equal(np.asarray(g), np.asarray(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,m,k,n", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matmul_rs_fused(dtype, lead, m, k, n, with_bias):
  rng = np.random.default_rng(zlib.crc32(repr((lead, m, k, n, with_bias, "rs")).encode()))
  x, w = random(rng, (*lead, m, k), dtype), random(rng, (k, n), dtype, k ** -0.5)
  b = random(rng, (n,), dtype) if with_bias else None

  def body(x, w, b):
    return jo.matmul_rs(x, w, b, axis_name="tp", algorithm="fused")

  none = [None] * len(lead)
  f = jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=(P(*none, None, "tp"), P("tp", None), P() if with_bias else None),
                            out_specs=P(*none, "tp", None)))
  assert "jax_overlap_matmul_rs" in _hlo_targets(f, x, w, b)
  z = f(x, w, b)
  ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  if with_bias:
    ref = ref + np.asarray(b, np.float64)
  assert_close(z, ref, dtype, k, k ** -0.5)
  np.testing.assert_array_equal(np.asarray(f(x, w, b)).view(np.uint16), np.asarray(z).view(np.uint16))


def _tail_slots(f, *args) -> int:
  slots = [int(v) for v in re.findall(r"tail_slots = (\d+)", _hlo_targets(f, *args))]
  assert slots and slots[0] > 0, "this shape should take the stream-K tail on the GPU under test"
  return slots[0]


# 2048 x 3584 per call is 224 tiles of 128 x 256: on a GPU with fewer SMs (the
# H200 has 132) the call ends in the stream-K tail, tiles cut between two
# workgroups (csrc/gemm/tile_order.h TailSplit), at k = 512 into pieces of a
# few k-tiles. The bias must be added once.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
@pytest.mark.parametrize("k", [512, 3584])
def test_stream_k_tail_matches_reference_and_repeats_bits(dtype, op, k):
  m, n = 2048, 3584
  rng = np.random.default_rng(k + len(op))
  x, w, b = random(rng, (m, k), dtype), random(rng, (k, n), dtype, k ** -0.5), random(rng, (n,), dtype)
  fn = getattr(jo, op)
  f = jax.jit(jax.shard_map(lambda x, w, b: fn(x, w, b, axis_name="tp", algorithm="fused"), mesh=_mesh(),
                            in_specs=(P("tp"), P(), P()), out_specs=P("tp")))
  _tail_slots(f, x, w, b)
  y = f(x, w, b)
  ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64) + np.asarray(b, np.float64)
  # Element by element: a piece summed twice, lost, or read before it was
  # published moves whole tiles far beyond output rounding (2^-8 relative).
  assert_close(y, ref, dtype, k, k ** -0.5)
  for _ in range(3):
    np.testing.assert_array_equal(np.asarray(f(x, w, b)).view(np.uint16), np.asarray(y).view(np.uint16))


def test_stream_k_tail_chained_calls_on_fresh_data():
  """Six tail-taking calls in one program, run three times on new data. Their scratch is never
  cleared: a head that took a flag left by an earlier launch as its tail's would add that launch's
  partial sums, not this one's."""
  rng = np.random.default_rng(11)
  m, k, n = 2048, 512, 3584
  w = random(rng, (k, n), jnp.bfloat16, k ** -0.5)
  for op in (jo.ag_matmul, jo.matmul_rs):
    call = jax.shard_map(lambda x, w, op=op: op(x, w, axis_name="tp", algorithm="fused"), mesh=_mesh(),
                         in_specs=(P("tp"), P()), out_specs=P("tp"))
    chain = jax.jit(lambda xs, w: [call(x, w) for x in xs])
    for run in range(3):
      xs = [random(rng, (m, k), jnp.bfloat16) for _ in range(6)]
      if run == 0:
        _tail_slots(chain, xs, w)
      for step, (x, y) in enumerate(zip(xs, chain(xs, w))):
        ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        assert_close(y, ref, jnp.bfloat16, k, k ** -0.5, f"{op.__name__} run {run} call {step}")


# A group of one whose stream-K head cannot get its tail: rank 0 of a simulated pair whose rank 1
# never comes holds about half the SMs in its persistent kernel (for its 5 s watchdog), so the
# call's grid is not co-resident and a head waits for a workgroup that has not started, for about a
# workgroup's whole share (~100 us here). With a 20 us watchdog (far above the few-us skew of an
# unhindered launch) that wait is recorded: the output is NaN, the next call raises naming the
# stream-K tail, the GPU context lives on, and clear_errors() says to restart. (It used to trap,
# which ends the context.) Run in a process of its own, which is left with that error.
_TAIL_STALL = """
import json, os, re
os.environ.update(JAX_OVERLAP_WATCHDOG_SECONDS="2e-5", JAX_OVERLAP_ON_TIMEOUT="raise", JAX_PLATFORMS="cuda")
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import jax_overlap as jo
from jax_overlap import _native_testing

mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
f = jax.jit(jax.shard_map(lambda x, w: jo.ag_matmul(x, w, axis_name="tp", algorithm="fused"), mesh=mesh,
                          in_specs=(P("tp"), P()), out_specs=P("tp")))
rng = np.random.default_rng(5)
m, k, n = 2048, 3584, 3584
x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
w = jnp.asarray(rng.standard_normal((k, n)) / 60, jnp.bfloat16)
out = {"tail_slots": int(re.findall(r"tail_slots = (\\d+)", f.lower(x, w).as_text())[0]), "results": []}
out["unhindered_nan"] = bool(np.isnan(np.asarray(f(x, w), np.float32)).any())

g = _native_testing.SimGroup(0, 2, bytes_per_rank=256 << 20, watchdog_seconds=5.0)
g.set_absent(1)
held = [jnp.asarray(rng.standard_normal((1024, 4096)), jnp.bfloat16), jnp.zeros((4096, 512), jnp.bfloat16),
        jnp.zeros((2048, 512), jnp.bfloat16), jnp.zeros((2048, 4096), jnp.bfloat16)]
jax.block_until_ready(held)
ptrs = [a.unsafe_buffer_pointer() for a in held]
for attempt in range(5):
  g.ag_matmul(dict(dtype="bfloat16", tile=0, comm_workgroups=2, chunk_k=128, w_kmajor=False, batch=1, m=1024,
                   k=4096, n=512, x=[ptrs[0]] * 2, w=[ptrs[1]] * 2, bias=[0, 0], out=[ptrs[2]] * 2,
                   gathered=[ptrs[3]] * 2, ranks=[0], sync=False))
  try:
    y = np.asarray(f(x, w), np.float32)
    out["results"].append({"all_nan": bool(np.isnan(y).all()), "any_nan": bool(np.isnan(y).any())})
  except Exception as e:
    out["results"].append({"raised": str(e)})
  g.synchronize()
  g.clear_errors()
  if out["results"][-1] != {"all_nan": False, "any_nan": False}:
    break
try:
  f(x, w).block_until_ready()
  out["next_call"] = "returned"
except Exception as e:
  out["next_call"] = str(e)
out["context_alive"] = float(jnp.sum(x.astype(jnp.float32))) == float(np.asarray(x, np.float32).sum())
try:
  jo.clear_errors()
  out["clear_errors"] = "returned"
except Exception as e:
  out["clear_errors"] = str(e)
print(json.dumps(out))
"""


def test_a_stalled_stream_k_head_is_an_error_not_a_trap():
  # -P: the current directory does not go first on sys.path (from the repository root Python would import the
  # sources, which hold no native module, instead of the installed package).
  run = subprocess.run([sys.executable, "-P", "-c", _TAIL_STALL], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ))
  assert run.returncode == 0, run.stderr[-3000:]
  out = json.loads(run.stdout.strip().splitlines()[-1])
  assert out["tail_slots"] > 0, "this shape should take the stream-K tail on the GPU under test"
  assert not out["unhindered_nan"], out
  assert out["results"][-1].get("all_nan"), out  # the stalled call's output, NaN in full
  assert "stream-K tail piece" in out["next_call"], out
  assert out["context_alive"], out
  assert "restart the process" in out["clear_errors"], out


@pytest.mark.parametrize("dtype", DTYPES)
def test_mlp_grad_fused_matches_xla(dtype):
  """Forward and backward of a TP MLP: the fused kernels serve both passes (both w layouts)."""
  rng = np.random.default_rng(7)
  x = random(rng, (2, 128, 256), dtype)
  w1, w2 = random(rng, (256, 512), dtype, 1 / 16), random(rng, (512, 256), dtype, 1 / 22)
  b1, b2 = random(rng, (512,), dtype), random(rng, (256,), dtype)

  def loss(params, x, algorithm):
    w1, b1, w2, b2 = params

    def body(x, w1, b1, w2, b2):
      h = jax.nn.gelu(jo.ag_matmul(x, w1, b1, axis_name="tp", algorithm=algorithm))
      return jo.matmul_rs(h, w2, b2, axis_name="tp", algorithm=algorithm)

    y = jax.shard_map(body, mesh=_mesh(), in_specs=(P(None, "tp"), P(None, "tp"), P("tp"), P("tp", None), P()),
                      out_specs=P(None, "tp"))(x, w1, b1, w2, b2)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  params = (w1, b1, w2, b2)
  fused = jax.jit(jax.value_and_grad(lambda p, x: loss(p, x, "fused"), argnums=(0, 1)))
  xla = jax.jit(jax.value_and_grad(lambda p, x: loss(p, x, "xla"), argnums=(0, 1)))
  text = fused.lower(params, x).as_text()
  assert text.count("jax_overlap_ag_matmul") >= 2 and text.count("jax_overlap_matmul_rs") >= 2
  (lf, gf), (lx, gx) = fused(params, x), xla(params, x)
  assert abs(float(lf) - float(lx)) <= 2e-2 * abs(float(lx))
  for a, b in zip(jax.tree.leaves(gf), jax.tree.leaves(gx)):  # three rounded stages, as in test_mlp
    assert_close(a, b, dtype, 1, 3 * rms(b))


def test_global_mode_single_gpu_fused():
  rng = np.random.default_rng(3)
  x, w = random(rng, (512, 768), jnp.bfloat16), random(rng, (768, 1024), jnp.bfloat16, 1 / 28)
  f = jax.jit(lambda x, w: jo.ag_matmul(x, w, algorithm="fused"))
  assert "jax_overlap_ag_matmul" in f.lower(x, w).compile().as_text()
  assert_close(f(x, w), np.asarray(x, np.float64) @ np.asarray(w, np.float64), jnp.bfloat16, 768, 1 / 28)


def test_fused_refuses_float32_with_reason():
  x = jnp.ones((128, 128), jnp.float32)
  f = jax.jit(jax.shard_map(lambda x, w: jo.ag_matmul(x, w, axis_name="tp", algorithm="fused"), mesh=_mesh(),
                            in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")))
  with pytest.raises(ValueError, match="float32"):
    f.lower(x, x)


def test_trace_export(tmp_path):
  jo.initialize(trace=True)
  try:
    rng = np.random.default_rng(5)
    x, w = random(rng, (1024, 1024), jnp.bfloat16), random(rng, (1024, 1024), jnp.bfloat16, 1 / 32)
    f = jax.jit(jax.shard_map(lambda x, w: jo.matmul_rs(x, w, axis_name="tp", algorithm="fused"), mesh=_mesh(),
                              in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None)))
    f(x, w).block_until_ready()
    jo.tracing.export(str(tmp_path / "warm.json"))  # drop compile-time noise
    f(x, w).block_until_ready()
    split = jo.tracing.export(str(tmp_path / "trace.json"))
  finally:
    jo.initialize(trace=False)
  events = json.load(open(tmp_path / "trace.json"))["traceEvents"]
  tiles = [e for e in events if e["name"] == "gemm_tile"]
  # one event per output tile
  assert len(tiles) in {1024 * 1024 // (t.bm * t.bn) for t in backend.current().tile_shapes()}
  assert split["gemm_tile"] > 0 and all(e["dur"] >= 0 for e in events)


def test_chained_calls_match_a_rounded_reference():
  """Six world-1 calls in one program, run twice: each call's output must match x @ w rounded to
  bf16 at every step, on every run."""
  rng = np.random.default_rng(7)
  x, w = random(rng, (1024, 1024), jnp.bfloat16), random(rng, (1024, 1024), jnp.bfloat16, 1 / 32)
  for op in (jo.ag_matmul, jo.matmul_rs):
    call = jax.shard_map(lambda x, w, op=op: op(x, w, axis_name="tp", algorithm="fused"), mesh=_mesh(),
                         in_specs=(P("tp", None), P(None, None)), out_specs=P("tp", None))
    chain = jax.jit(lambda x, w: [x := call(x, w) for _ in range(6)])
    want, cur = [], np.asarray(x, np.float64)
    for _ in range(6):
      cur = np.asarray((cur @ np.asarray(w, np.float64)).astype(np.float32).astype(jnp.bfloat16), np.float64)
      want.append(cur)
    for run in range(2):
      for step, (out, ref) in enumerate(zip(chain(x, w), want)):
        assert_close(out, ref, jnp.bfloat16, 1024, 1 / 32, f"{op.__name__} run {run} step {step}")


def test_trace_switch_reaches_calls_compiled_before_it(tmp_path):
  """Tracing turned on after a program's first run must still reach its world-1 calls (their kernels
  read the switch from device memory, not from the launch), and turned off must silence them."""
  rng = np.random.default_rng(6)
  x, w = random(rng, (1024, 1024), jnp.bfloat16), random(rng, (1024, 1024), jnp.bfloat16, 1 / 32)
  op = jax.shard_map(lambda x, w: jo.matmul_rs(x, w, axis_name="tp", algorithm="fused"), mesh=_mesh(),
                     in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None))
  calls = 6

  @jax.jit
  def chain(x, w):
    for _ in range(calls):
      x = op(x, w)
    return x

  def gemm_tiles(name):
    chain(x, w).block_until_ready()
    jo.tracing.export(str(tmp_path / name))
    return [e for e in json.load(open(tmp_path / name))["traceEvents"] if e["name"] == "gemm_tile"]

  jo.initialize(trace=False)
  assert gemm_tiles("off_first.json") == []  # compiled and run with tracing off
  try:
    jo.initialize(trace=True)
    on = gemm_tiles("on.json")
  finally:
    jo.initialize(trace=False)
  assert len(on) in {calls * 1024 * 1024 // (t.bm * t.bn) for t in backend.current().tile_shapes()}
  assert gemm_tiles("off_again.json") == []


# Six chained world-1 fused calls of each op, run; then jax_overlap.shutdown() frees the GPU's device state
# (abort flag, error record, trace buffer) their launches hold. Run again, the compiled programs must refuse
# with the shutdown error, and still refuse after initialize() made new state; compiled again, they are right.
# (Their targets used to be command-buffer compatible: XLA replayed the recorded launches from its graph,
# reading freed memory, with no host check in the way.) In a process of its own: a replay that reads freed
# memory can end the GPU context.
_AFTER_SHUTDOWN = """
import json, os
os.environ.setdefault("JAX_PLATFORMS", "cuda")
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import jax_overlap as jo

mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
rng = np.random.default_rng(12)
x = jnp.asarray(rng.standard_normal((512, 1024)), jnp.bfloat16)
w = jnp.asarray(rng.standard_normal((1024, 1024)) / 32, jnp.bfloat16)
want, cur = [], np.asarray(x, np.float64)
for _ in range(6):
  cur = np.asarray((cur @ np.asarray(w, np.float64)).astype(np.float32).astype(jnp.bfloat16), np.float64)
  want.append(cur)


def chain(op):
  call = jax.shard_map(lambda x, w: getattr(jo, op)(x, w, axis_name="tp", algorithm="fused"), mesh=mesh,
                       in_specs=(P("tp", None), P()), out_specs=P("tp", None))
  return jax.jit(lambda x, w: [x := call(x, w) for _ in range(6)])


def worst(outs):  # the largest error of any step's element, as a share of its tolerance (RTOL, ATOL: the parent's)
  shares = [np.abs(np.asarray(out, np.float64) - ref) / (ATOL + RTOL * np.abs(ref)) for out, ref in zip(outs, want)]
  return max(float(np.max(s)) if np.all(np.isfinite(s)) else 1e30 for s in shares)


def attempt(f):
  try:
    return {"ran": True, "worst_share": worst(jax.block_until_ready(f(x, w)))}
  except Exception as e:
    return {"ran": False, "error": str(e)[:400]}


out = {}
for op in ("ag_matmul", "matmul_rs"):
  f = chain(op)
  out[op] = {"command_buffer": "command_buffer" in f.lower(x, w).compile().as_text(), "first": attempt(f)}
  jo.shutdown()
  out[op]["after_shutdown"] = attempt(f)
  jo.initialize()
  out[op]["after_initialize"] = attempt(f)
  jax.clear_caches()
  out[op]["recompiled"] = attempt(chain(op))
print(json.dumps(out))
"""


def test_fused_group_of_one_compiled_before_shutdown_refuses_to_run():
  tolerated = "RTOL, ATOL = {}, {}\n".format(*tolerances(jnp.bfloat16, 1024, 1 / 32))
  # -P: the installed package, as in test_a_stalled_stream_k_head_is_an_error_not_a_trap.
  run = subprocess.run([sys.executable, "-P", "-c", tolerated + _AFTER_SHUTDOWN], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ))
  assert run.returncode == 0, run.stderr[-3000:]
  out = json.loads(run.stdout.strip().splitlines()[-1])
  for op, r in out.items():
    assert r["first"]["ran"] and r["first"]["worst_share"] <= 1, (op, r)
    for stale in ("after_shutdown", "after_initialize"):
      assert not r[stale]["ran"] and "shutdown() freed" in r[stale]["error"], (op, stale, r)
    assert r["recompiled"]["ran"] and r["recompiled"]["worst_share"] <= 1, (op, r)
