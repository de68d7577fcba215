"""The figures measured for the cost models (planning/figures.py), with a stand-in for the GPU timings (no GPU)."""

import pytest

from jax_overlap.runtime import backend, workspace
from jax_overlap.ops import ag_matmul, matmul_rs
from jax_overlap.planning import figures, tuning
from jax_overlap.runtime import errors


class _Timings:
  """Stand-in timings: a GEMM takes as many us as it has rows; a reduction 42 us. `fail` makes the GEMM timing
  raise as the native module does when its buffers do not fit."""

  def __init__(self):
    self.reductions, self.gemms, self.types, self.fail = [], [], [], False

  def generation(self):
    return 1

  def time_gemms(self, ordinal, dtype, rows, n, k, w_kmajor, warmup_ms, candidates, margin, cache_dir, w_dtype=None,
                 out_dtype=None):
    assert warmup_ms == figures.GEMM_WARMUP_MS
    assert (candidates, margin, cache_dir) == tuple(tuning.options().values())  # timed as the calls will run
    self.gemms.append(tuple(rows))
    self.types.append((dtype, w_dtype, out_dtype))
    if self.fail:
      raise RuntimeError("time_gemms: out of memory")
    return [float(r) for r in rows]

  def time_reduce(self, ordinal, dtype, count, rows, n):
    self.reductions.append((dtype, count, rows, n))
    return 42.0


@pytest.fixture
def timings(monkeypatch):
  fake = _Timings()
  machine = backend.Backend(fake, "cuda")
  machine.state.link_bytes_per_us, machine.state.local_bytes_per_us = 3e5, 2e6  # as initialize() measures them
  monkeypatch.setattr(backend, "_current", machine)
  monkeypatch.setattr(workspace, "first_ordinal", lambda: 0)
  return fake


def test_matmul_rs_figures_carry_its_measured_reduction(timings):
  f = figures.measure(matmul_rs.OP, "bfloat16", 4096, 512, 256, 4, False)
  assert timings.reductions == [("bfloat16", 4, 1024, 256)]  # world blocks of rows / world rows each
  assert f.reduce_us == 42.0
  assert f.gemm_us == (1024.0, 2048.0, 3072.0, 4096.0)
  assert f.chunk_bytes == 1024 * 256 * 2 and f.link_bytes_per_us == 3e5 and f.local_bytes_per_us == 2e6


@pytest.mark.parametrize("dtype,gemm_out", [("float16", "float32"), ("bfloat16", None)])
def test_matmul_rs_times_gemms_writing_its_partials(timings, dtype, gemm_out):
  """A float16 result's partials are float32 (formats.partial): its GEMMs are timed writing those, and the
  chunks it moves are float32 ones; bfloat16 partials are the result's dtype."""
  f = figures.measure(matmul_rs.OP, dtype, 4096, 512, 256, 4, False)
  assert timings.types == [(dtype, gemm_out and dtype, gemm_out)]
  assert timings.reductions == [(dtype, 4, 1024, 256)]  # into the result's dtype
  assert f.chunk_bytes == 1024 * 256 * (4 if gemm_out else 2)
  figures.measure(ag_matmul.OP, dtype, 1024, 512, 384, 4, False)
  assert timings.types[1] == (dtype, None, None)  # a gather's GEMMs write its result


def test_ag_matmul_figures_have_no_reduction(timings):
  f = figures.measure(ag_matmul.OP, "bfloat16", 1024, 512, 256, 4, False)
  assert f.reduce_us is None and timings.reductions == []
  assert f.gemm_us == (1024.0, 2048.0, 3072.0, 4096.0) and f.chunk_bytes == 1024 * 512 * 2


def test_each_shape_is_measured_once(timings):
  for _ in range(3):
    figures.measure(matmul_rs.OP, "bfloat16", 4096, 512, 256, 4, False)
  figures.measure(matmul_rs.OP, "bfloat16", 4096, 512, 256, 2, False)
  assert timings.gemms == [(1024, 2048, 3072, 4096), (2048, 4096)] and len(timings.reductions) == 2


def test_a_failed_measurement_is_a_setup_error_and_is_not_tried_again(timings):
  """With several processes every process must see the same outcome: the failure, kept like a figure."""
  timings.fail = True
  for _ in range(2):
    with pytest.raises(errors.SetupError, match=r"gemm/bfloat16/1024x4/256/512/0: time_gemms: out of memory"):
      figures.measure(ag_matmul.OP, "bfloat16", 1024, 512, 256, 4, False)
  assert len(timings.gemms) == 1


def test_figures_say_where_the_copies_run(timings):
  # Before initialize() chose the copy path: the copy engine's, across GPUs; on NVIDIA a copy within the GPU (the
  # publish) still runs on the SMs.
  f = figures.measure(ag_matmul.OP, "bfloat16", 1024, 512, 256, 4, False)
  assert (f.publish_on_sms, f.pulls_on_sms) == (True, False)
  backend.current().state.copies_on_sms = (True, True)  # as initialize() records the kernel path
  g = figures.measure(ag_matmul.OP, "bfloat16", 1024, 512, 256, 4, False)
  assert (g.publish_on_sms, g.pulls_on_sms) == (True, True)


@pytest.mark.parametrize("platform, path, shares_gpu, want", [
    ("cuda", "copy_engine", False, (True, False)),
    ("cuda", "copy_engine", True, (True, True)),  # ranks on one GPU: a pull is a copy within it
    ("cuda", "kernel", False, (True, True)),
    ("rocm", "copy_engine", False, (False, False)),  # SDMA
    ("rocm", "copy_engine", True, (False, False)),
    ("rocm", "device_to_device", False, (True, True)),  # large plain copies run as a blit kernel (#11450)
    ("rocm", "kernel", False, (True, True)),
])
def test_where_each_copy_path_runs_its_copies(monkeypatch, platform, path, shares_gpu, want):
  monkeypatch.setattr(backend, "_current", backend.Backend(_Timings(), platform))
  assert workspace._copies_on_sms(path, shares_gpu) == want
