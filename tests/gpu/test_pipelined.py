"""The pipelined algorithm on one GPU: a group of one through JAX (the vendor GEMM), simulated ranks
(jax_overlap._native_testing.SimGroup: each rank its own workspace, stream and side streams, the production
schedule), and the schedule's one-GPU loopback. Outputs are poisoned with NaN before every call.

Simulated ranks share one CUDA context, whose streams share a bounded set of hardware queues: a rank's
spinning wait can sit in front of another rank's release in one queue until the watchdog fires (seen
on the H200: 6 and 7 of 24 stage-plan cases timed out in two runs, different ones each time, while the
same plans pass in processes of their own). So every stage plan is checked against float64 by
processes of their own (tests/gpu/multiprocess.py, "pipelined_stage_plans"), and the tests here are
those that passed in every run: slot reuse with ranks running ahead, bits, timeouts, call-site
mismatches."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_overlap as jo
from gpu_util import random, requires_gpu, vendor_gemm_runs
from tolerance import assert_close, rms
from jax_overlap.quantization import formats
from jax_overlap.runtime import native
import native_testing

harness = native_testing.module()

pytestmark = [pytest.mark.gpu, requires_gpu]

DTYPES = [jnp.bfloat16, jnp.float16]


def _mesh():
  return Mesh(np.array(jax.devices()[:1]), ("tp",))


def _dev(a):
  return jax.device_put(a, jax.devices()[0]).block_until_ready()


def _poisoned(shape, dtype):
  return jnp.full(shape, jnp.nan, dtype).block_until_ready()


def _ptr(a):
  return a.unsafe_buffer_pointer() if a is not None else 0


def _f64(a):
  return np.asarray(a, np.float64)


# --- a group of one: the vendor GEMM through JAX ------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,m,k,n", [((), 256, 512, 384), ((2, 3), 100, 1032, 264), ((), 1000, 8184, 3576)])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_group_of_one_is_the_vendor_gemm(dtype, lead, m, k, n, op):
  rng = np.random.default_rng(m + k + n)
  x, w, b = random(rng, (*lead, m, k), dtype), random(rng, (k, n), dtype, k ** -0.5), random(rng, (n,), dtype)
  fn = getattr(jo, op)
  none = [None] * len(lead)
  specs = (P(*none, "tp", None), P(None, "tp"), P("tp")) if op == "ag_matmul" else \
      (P(*none, None, "tp"), P("tp", None), P())
  f = jax.jit(jax.shard_map(lambda x, w, b: fn(x, w, b, axis_name="tp", algorithm="pipelined"), mesh=_mesh(),
                            in_specs=specs, out_specs=P(*none, None, "tp") if op == "ag_matmul" else
                            P(*none, "tp", None)))
  assert "jax_overlap_vendor_gemm" in f.lower(x, w, b).as_text()
  y = f(x, w, b)
  ref = _f64(x) @ _f64(w) + _f64(b)
  assert y.shape == ref.shape and y.dtype == dtype
  assert_close(y, ref, dtype, k, k ** -0.5)


def test_vendor_gemm_calls_sit_in_a_command_buffer_and_replay_right():
  """Six chained group-of-one calls: XLA records them into a command buffer (the handler runs under stream
  capture) and replays it; every step matches the rounded reference on every run."""
  rng = np.random.default_rng(8)
  x, w = random(rng, (1024, 1024), jnp.bfloat16), random(rng, (1024, 1024), jnp.bfloat16, 1 / 32)
  call = jax.shard_map(lambda x, w: jo.ag_matmul(x, w, axis_name="tp", algorithm="pipelined"), mesh=_mesh(),
                       in_specs=(P("tp", None), P()), out_specs=P("tp", None))
  chain = jax.jit(lambda x, w: [x := call(x, w) for _ in range(6)])
  assert "jax_overlap_vendor_gemm" in chain.lower(x, w).compile().as_text()
  want, cur = [], _f64(x)
  for _ in range(6):
    cur = _f64((cur @ _f64(w)).astype(np.float32).astype(jnp.bfloat16))
    want.append(cur)
  counts = []
  for run in range(3):
    outs = []
    counts.append(vendor_gemm_runs(lambda: outs.extend(jax.block_until_ready(chain(x, w)))))
    for step, (out, ref) in enumerate(zip(outs, want)):
      assert_close(out, ref, jnp.bfloat16, 1024, 1 / 32, f"run {run} step {step}")
  # Each run either ran the calls or recorded them (gpu_util.vendor_gemm_runs); some run recorded them all.
  assert all(runs <= 6 and captured in (0, runs) for runs, captured in counts), counts
  assert sum(captured for _, captured in counts) >= 6, counts


@pytest.mark.parametrize("dtype", DTYPES)
def test_mlp_forward_and_backward_pipelined_matches_xla(dtype):
  """Both ops pipelined, forward and backward (the backward runs each op with w transposed)."""
  rng = np.random.default_rng(9)
  x = random(rng, (2, 128, 256), dtype)
  params = (random(rng, (256, 512), dtype, 1 / 16), random(rng, (512,), dtype), random(rng, (512, 256), dtype, 1 / 22),
            random(rng, (256,), dtype))

  def loss(params, x, algorithm):
    def body(x, w1, b1, w2, b2):
      h = jax.nn.gelu(jo.ag_matmul(x, w1, b1, axis_name="tp", algorithm=algorithm))
      return jo.matmul_rs(h, w2, b2, axis_name="tp", algorithm=algorithm)
    y = jax.shard_map(body, mesh=_mesh(), in_specs=(P(None, "tp"), P(None, "tp"), P("tp"), P("tp", None), P()),
                      out_specs=P(None, "tp"))(x, *params)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  pipelined = jax.jit(jax.value_and_grad(lambda p, x: loss(p, x, "pipelined"), argnums=(0, 1)))
  xla = jax.jit(jax.value_and_grad(lambda p, x: loss(p, x, "xla"), argnums=(0, 1)))
  assert pipelined.lower(params, x).as_text().count("jax_overlap_vendor_gemm") >= 4
  (lp, gp), (lx, gx) = pipelined(params, x), xla(params, x)
  assert abs(float(lp) - float(lx)) <= 2e-2 * abs(float(lx))
  for a, b in zip(jax.tree.leaves(gp), jax.tree.leaves(gx)):  # three rounded stages, as in test_mlp
    assert_close(a, b, dtype, 1, 3 * rms(b))


# --- simulated ranks: the whole protocol on one GPU --------------------------------------------

def _group(world, watchdog=5.0):
  return harness.SimGroup(0, world, bytes_per_rank=512 << 20, watchdog_seconds=watchdog)


def _scratch(op, world, batch, m, n, dtype):
  partial_bytes = formats.partial(dtype).itemsize
  return _dev(jnp.zeros((native.module().pipelined_scratch_bytes(op, world, batch, m, n, partial_bytes),), jnp.uint8))


class Ranks:
  """One call's per-rank operands (device arrays) of either op, with the float64 reference."""

  def __init__(self, op, world, dtype, batch, m, k, n, rng, w_kmajor=False, bias=True):
    self.op, self.world, self.dtype, self.batch, self.m, self.k, self.n = op, world, dtype, batch, m, k, n
    self.w_kmajor = w_kmajor
    self.xs = [_dev(random(rng, (batch, m, k), dtype)) for _ in range(world)]
    self.w_host = [random(rng, (k, n), dtype, k ** -0.5) for _ in range(world)]
    self.ws = [_dev(w.T.copy() if w_kmajor else w) for w in self.w_host]
    self.bs = [_dev(random(rng, (n,), dtype)) if bias else None for _ in range(world)]
    self.scratch = [_scratch(op, world, batch, m, n, dtype) for _ in range(world)]
    self.poison()

  def poison(self):
    rows = self.world * self.m if self.op == "ag_matmul" else self.m // self.world
    self.outs = [_poisoned((self.batch, rows, self.n), self.dtype) for _ in range(self.world)]
    self.gathered = [_poisoned((self.batch, self.world * self.m, self.k), self.dtype) for _ in range(self.world)] \
        if self.op == "ag_matmul" else []

  def call(self, stages, **extra):
    return dict(dtype=np.dtype(self.dtype).name, tile=0, comm_workgroups=0, w_kmajor=self.w_kmajor, batch=self.batch,
                m=self.m, k=self.k, n=self.n, x=[_ptr(v) for v in self.xs], w=[_ptr(v) for v in self.ws],
                bias=[_ptr(v) for v in self.bs], out=[_ptr(v) for v in self.outs],
                gathered=[_ptr(v) for v in self.gathered], scratch=[_ptr(v) for v in self.scratch],
                stages=list(stages), **extra)

  def run(self, group, stages, **extra):
    method = group.pipelined_ag_matmul if self.op == "ag_matmul" else group.pipelined_matmul_rs
    method(self.call(stages, **extra))

  def reference(self, rank):
    bias = 0.0 if self.bs[rank] is None else _f64(self.bs[rank])
    if self.op == "ag_matmul":
      gathered = np.concatenate([_f64(x) for x in self.xs], axis=1)
      return gathered @ _f64(self.w_host[rank]) + bias
    total = sum(_f64(x) @ _f64(w) for x, w in zip(self.xs, self.w_host))
    rows = self.m // self.world
    return total[:, rank * rows:(rank + 1) * rows] + bias

  def assert_right(self, rank, what=""):
    """Rank `rank`'s output against the float64 reference: k terms (ag_matmul), world * k (matmul_rs)."""
    terms = self.k if self.op == "ag_matmul" else self.world * self.k
    assert_close(self.outs[rank], self.reference(rank), self.dtype, terms, self.k ** -0.5, f"{what} rank {rank}")

  def check(self, what=""):
    for r in range(self.world):
      self.assert_right(r, what)
      if self.op == "ag_matmul":
        np.testing.assert_array_equal(np.asarray(self.gathered[r]), np.concatenate(
            [np.asarray(x) for x in self.xs], axis=1), err_msg=f"{what} gathered of rank {r}")


@pytest.mark.parametrize("world", [2, 4, 8])
def test_matmul_rs_bits_repeat(world):
  rng = np.random.default_rng(30 + world)
  g = _group(world)
  ranks = Ranks("matmul_rs", world, jnp.bfloat16, 1, 64 * world, 512, 256, rng)
  ranks.run(g, (1,) * world)
  first = [np.asarray(o).view(np.uint16).copy() for o in ranks.outs]
  ranks.poison()
  ranks.run(g, (1,) * world)
  for a, b in zip(first, ranks.outs):
    np.testing.assert_array_equal(a, np.asarray(b).view(np.uint16))


@pytest.mark.parametrize("world", [2, 4, 8])
def test_matmul_rs_in_float16_keeps_partials_past_its_range(world):
  """Each rank's float16 partial is staged in float32 (core/dtype.h partial_dtype): partials past 65504 whose sum
  is in range give that sum, not inf (issue 52.4). Ranks 2j and 2j + 1 hold nearly opposite large x against
  nearly equal w."""
  rng = np.random.default_rng(90 + world)
  batch, m, k, n = 1, 32 * world, 64, 128
  ranks = Ranks("matmul_rs", world, jnp.float16, batch, m, k, n, rng, bias=False)
  big = rng.choice([-1.0, 1.0], size=(batch, m, k)) * rng.uniform(8000, 12000, size=(batch, m, k))
  w0 = rng.standard_normal((k, n))
  xs = [((1 if r % 2 == 0 else -1) * big + rng.standard_normal((batch, m, k))).astype(np.float16)
        for r in range(world)]
  ranks.w_host = [(w0 + 1e-2 * rng.standard_normal((k, n))).astype(np.float16) for _ in range(world)]
  ranks.xs, ranks.ws = [_dev(x) for x in xs], [_dev(w) for w in ranks.w_host]
  assert max(np.abs(x.astype(np.float64) @ w.astype(np.float64)).max() for x, w in zip(xs, ranks.w_host)) > 1.5 * 65504
  g = _group(world)
  ranks.run(g, (1,) * world)
  g.synchronize()
  assert not g.errors(), g.errors()
  for r in range(world):
    got, want = _f64(ranks.outs[r]), ranks.reference(r)
    assert np.abs(want).max() < 65504 / 4
    assert np.isfinite(got).all(), f"rank {r}: {np.count_nonzero(~np.isfinite(got))} non-finite elements"
    np.testing.assert_allclose(got, want, rtol=2 ** -10, atol=0.5, err_msg=f"rank {r}")


@pytest.mark.parametrize("origin", [0, 2 ** 32 - 3, 2 ** 32 - 1])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_ranks_running_calls_ahead_of_each_other(op, origin):
  """Ranks 1..3 enqueue five calls before rank 0 starts any, then rank 0 follows one call at a time: the
  ahead ranks wait on rank 0's flags, reuse slots only after its done flags, and every call is right.
  Also with the region's epochs counted from near 2^32 (issue 24, item 4): the calls cross the wrap of the
  flags' 32 epoch bits (from 2^32 - 3), or start on flags still zero with low epoch bits 0 (from 2^32 - 1).
  Before 64-bit host epochs, `epoch > 2` decided whether a slot had readers to wait for: from these origins
  the first calls waited for done flags of calls that never ran, until the watchdog."""
  world, calls = 4, 5
  rng = np.random.default_rng(40)
  g = _group(world, watchdog=30.0)
  g.set_epoch_origin(origin)
  batches = [Ranks(op, world, jnp.bfloat16, 1, 32 * world, 256, 128, rng) for _ in range(calls)]
  for ranks in batches:
    ranks.run(g, (1, 1, 2) if op == "ag_matmul" else (2, 2), ranks=[1, 2, 3], sync=False)
  for ranks in batches:
    time.sleep(0.02)
    ranks.run(g, (1, 1, 2) if op == "ag_matmul" else (2, 2), ranks=[0], sync=False)
  g.synchronize()
  assert g.errors() == []
  for i, ranks in enumerate(batches):
    ranks.check(f"call {i}")


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_absent_rank_times_out_and_poisons_every_output(op):
  world, watchdog = 4, 2.0
  rng = np.random.default_rng(50)
  g = _group(world, watchdog)
  g.set_absent(3)
  ranks = Ranks(op, world, jnp.bfloat16, 1, 32 * world, 256, 128, rng)
  # Valid-looking values first, so that an output left in place would show.
  ranks.outs = [_dev(jnp.ones(o.shape, o.dtype)) for o in ranks.outs]
  t0 = time.monotonic()
  ranks.run(g, (1,) * world)
  assert time.monotonic() - t0 < watchdog + 5.0
  errors = g.errors()
  assert len(errors) == world - 1 and all("waiting for rank 3" in e for e in errors), errors
  for r in range(world - 1):
    assert np.all(np.isnan(_f64(ranks.outs[r]))), r
    if op == "ag_matmul":
      assert np.all(np.isnan(_f64(ranks.gathered[r]))), r
  # A call queued behind the aborted one fails too: all NaN, at once.
  ranks.poison()
  ranks.outs = [_dev(jnp.ones(o.shape, o.dtype)) for o in ranks.outs]
  t0 = time.monotonic()
  ranks.run(g, (1,) * world)
  assert time.monotonic() - t0 < 2.0
  assert all(np.all(np.isnan(_f64(ranks.outs[r]))) for r in range(world - 1))
  # clear_errors puts every rank back in step: the next call is right.
  g.clear_errors()
  g.set_absent(-1)
  ranks.poison()
  ranks.run(g, (1,) * world)
  assert g.errors() == []
  ranks.check("after clear_errors")


@pytest.mark.parametrize("fault", ["pipelined_plan_fail", "pipelined_fail_after_release"])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_a_rank_that_cannot_enqueue_abandons_its_epoch(op, fault):
  """Issue 24, item 3: rank 1 of 2 cannot enqueue a call (fault injection: its vendor GEMM plans cannot be made,
  or a launch fails right after its first release to rank 0). Rank 1's call fails at once naming the cause; rank
  0's ends within seconds, not the 30 s watchdog, with NaN outputs and an error naming rank 1 (after a late
  failure it may also end right: rank 1's data was complete), never wrong; clear_errors() puts both back in
  step. Before, rank 1 made its plans while enqueuing, after taking its epoch, and rank 0 waited for the
  watchdog. Two calls run first, so the failing call's slots were used two calls ago: rank 1's abandon must not
  release its done flag for this epoch before rank 0 has waited for the one of two calls ago in the same word
  (before that fix rank 0 waited for its watchdog, in ag_matmul: seen on the H200)."""
  world, watchdog = 2, 30.0
  rng = np.random.default_rng(80)
  g = _group(world, watchdog)
  ranks = Ranks(op, world, jnp.bfloat16, 1, 64 * world, 256, 128, rng)
  stages = (1, 1)
  for _ in range(2):  # both parities' slots in use
    ranks.poison()
    ranks.run(g, stages)
  ranks.poison()
  harness.set_faults(f"{fault}=1")
  t0 = time.monotonic()
  try:
    with pytest.raises(RuntimeError, match=fault):
      ranks.run(g, stages)
    g.synchronize()
  finally:
    harness.set_faults("")
  assert time.monotonic() - t0 < 10.0
  errors = g.errors()
  assert any("rank 1 of 2 could not enqueue" in e for e in errors), errors
  if any("rank 0 of 2: rank 1 abandoned" in e for e in errors):
    assert np.all(np.isnan(_f64(ranks.outs[0])))
  else:
    assert fault == "pipelined_fail_after_release", errors
    ranks.assert_right(0)
  g.clear_errors()
  ranks.poison()
  ranks.run(g, stages)
  assert g.errors() == []
  ranks.check("after clear_errors")


def test_ranks_running_call_sites_in_different_orders_fail_loudly():
  """Two call sites share a region; rank 0 runs site 1 where rank 1 runs site 2: an error naming the
  call site, never each other's data."""
  world = 2
  rng = np.random.default_rng(60)
  g = _group(world, watchdog=5.0)
  ranks = Ranks("ag_matmul", world, jnp.bfloat16, 1, 64, 256, 128, rng)
  ranks.run(g, (1, 1), site=1, ranks=[0], sync=False)
  ranks.run(g, (1, 1), site=2, ranks=[1], sync=False)
  g.synchronize()
  errors = g.errors()
  assert errors and all("another call site" in e for e in errors), errors
  assert all(np.all(np.isnan(_f64(o))) for o in ranks.outs)


@pytest.mark.parametrize("timing", ["synced", "back_to_back", "enqueue"])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
@pytest.mark.parametrize("world", [2, 8])
def test_loopback_schedule_computes_the_op(op, world, timing):
  """The one-GPU benchmark's loopback: the real schedule with this rank's data standing in for every
  peer's, so ag_matmul gives [x; x; ...] @ w and matmul_rs world times its own block's partial, timed
  each way (calls one at a time, back to back, and the host's enqueue of calls back to back)."""
  rng = np.random.default_rng(70 + world)
  batch, m, k, n = 2, 64 * world, 512, 256
  dtype = jnp.bfloat16
  x, w, b = _dev(random(rng, (batch, m, k), dtype)), _dev(random(rng, (k, n), dtype, k ** -0.5)), \
      _dev(random(rng, (n,), dtype))
  rows = world * m if op == "ag_matmul" else m // world
  out = _poisoned((batch, rows, n), dtype)
  gathered = _poisoned((batch, world * m, k), dtype) if op == "ag_matmul" else None
  scratch = _dev(jnp.zeros((native.module().pipelined_scratch_bytes(op, world, batch, m, n, 2, True),), jnp.uint8))
  call = dict(dtype="bfloat16", x=_ptr(x), w=_ptr(w), bias=_ptr(b), out=_ptr(out), scratch=_ptr(scratch),
              batch=batch, m=m, k=k, n=n, w_kmajor=False, stages=[1, world - 1] if op == "ag_matmul" else [world])
  if gathered is not None:
    call["gathered"] = _ptr(gathered)
  if timing == "enqueue":
    us = harness.time_loopback_enqueue(0, op, world, call, 3)
  else:
    us = harness.time_loopback(0, op, world, call, 3, back_to_back=timing == "back_to_back")
  assert 0 < us < 1e6
  if op == "ag_matmul":
    ref = np.concatenate([_f64(x)] * world, axis=1) @ _f64(w) + _f64(b)
    np.testing.assert_array_equal(np.asarray(gathered), np.concatenate([np.asarray(x)] * world, axis=1))
  else:
    ref = world * (_f64(x)[:, :m // world] @ _f64(w)) + _f64(b)
  assert_close(out, ref, dtype, k if op == "ag_matmul" else world * k, k ** -0.5)


@pytest.mark.parametrize("warmup_ms", [0, 50])
def test_gemm_timings_for_the_cost_model(warmup_ms):
  t0 = time.monotonic()
  us = native.module().time_gemms(0, "bfloat16", [1024, 2048, 4096], 4096, 4096, warmup_ms=warmup_ms)
  assert len(us) == 3 and all(t > 0 for t in us) and us[0] < us[2]
  assert time.monotonic() - t0 >= warmup_ms / 1e3


def test_reduce_timing_for_the_cost_model():
  two, eight = (native.module().time_reduce(0, "bfloat16", count, 2048, 4096) for count in (2, 8))
  assert 0 < two < eight
  with pytest.raises(RuntimeError, match="1 to 8 partials"):
    native.module().time_reduce(0, "bfloat16", 9, 2048, 4096)
