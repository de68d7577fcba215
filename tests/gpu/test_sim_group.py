"""The cross-GPU protocol with N simulated ranks on one GPU in one process.

Each rank has its own workspace and stream (jax_overlap._native_testing.SimGroup); the
kernels are the production ones. Outputs are poisoned with NaN before every
call, so an element a kernel forgets to write fails the comparison.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpu_util import random, requires_gpu
from tolerance import assert_close
import native_testing
from jax_overlap.runtime import backend

harness = native_testing.module()

pytestmark = [pytest.mark.gpu, requires_gpu]

WORLDS = [2, 4, 8]


def _group(world, watchdog=5.0):
  return harness.SimGroup(0, world, bytes_per_rank=512 << 20, watchdog_seconds=watchdog)


def _dev(a):
  return jax.device_put(a, jax.devices()[0]).block_until_ready()


def _poisoned(shape, dtype):
  return jnp.full(shape, jnp.nan, dtype).block_until_ready()


def _bk(tile):
  return next(t.bk for t in backend.current().compiled_tile_shapes() if t.index == tile)


def _ptr(a):
  return a.unsafe_buffer_pointer() if a is not None else 0


def _gather(xs):
  return np.concatenate([np.asarray(x, np.float64) for x in xs], axis=-2)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_all_gather(world, dtype):
  rng = np.random.default_rng(world)
  xs = [_dev(random(rng, (2, 33, 200), dtype)) for _ in range(world)]
  outs = [_poisoned((2, 33 * world, 200), dtype) for _ in range(world)]
  g = _group(world)
  g.all_gather([_ptr(x) for x in xs], [_ptr(o) for o in outs], 2, 33, 200 * np.dtype(dtype).itemsize)
  assert g.errors() == []
  want = np.concatenate([np.asarray(x) for x in xs], axis=-2)
  for o in outs:
    np.testing.assert_array_equal(np.asarray(o), want)


def _ag_call(g, xs, ws, bs, ys, gs, *, batch, m, k, n, tile=0, workers=2, chunk_k=128, w_kmajor=False, **launch):
  """`launch`: SimMatmul's site, ranks and sync."""
  g.ag_matmul(dict(dtype=np.dtype(xs[0].dtype).name, tile=tile, comm_workgroups=workers, chunk_k=chunk_k,
                   w_kmajor=w_kmajor, batch=batch, m=m, k=k, n=n, x=[_ptr(v) for v in xs],
                   w=[_ptr(v) for v in ws], bias=[_ptr(v) for v in bs], out=[_ptr(v) for v in ys],
                   gathered=[_ptr(v) for v in gs], **launch))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("m,k,n,w_kmajor,tile", [(256, 512, 384, False, 0), (100, 1032, 264, False, 1),
                                                  (130, 520, 136, True, 0)])
def test_ag_matmul(world, dtype, m, k, n, w_kmajor, tile):
  rng = np.random.default_rng(m + k + world)
  batch = 2
  xs = [_dev(random(rng, (batch, m, k), dtype)) for _ in range(world)]
  ws_host = [random(rng, (k, n), dtype, k ** -0.5) for _ in range(world)]
  ws = [_dev(w.T.copy() if w_kmajor else w) for w in ws_host]
  bs = [_dev(random(rng, (n,), dtype)) for _ in range(world)]
  ys = [_poisoned((batch, world * m, n), dtype) for _ in range(world)]
  gs = [_poisoned((batch, world * m, k), dtype) for _ in range(world)]
  g = _group(world)
  _ag_call(g, xs, ws, bs, ys, gs, batch=batch, m=m, k=k, n=n, tile=tile, chunk_k=2 * _bk(tile), w_kmajor=w_kmajor)
  assert g.errors() == []
  gathered = _gather(xs)
  for r in range(world):
    np.testing.assert_array_equal(np.asarray(gs[r], np.float64), gathered)
    ref = gathered @ np.asarray(ws_host[r], np.float64) + np.asarray(bs[r], np.float64)
    assert_close(ys[r], ref, dtype, k, k ** -0.5, f"rank {r}")


def _rs_call(g, xs, ws, bs, outs, *, batch, m, k, n, tile=0, workers=2, w_kmajor=False, **launch):
  g.matmul_rs(dict(dtype=np.dtype(xs[0].dtype).name, tile=tile, comm_workgroups=workers, w_kmajor=w_kmajor,
                   batch=batch, m=m, k=k, n=n, x=[_ptr(v) for v in xs], w=[_ptr(v) for v in ws], bias=[_ptr(v) for v in bs],
                   out=[_ptr(v) for v in outs], **launch))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("mb,k,n,w_kmajor,tile", [(256, 512, 384, False, 0), (100, 264, 1032, False, 1),
                                                   (130, 136, 520, True, 0)])
def test_matmul_rs(world, dtype, mb, k, n, w_kmajor, tile):
  """mb rows per rank's block (not a tile multiple in two cases); bitwise-identical repeats."""
  rng = np.random.default_rng(mb + n + world)
  batch, m = 2, mb * world
  xs = [_dev(random(rng, (batch, m, k), dtype)) for _ in range(world)]
  ws_host = [random(rng, (k, n), dtype, k ** -0.5) for _ in range(world)]
  ws = [_dev(w.T.copy() if w_kmajor else w) for w in ws_host]
  b = random(rng, (n,), dtype)
  bs = [_dev(b) for _ in range(world)]
  g = _group(world)
  results = []
  for _ in range(3):
    outs = [_poisoned((batch, mb, n), dtype) for _ in range(world)]
    _rs_call(g, xs, ws, bs, outs, batch=batch, m=m, k=k, n=n, tile=tile, w_kmajor=w_kmajor)
    assert g.errors() == []
    results.append([np.asarray(o) for o in outs])
  total = sum(np.asarray(x, np.float64) @ np.asarray(w, np.float64) for x, w in zip(xs, ws_host))
  for r in range(world):
    ref = total[:, r * mb:(r + 1) * mb] + np.asarray(b, np.float64)
    # Partials are rounded to dtype before the fp32 sum, as in XLA's reference path: world * k terms.
    assert_close(results[0][r], ref, dtype, world * k, k ** -0.5, f"rank {r}")
    for again in results[1:]:
      np.testing.assert_array_equal(again[r].view(np.uint16), results[0][r].view(np.uint16))


# World 1 runs the plain GEMM (gemm::plain_gemm): rows and columns give every
# workgroup 2-3 tiles (edge tiles among them); k covers fewer k-tiles than the
# pipeline has stages in flight (1 for tile 0, 2 for tile 1), exactly that many
# (tile 1: 3), a partial last k-tile, and many.
@pytest.mark.parametrize("tile,k", [(0, 64), (0, 136), (0, 1024), (1, 64), (1, 96), (1, 1000)])
@pytest.mark.parametrize("w_kmajor", [False, True])
def test_world1_workgroups_run_several_tiles(tile, k, w_kmajor):
  dtype, batch, m, n = jnp.bfloat16, 2, 2000, 2056
  rng = np.random.default_rng(k + tile)
  x = _dev(random(rng, (batch, m, k), dtype))
  w_host = random(rng, (k, n), dtype, k ** -0.5)
  w = _dev(w_host.T.copy() if w_kmajor else w_host)
  b = _dev(random(rng, (n,), dtype))
  ref = np.asarray(x, np.float64) @ np.asarray(w_host, np.float64) + np.asarray(b, np.float64)
  g = _group(1)
  results = []
  for op in ("ag", "rs", "ag"):
    y = _poisoned((batch, m, n), dtype)
    if op == "ag":
      _ag_call(g, [x], [w], [b], [y], [None], batch=batch, m=m, k=k, n=n, tile=tile, w_kmajor=w_kmajor,
               chunk_k=_bk(tile))
    else:
      _rs_call(g, [x], [w], [b], [y], batch=batch, m=m, k=k, n=n, tile=tile, w_kmajor=w_kmajor)
    assert g.errors() == []
    # Element by element: one k-tile taken from the wrong tile moves
    # single outputs far more than output rounding (2^-8 relative) does.
    assert_close(y, ref, dtype, k, k ** -0.5, op)
    results.append(np.asarray(y).view(np.uint16))
  # Both ops run the same GEMM at world 1: the same bits, call after call.
  for again in results[1:]:
    np.testing.assert_array_equal(again, results[0])


def test_many_epochs_without_corruption():
  """300 back-to-back calls per op on one group: slots alternate by epoch parity, flags never reset."""
  world, dtype, m, k, n = 4, jnp.bfloat16, 128, 256, 256
  rng = np.random.default_rng(11)
  g = _group(world)
  ws_host = [random(rng, (k, n), dtype, 1 / 16) for _ in range(world)]
  ws = [_dev(w) for w in ws_host]
  for step in range(300):
    xs = [_dev(random(rng, (1, m, k), dtype)) for _ in range(world)]
    ys = [_poisoned((1, world * m, n), dtype) for _ in range(world)]
    gs = [_poisoned((1, world * m, k), dtype) for _ in range(world)]
    _ag_call(g, xs, ws, [None] * world, ys, gs, batch=1, m=m, k=k, n=n)
    if step % 50 == 49 or step < 3:
      gathered = _gather(xs)
      for r in range(world):
        np.testing.assert_array_equal(np.asarray(gs[r], np.float64), gathered)
        assert_close(ys[r], gathered @ np.asarray(ws_host[r], np.float64), dtype, k, 1 / 16, f"step {step}")
  assert g.errors() == []


def test_absent_rank_times_out_instead_of_hanging():
  world, watchdog = 4, 1.0
  g = _group(world, watchdog=watchdog)
  g.set_absent(3)
  rng = np.random.default_rng(2)
  xs = [_dev(random(rng, (1, 64, 256), jnp.bfloat16)) for _ in range(world)]
  outs = [_poisoned((1, 64 * world, 256), jnp.bfloat16) for _ in range(world)]
  t0 = time.monotonic()
  g.all_gather([_ptr(x) for x in xs], [_ptr(o) for o in outs], 1, 64, 512)
  elapsed = time.monotonic() - t0
  errors = g.errors()
  assert len(errors) == world - 1, errors
  assert all("waiting for rank 3" in e and "all_gather" in e for e in errors), errors
  assert elapsed < watchdog + 5.0

  # Cleared, the group's next call runs in full: the abort flag the timeout set is
  # back to zero (a set flag makes every wait give up at once, leaving the poison).
  # Only one more call: the aborted epoch leaves rank 3's slot flags a call behind.
  g.clear_errors()
  g.set_absent(-1)
  assert g.errors() == []
  outs = [_poisoned((1, 64 * world, 256), jnp.bfloat16) for _ in range(world)]
  g.all_gather([_ptr(x) for x in xs], [_ptr(o) for o in outs], 1, 64, 512)
  assert g.errors() == []
  gathered = np.concatenate([np.asarray(x, np.float64) for x in xs], axis=1)
  for o in outs:
    np.testing.assert_array_equal(np.asarray(o, np.float64), gathered)


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_ranks_running_call_sites_in_different_orders_fail_loudly(op):
  """Two call sites share a region and rank 0 runs site 1 where rank 1 runs site 2, at the same epoch:
  both ranks record an error naming the call site at once (no watchdog wait) instead of using the other
  call's data; put back in step, the next call is right."""
  world, dtype, m, k, n = 2, jnp.bfloat16, 128, 256, 256
  rng = np.random.default_rng(61)
  g = _group(world, watchdog=60.0)
  rows = m if op == "ag_matmul" else m * world
  xs = [_dev(random(rng, (1, rows, k), dtype)) for _ in range(world)]
  ws_host = [random(rng, (k, n), dtype, k ** -0.5) for _ in range(world)]
  ws = [_dev(w) for w in ws_host]

  def call(**launch):
    ys = [_poisoned((1, m * world if op == "ag_matmul" else m, n), dtype) for _ in range(world)]
    if op == "ag_matmul":
      gs = [_poisoned((1, m * world, k), dtype) for _ in range(world)]
      _ag_call(g, xs, ws, [None] * world, ys, gs, batch=1, m=m, k=k, n=n, **launch)
    else:
      _rs_call(g, xs, ws, [None] * world, ys, batch=1, m=rows, k=k, n=n, **launch)
    return ys

  t0 = time.monotonic()
  call(site=1, ranks=[0], sync=False)
  call(site=2, ranks=[1], sync=False)
  g.synchronize()
  assert time.monotonic() - t0 < 30.0
  errors = g.errors()
  assert len(errors) == world and all("another call site" in e for e in errors), errors

  g.clear_errors()
  ys = call(site=2)
  assert g.errors() == []
  if op == "ag_matmul":
    want = [_gather(xs) @ np.asarray(w, np.float64) for w in ws_host]
  else:
    total = sum(np.asarray(x, np.float64) @ np.asarray(w, np.float64) for x, w in zip(xs, ws_host))
    want = [total[:, r * m:(r + 1) * m] for r in range(world)]
  terms = k if op == "ag_matmul" else world * k
  for r in range(world):
    assert_close(ys[r], want[r], dtype, terms, k ** -0.5, f"rank {r}")


@pytest.mark.parametrize("origin", [2 ** 16 - 4, 2 ** 32 - 4, 2 ** 32 - 1])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_fused_epochs_across_the_wrap(op, origin):
  """Issue 24, item 4: the region's epochs counted from near a wrap of the fused flags' 16 epoch bits (2^16 - 4;
  2^32 - 4 wraps the host's old 32-bit counter too), or from 2^32 - 1, whose first call has low epoch bits 0 on
  flags still zero (a zero flag must never read as a release). Eight calls, each on new inputs and checked.
  Before 64-bit host epochs, `epoch > 2` decided whether a slot had readers to wait for: from these origins the
  first call waited for done flags of calls that never ran, until the watchdog."""
  world, dtype, m, k, n = 4, jnp.bfloat16, 128, 256, 256
  rng = np.random.default_rng(90)
  g = _group(world, watchdog=30.0)
  g.set_epoch_origin(origin)
  ws_host = [random(rng, (k, n), dtype, k ** -0.5) for _ in range(world)]
  ws = [_dev(w) for w in ws_host]
  for step in range(8):
    rows = m if op == "ag_matmul" else m * world
    xs = [_dev(random(rng, (1, rows, k), dtype)) for _ in range(world)]
    if op == "ag_matmul":
      ys = [_poisoned((1, world * m, n), dtype) for _ in range(world)]
      gs = [_poisoned((1, world * m, k), dtype) for _ in range(world)]
      _ag_call(g, xs, ws, [None] * world, ys, gs, batch=1, m=m, k=k, n=n)
      want = [_gather(xs) @ np.asarray(w, np.float64) for w in ws_host]
    else:
      ys = [_poisoned((1, m, n), dtype) for _ in range(world)]
      _rs_call(g, xs, ws, [None] * world, ys, batch=1, m=rows, k=k, n=n)
      total = sum(np.asarray(x, np.float64) @ np.asarray(w, np.float64) for x, w in zip(xs, ws_host))
      want = [total[:, r * m:(r + 1) * m] for r in range(world)]
    assert g.errors() == [], step
    for r in range(world):
      assert_close(ys[r], want[r], dtype, k if op == "ag_matmul" else world * k, k ** -0.5, f"step {step} rank {r}")
