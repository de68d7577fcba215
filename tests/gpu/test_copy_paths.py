"""The pipelined algorithm's copy paths and its vendor GEMM's capture check on one GPU, with the fallbacks
run through fault injection (csrc/runtime/faults.h; jax_overlap._native_testing.set_faults):

  copy_selftest_engine_fails, copy_selftest_d2d_fails, copy_selftest_kernel_fails
      initialize()'s self-test sees the bytes of that copy path not land (csrc/pipelined/copy.h)
  copy_selftest_stalls
      the self-test's wait gives up at once, as on a copy engine that never finishes
  copy_max_bytes=N
      every copy splits at N bytes instead of 128 MiB
  capture_check_fails
      the vendor GEMM's graph-capture check sees its replays leave the output unwritten (csrc/blas/capture_check.h)

The peers of other processes are in the multi-process scenario "copy_paths" (tests/gpu/scenarios/); the
split's plan, which needs no GPU, in tests/test_copy_split.py.
"""

from __future__ import annotations

import logging
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_overlap as jo
from gpu_util import random, requires_gpu, vendor_gemm_runs
from tolerance import assert_close
from jax_overlap.runtime import native
import native_testing

nat = native.module()
harness = native_testing.module()

PATHS = ["copy_engine", "device_to_device", "kernel"]
# The faults under which initialize() must take each path.
FALLBACKS = {"copy_engine": "", "device_to_device": "copy_selftest_engine_fails",
             "kernel": "copy_selftest_engine_fails,copy_selftest_d2d_fails"}
INFO = "moves the pipelined algorithm's bytes"


# --- the copy paths on the GPU -------------------------------------------------------------------

@pytest.fixture
def faults():
  """set(spec) for the test; afterwards no faults, and no runtime or compiled call made under them."""
  yield harness.set_faults
  harness.set_faults("")
  jo.shutdown()
  jax.clear_caches()


def _dev(a):
  return jax.device_put(a, jax.devices()[0]).block_until_ready()


def _ptr(a):
  return a.unsafe_buffer_pointer()


def _f64(a):
  return np.asarray(a, np.float64)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("max_bytes", [0, 64])
@pytest.mark.parametrize("dst_off,src_off,width,height,dst_pitch,src_pitch", [
    (0, 0, 4096, 1, 4096, 4096),           # one contiguous copy
    (16, 32, 3120, 6, 3136, 5120),         # rows at two pitches, 16-byte aligned (the schedule's batched pulls)
    (3, 5, 1001, 7, 1013, 1100),           # odd everything: the copy kernel's byte path
    (1, 0, 17, 1, 17, 17),
    (0, 0, (1 << 20) + 48, 3, (1 << 20) + 64, (1 << 20) + 96)])
@pytest.mark.gpu
@requires_gpu
def test_every_path_copies_any_rows(path, max_bytes, dst_off, src_off, width, height, dst_pitch, src_pitch):
  rng = np.random.default_rng(width + height)
  src_host = rng.integers(0, 256, src_off + (height - 1) * src_pitch + width + 64, np.uint8)
  dst_bytes = dst_off + (height - 1) * dst_pitch + width + 64
  src, dst = _dev(src_host), jnp.full((dst_bytes,), 0xA4, jnp.uint8).block_until_ready()
  harness.copy_2d(0, path, _ptr(dst) + dst_off, dst_pitch, _ptr(src) + src_off, src_pitch, width, height, max_bytes)
  want = np.full(dst_bytes, 0xA4, np.uint8)
  for r in range(height):
    want[dst_off + r * dst_pitch:dst_off + r * dst_pitch + width] = \
        src_host[src_off + r * src_pitch:src_off + r * src_pitch + width]
  np.testing.assert_array_equal(np.asarray(dst), want)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.gpu
@requires_gpu
def test_initialize_takes_the_first_copy_path_whose_bytes_land(faults, caplog, path):
  faults(FALLBACKS[path])
  jo.shutdown()
  with caplog.at_level(logging.INFO, logger="jax_overlap"):
    jo.initialize()
  assert harness.copy_path(0) == path
  said = [r.getMessage() for r in caplog.records if INFO in r.getMessage()]
  if path == "copy_engine":
    assert said == []
  else:  # one line, naming the path taken and why each earlier one was not
    assert len(said) == 1 and "did not land" in said[0], said
    assert said[0].count("failed its self-test") == PATHS.index(path), said


@pytest.mark.gpu
@requires_gpu
def test_initialize_fails_when_no_copy_path_moves_bytes(faults):
  faults("copy_selftest_engine_fails,copy_selftest_d2d_fails,copy_selftest_kernel_fails")
  jo.shutdown()
  with pytest.raises(RuntimeError, match="no copy path moves bytes right on GPU 0") as e:
    jo.initialize()
  assert str(e.value).count("failed its self-test") == 3, str(e.value)
  assert all(what in str(e.value) for what in ("copy engine", "device-to-device", "copy kernel")), str(e.value)
  assert harness.copy_path(0) is None and not jo.workspace_info()["active"]


@pytest.mark.gpu
@requires_gpu
def test_a_stalled_copy_self_test_fails_initialize_instead_of_hanging(faults):
  faults("copy_selftest_stalls")
  jo.shutdown()
  t0 = time.monotonic()
  with pytest.raises(RuntimeError, match="did not finish within the watchdog's"):
    jo.initialize()
  assert time.monotonic() - t0 < 60
  assert harness.copy_path(0) is None and not jo.workspace_info()["active"]


def _loopback(op, path, world, batch, m, k, n, seed):
  """One loopback call of the op's schedule (rank 0 of `world`, its own data standing in for the peers') on
  copy path `path` (None: the GPU's verified one); returns (out, gathered) and the float64 reference."""
  rng = np.random.default_rng(seed)
  dtype = jnp.bfloat16
  x, w, b = _dev(random(rng, (batch, m, k), dtype)), _dev(random(rng, (k, n), dtype, k ** -0.5)), \
      _dev(random(rng, (n,), dtype))
  rows = world * m if op == "ag_matmul" else m // world
  out = _dev(jnp.full((batch, rows, n), jnp.nan, dtype))
  gathered = _dev(jnp.full((batch, world * m, k), jnp.nan, dtype)) if op == "ag_matmul" else None
  scratch = _dev(jnp.zeros((nat.pipelined_scratch_bytes(op, world, batch, m, n, 2, True),), jnp.uint8))
  call = dict(dtype="bfloat16", x=_ptr(x), w=_ptr(w), bias=_ptr(b), out=_ptr(out), scratch=_ptr(scratch),
              batch=batch, m=m, k=k, n=n, w_kmajor=False, stages=[1, world - 1] if op == "ag_matmul" else [world])
  if gathered is not None:
    call["gathered"] = _ptr(gathered)
  harness.time_loopback(0, op, world, call, 1, path)
  if op == "ag_matmul":
    ref = np.concatenate([_f64(x)] * world, axis=1) @ _f64(w) + _f64(b)
    np.testing.assert_array_equal(np.asarray(gathered), np.concatenate([np.asarray(x)] * world, axis=1))
  else:
    ref = world * (_f64(x)[:, :m // world] @ _f64(w)) + _f64(b)
  return (np.asarray(out), None if gathered is None else np.asarray(gathered)), ref


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
@pytest.mark.gpu
@requires_gpu
def test_the_schedule_on_each_path_is_right_and_split_changes_no_bit(faults, path, op):
  """The schedule's copies (x into its slot, the pulls as pitched rows of a batch, the own rows) on `path`, in
  loopback on this GPU; then split at 4 KiB, the same bits."""
  world, batch, m, k, n = 4, 3, 72, 264, 136
  (out, gathered), ref = _loopback(op, path, world, batch, m, k, n, seed=len(path) + len(op))
  assert_close(out, ref, jnp.bfloat16, k if op == "ag_matmul" else world * k, k ** -0.5)
  faults("copy_max_bytes=4096")
  row_bytes = (m if op == "ag_matmul" else m // world) * (k if op == "ag_matmul" else n) * 2
  assert len(harness.copy_pieces(row_bytes, batch, harness.max_copy_bytes())) > batch  # each batch element in pieces
  (split_out, split_gathered), _ = _loopback(op, path, world, batch, m, k, n, seed=len(path) + len(op))
  np.testing.assert_array_equal(split_out.view(np.uint16), out.view(np.uint16))
  if gathered is not None:
    np.testing.assert_array_equal(split_gathered.view(np.uint16), gathered.view(np.uint16))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.gpu
@requires_gpu
def test_the_schedule_takes_the_verified_path(faults, path):
  """With no path named, the loopback schedule (like every pipelined call) copies on the path initialize()
  verified: right results on each fallback."""
  faults(FALLBACKS[path])
  jo.shutdown()
  jo.initialize()
  assert harness.copy_path(0) == path
  for op in ("ag_matmul", "matmul_rs"):
    (out, _), ref = _loopback(op, None, 2, 2, 64, 256, 128, seed=3)
    assert_close(out, ref, jnp.bfloat16, 256 if op == "ag_matmul" else 2 * 256, 256 ** -0.5, op)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.gpu
@requires_gpu
def test_copy_timings_on_each_path(path):
  one = nat.time_copy(0, 0, 64 << 20, 3, path)
  pieces = nat.time_copy(0, 0, 64 << 20, 3, path, 4 << 20)
  assert one > 0 and pieces > 0


# --- the vendor GEMM's capture check ---------------------------------------------------------------

def _vendor_chain():
  """Six chained group-of-one pipelined calls: the vendor GEMM, in a command buffer where its check passed."""
  mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
  call = jax.shard_map(lambda x, w: jo.ag_matmul(x, w, axis_name="tp", algorithm="pipelined"), mesh=mesh,
                       in_specs=(P("tp", None), P()), out_specs=P("tp", None))
  return jax.jit(lambda x, w: [x := call(x, w) for _ in range(6)])


def _targets(compiled: str) -> set:
  return set(re.findall(r'custom_call_target="(jax_overlap_[a-z_]+)"', compiled))


def _check_chain(chain, x, w) -> tuple[int, int]:
  """Runs the chain twice against the rounded reference: (vendor_gemm executions, those under capture)."""
  want, cur = [], _f64(x)
  for _ in range(6):
    cur = _f64((cur @ _f64(w)).astype(np.float32).astype(jnp.bfloat16))
    want.append(cur)

  def runs():
    for run in range(2):
      for step, (out, ref) in enumerate(zip(chain(x, w), want)):
        assert_close(out, ref, jnp.bfloat16, 1024, 1 / 32, f"run {run} step {step}")
  return vendor_gemm_runs(runs)


@pytest.mark.gpu
@requires_gpu
def test_the_vendor_gemm_passes_its_capture_check_here():
  check = nat.prepare_vendor_blas(0)
  assert check["graph_safe"], check["detail"]
  assert nat.vendor_gemm_graph_safe()


@pytest.mark.gpu
@requires_gpu
def test_a_failed_capture_check_keeps_the_vendor_gemm_out_of_command_buffers(faults, caplog):
  rng = np.random.default_rng(8)
  x, w = random(rng, (1024, 1024), jnp.bfloat16), random(rng, (1024, 1024), jnp.bfloat16, 1 / 32)
  faults("capture_check_fails")
  jax.clear_caches()
  with caplog.at_level(logging.INFO, logger="jax_overlap"):
    chain = _vendor_chain()
    compiled = chain.lower(x, w).compile().as_text()
  said = [r.getMessage() for r in caplog.records if "graph-capture check" in r.getMessage()]
  assert len(said) == 1 and "replay 1 of the captured GEMM left" in said[0], said
  assert not nat.vendor_gemm_graph_safe()
  assert _targets(compiled) == {"jax_overlap_vendor_gemm_no_graph"}
  assert _check_chain(chain, x, w) == (12, 0)  # dispatched by XLA on both runs, never captured
  # The check passes again without the fault: calls compiled then go back into command buffers.
  faults("")
  jax.clear_caches()
  chain = _vendor_chain()
  compiled = chain.lower(x, w).compile().as_text()
  assert _targets(compiled) == {"jax_overlap_vendor_gemm"}
  runs, captured = _check_chain(chain, x, w)
  assert captured >= 6 and runs <= 12, (runs, captured)  # recorded into a command buffer (gpu_util.vendor_gemm_runs)
