"""The multi-GPU benchmark's baselines compute what the ops compute (CPU, 8 host devices).

benchmarks/bench_multi_gpu.py times hand-written programs against the fused ops: the ppermute
collective matmul and XLA's own (sharded jit) program. A wrong baseline would make every figure
in benchmarks/results/multi_gpu_* meaningless, so each is checked against the reference path.
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import _harness  # noqa: E402
import bench_multi_gpu as bench  # noqa: E402


def _f64(a):
  return np.asarray(a, np.float64)


@pytest.mark.parametrize("t", [2, 4, 8])
@pytest.mark.parametrize("op", bench.OPS)
def test_baselines_match_reference(op, t):
  mesh = bench.mesh_of(t)
  m, n, k = 16 * t, 24, 40
  x, w = bench.inputs(op, mesh, m, n, k)
  want = _f64(bench.jo_op(op, mesh, "xla")(x, w))
  assert want.shape == ((m, t * n) if op == "ag_matmul" else (m, n))
  scale = np.abs(want).max()
  for name, fn in (("ppermute", bench.ppermute_op(op, mesh)), ("xla_jit", jax.jit(bench.xla_jit_op(op, mesh)))):
    got = _f64(fn(x, w))
    assert got.shape == want.shape, name
    # bf16 inputs; partial sums rounded to bf16 between ring steps in the ppermute matmul_rs.
    assert np.abs(got - want).max() <= 2e-2 * scale, name


def test_received_bytes_and_unroll():
  assert bench.received_bytes("ag_matmul", 4, 1024, 3584, 8192) == 3 * 256 * 8192 * 2
  assert bench.received_bytes("matmul_rs", 2, 1024, 3584, 8192) == 1 * 512 * 3584 * 2
  assert bench.unroll_for(1024, 3584, 8192) == bench._harness.UNROLL
  assert bench.unroll_for(65536, 8192, 8192) == 2


def test_rows_resume(tmp_path):
  path = str(tmp_path / "rows.jsonl")
  assert bench.load_rows(path) == {}
  row = dict(op="ag_matmul", tp=2, m=1024, n=3584, k=8192, fused_us=1.5)
  bench.append_row(path, row)
  bench.append_row(path, dict(row, m=2048))
  rows = bench.load_rows(path)
  assert set(rows) == {("ag_matmul", 2, 1024, 3584, 8192), ("ag_matmul", 2, 2048, 3584, 8192)}
  assert rows[("ag_matmul", 2, 1024, 3584, 8192)]["fused_us"] == 1.5


def test_timeline_stats_counts_gpu_gaps_once():
  """Per-call kernel time, GPU span and idle gaps from a profile's events; host events and
  events overlapping a busy interval add no idle time."""
  meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
  x = lambda name, ts, dur, pid=1: {"ph": "X", "name": name, "pid": pid, "ts": ts, "dur": dur}
  events = meta + [x("void jo::ag_matmul_kernel<bf16>", 0, 100), x("host work", 40, 500, pid=2),
                   x("copy", 50, 10), x("MemcpyD2D", 103, 1), x("void jo::ag_matmul_kernel<bf16>", 108, 100),
                   x("MemcpyD2D", 210, 1)]
  stats = _harness.timeline_stats(events, unroll=2, kernel="jo::")
  # gaps 3 + 4 + 2 over 2 calls; the copies' 10 + 1 + 1 us over 2 calls
  assert stats == {"kernel_us": 100, "call_us": 105.5, "idle_us": 4.5, "other_us": 6}
  assert _harness.timeline_stats(events, unroll=2, kernel="cutlass") == {}


def test_timelines_in_turns_alternate_the_functions_and_take_medians(monkeypatch):
  order = []

  def fake_timeline(fn, *args, unroll, kernel):
    order.append(fn)
    return {"call_us": {"a": [5.0, 1.0, 3.0], "b": [9.0, 7.0, 8.0]}[fn][order.count(fn) - 1]}
  monkeypatch.setattr(_harness, "gpu_timeline", fake_timeline)
  got = _harness.gpu_timelines_in_turns({"op": "a", "xla": "b"}, rounds=3, unroll=2, kernel="k")
  assert order == ["a", "b"] * 3 and got == {"op": {"call_us": 3.0}, "xla": {"call_us": 8.0}}


def test_call_spans_split_back_to_back_calls():
  # Two calls 1 tick apart, tiles overlapping within each call, listed out of order.
  starts = np.array([0, 5, 2, 31, 30, 40])
  ends = np.array([10, 29, 20, 50, 45, 60])
  assert _harness.call_spans(starts, ends) == [29, 30]
  assert _harness.call_spans(starts[:3], ends[:3]) == [29]


def test_fp8_delayed_benchmark_variants_compute_the_same_layer():
  """benchmarks/bench_fp8_delayed.py: each variant's y within float8's error of the bf16 dot's, and the state the
  delayed layer's forward records equal to Flax's, bit for bit (the same amaxes and update rule)."""
  import jax.numpy as jnp
  import bench_fp8_delayed
  x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 256)), jnp.bfloat16)
  w = jnp.asarray(np.random.default_rng(1).standard_normal((256, 128)) / 16, jnp.bfloat16)
  state = bench_fp8_delayed._state(x, w)
  outs = {name: jax.jit(f)(x, w, state) for name, f in bench_fp8_delayed.variants().items()}
  want = _f64(outs["bf16"][0])
  for name, out in outs.items():
    assert np.linalg.norm(_f64(out[0]) - want) <= 0.1 * np.linalg.norm(want), name
  for a, b in zip(outs["delayed"][1:], outs["flax"][1:]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert len(outs["delayed"]) == len(outs["flax"]) == 5
