"""The vendor GEMM's algorithms chosen by measurement (issue 39; planning/tuning.py, csrc/blas/gemm.h): which
problems a call tunes, with which settings, where the choice is installed; the problems' ids and the tuning
cache's file as the native module writes and reads them (host code, no GPU). The timing itself, the cache
between processes and the faults run on the GPU (tests/gpu/test_vendor_gemm.py)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap as jo
from jax_overlap.runtime import native, settings
from jax_overlap.planning import tuning

import native_testing
from fake_gpu import cuda_text

needs_native = pytest.mark.skipif(native.module() is None,
                                  reason="needs jax_overlap's native module (a pure-Python install has none)")


# --- settings ------------------------------------------------------------------------------------------------

def test_tuning_is_on_by_default_with_32_candidates(monkeypatch):
  for name in (settings.GEMM_TUNING, settings.GEMM_CANDIDATES, settings.GEMM_CACHE_DIR):
    monkeypatch.delenv(name, raising=False)
  assert settings.gemm_tuning() and settings.gemm_candidates() == 32 and settings.gemm_cache_dir() is None
  assert tuning.options() == {"candidates": 32, "margin": tuning.MARGIN, "cache_dir": ""}


def test_tuning_off_asks_for_one_candidate(monkeypatch):
  monkeypatch.setenv(settings.GEMM_TUNING, "0")
  monkeypatch.setenv(settings.GEMM_CANDIDATES, "8")
  assert not settings.gemm_tuning() and tuning.options()["candidates"] == 1


@pytest.mark.parametrize("name,value,expected", [
    (settings.GEMM_TUNING, "maybe", "is not a switch"),
    (settings.GEMM_CANDIDATES, "0", "1 or more"),
    (settings.GEMM_CANDIDATES, "many", "is not a number"),
])
def test_bad_tuning_settings_name_the_variable(monkeypatch, name, value, expected):
  monkeypatch.setenv(name, value)
  with pytest.raises(ValueError, match=f"{name}={value!r}.*{expected}"):
    settings.check_all()


# --- what a call tunes, and where it installs it ---------------------------------------------------------------

def _fp8_group_of_one(make_mesh, bias=False):
  mesh = make_mesh((1,), ("tp",))
  x = jax.ShapeDtypeStruct((2, 256, 512), jnp.float8_e4m3fn)
  w = jax.ShapeDtypeStruct((512, 384), jnp.float8_e4m3fn)
  b = jax.ShapeDtypeStruct((384,), jnp.bfloat16)
  s = jax.ShapeDtypeStruct((), jnp.float32)

  def body(x, w, b, sx, sw):
    return jo.ag_matmul(x, w, b if bias else None, x_scale=sx, w_scale=sw, out_dtype=jnp.bfloat16, axis_name="tp")
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), P("tp"), P(), P()),
                            out_specs=P(None, None, "tp")))
  return cuda_text(f, x, w, b, s, s)


def test_a_group_of_one_tunes_its_gemm_on_the_first_gpu_and_installs_it_on_every_gpu(fake, make_mesh, monkeypatch):
  monkeypatch.delenv(settings.GEMM_TUNING, raising=False)
  monkeypatch.setenv(settings.GEMM_CACHE_DIR, "/cache")
  assert "@jax_overlap_vendor_gemm" in _fp8_group_of_one(make_mesh)
  assert [(o, c, d) for o, _, c, d in fake.tuned] == [(0, 32, "/cache")]
  (_, pid, _, _), = fake.tuned
  # The batch folds into the rows (csrc/pipelined/schedule.h local_problem); no bias.
  assert pid == "ag_matmul;float8_e4m3fn;rows:512;k:512;n:384;bias:0"
  assert sorted(o for o, _, _ in fake.installed) == list(range(len(jax.devices())))
  assert {(p, c) for _, p, c in fake.installed} == {(pid, f"{len(pid):02x}" * 64)}


def test_a_gemm_that_adds_the_bias_is_another_problem(fake, make_mesh):
  _fp8_group_of_one(make_mesh, bias=True)
  assert [pid.endswith("bias:1") for _, pid, _, _ in fake.tuned] == [True]


def test_with_tuning_off_nothing_is_tuned_or_installed(fake, make_mesh, monkeypatch):
  monkeypatch.setenv(settings.GEMM_TUNING, "0")
  assert "@jax_overlap_vendor_gemm" in _fp8_group_of_one(make_mesh)
  assert fake.tuned == [] and fake.installed == []


def test_a_pipelined_call_tunes_its_stages_gemms_and_its_figures_are_the_tuned_ones(fake, make_mesh, monkeypatch):
  monkeypatch.setenv(settings.PIPELINE_STAGES, "1,2,1")
  mesh = make_mesh((4,), ("tp",))
  x = jax.ShapeDtypeStruct((4 * 4096, 8192), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((8192, 4 * 2048), jnp.bfloat16)
  f = jax.jit(jax.shard_map(lambda x, w: jo.ag_matmul(x, w, axis_name="tp", algorithm="pipelined"), mesh=mesh,
                            in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")))
  text = cuda_text(f, x, w)
  assert "@jax_overlap_ag_matmul_pipelined" in text
  assert fake.gemm_tuning and all(t == (32, tuning.MARGIN, "") for t in fake.gemm_tuning)
  want = fake.gemm_problems("ag_matmul", 4, {"dtype": "bfloat16", "batch": 1, "m": 4096, "k": 8192, "n": 2048,
                                             "bias": False, "stages": [1, 2, 1]}, 132)
  assert sorted(pid for _, pid, _, _ in fake.tuned) == sorted(want)


def test_a_tuning_that_cannot_plan_sends_auto_to_xla(fake, make_mesh):
  fake.fail = {"tune_gemm"}
  assert "@jax_overlap_vendor_gemm" not in _fp8_group_of_one(make_mesh)


# --- the native module's problems and cache file (host code) ----------------------------------------------------

def _call(**kw):
  call = dict(dtype="bfloat16", batch=1, m=1024, k=8192, n=3584, w_kmajor=False, bias=True, stages=[1, 3])
  call.update(kw)
  return call


def _fields(ids):
  return [native_testing.module().gemm_problem_fields(i) for i in ids]


@needs_native
def test_a_group_of_one_is_one_problem_its_batch_folded_into_its_rows():
  ids = native.module().gemm_problems("ag_matmul", 1, _call(batch=3, m=100, stages=[1]), 132)
  (p,) = _fields(ids)
  assert (p["rows"], p["batch"], p["ldx"], p["ldy"], p["bias"], p["alignment"]) == (300, 1, 8192, 3584, True, 256)


@needs_native
def test_ag_matmul_problems_cover_every_ranks_ranges():
  """Stages (1, 3) over 4 ranks: the own shard, then rank 0's three shards in one GEMM, but ranks 2 and 3's stage
  wraps past the last shard into two GEMMs (1 + 2 and 2 + 1 shards): 1, 3, 2 shards of 1024 rows."""
  rows = sorted(p["rows"] for p in _fields(native.module().gemm_problems("ag_matmul", 4, _call(), 132)))
  assert rows == [1024, 2048, 3072]


@needs_native
def test_float8_ag_matmul_runs_one_gemm_per_shard():
  ids = native.module().gemm_problems("ag_matmul", 8, _call(dtype="float8_e4m3fn", out_dtype="bfloat16",
                                                             w_kmajor=True, bias=False, stages=[1] * 8), 132)
  (p,) = _fields(ids)
  assert (p["rows"], p["scaled"], p["w_kmajor"]) == (1024, True, True)


@needs_native
def test_float8_shards_sharing_one_scale_take_a_stage_in_one_gemm():
  """x_scale_shared (every rank's x_scale the same): a stage's shards in one GEMM per range, as 16-bit shards, with
  the call's own x_scale; without it one GEMM per shard whatever the stages."""
  fp8 = dict(dtype="float8_e4m3fn", out_dtype="bfloat16", w_kmajor=True, bias=False)
  rows = lambda **kw: sorted(p["rows"] for p in _fields(  # noqa: E731
      native.module().gemm_problems("ag_matmul", 4, _call(**fp8, **kw), 132)))
  assert rows(x_scale_shared=True) == [1024, 2048, 3072]
  assert rows(x_scale_shared=False) == rows() == [1024]


@needs_native
def test_fast_accumulation_is_part_of_a_float8_problem():
  """Fast accumulation is another GEMM (another plan and tuned algorithm): its problem id says so, round trips,
  and only tensor-scaled float8 takes it."""
  nat, harness = native.module(), native_testing.module()
  fp8 = dict(dtype="float8_e4m3fn", out_dtype="bfloat16", w_kmajor=True, bias=False, stages=[1])
  (plain,) = nat.gemm_problems("ag_matmul", 1, _call(**fp8), 132)
  (fast,) = nat.gemm_problems("ag_matmul", 1, _call(**fp8, fast_accumulation=True), 132)
  assert plain != fast and harness.gemm_problem_fields(fast)["fast_accumulation"]
  assert not harness.gemm_problem_fields(plain)["fast_accumulation"]
  assert harness.gemm_problem_fields(fast)["id"] == fast
  assert "fast accumulation" in harness.describe_gemm_problem(fast)
  for bad in (_call(fast_accumulation=True, stages=[1]), _call(**fp8, blocks=True, fast_accumulation=True)):
    with pytest.raises(ValueError, match="fast accumulation takes tensor-scaled float8"):
      nat.gemm_problems("ag_matmul", 1, bad, 132)


@needs_native
def test_matmul_rs_problems_are_one_gemm_per_range_of_blocks():
  """matmul_rs GEMMs each stage's blocks in one GEMM per range of consecutive blocks (rank 1's (3, 1): blocks
  2, 3 then 0 past the wrap, then its own), and a stage of every block in one GEMM of all rows, whatever the
  rank. No GEMM adds the bias (the reduction does)."""
  nat = native.module()
  whole = _fields(nat.gemm_problems("matmul_rs", 4, _call(m=4096, stages=[4]), 132))
  assert [(p["rows"], p["n"], p["bias"]) for p in whole] == [(4096, 3584, False)]
  split = _fields(nat.gemm_problems("matmul_rs", 4, _call(m=4096, stages=[3, 1]), 132))
  assert sorted((p["rows"], p["n"], p["bias"]) for p in split) == [
      (1024, 3584, False), (2048, 3584, False), (3072, 3584, False)]


@needs_native
def test_the_sm_margin_is_part_of_the_problem():
  env = {**os.environ, "JAX_OVERLAP_GEMM_SM_MARGIN": "2"}
  import subprocess
  import sys
  out = subprocess.run([sys.executable, "-P", "-c", "from jax_overlap import _native_testing as h; from "
                        "jax_overlap.runtime import native; print(h.gemm_problem_fields(native.module()"
                        ".gemm_problems('matmul_rs', 2, dict(dtype='bfloat16', "
                        "batch=1, m=256, k=256, n=256, w_kmajor=False, bias=False, stages=[2]), 132)[0])['sm_count'])"],
                       env=env, capture_output=True, text=True, check=True)
  assert out.stdout.split()[-1] == "130"


@needs_native
def test_problem_ids_round_trip_and_others_are_refused():
  (pid,) = native.module().gemm_problems("ag_matmul", 1, _call(stages=[1]), 132)
  assert native_testing.module().gemm_problem_fields(pid)["id"] == pid
  for bad in ("", pid.replace("rows:", "rowz:"), pid + ";extra:1", pid.replace("bfloat16", "bfloat17"),
              pid.replace("rows:1024", "rows:0")):
    with pytest.raises(ValueError, match="not a GEMM problem id"):
      native_testing.module().gemm_problem_fields(bad)


HEADER = "jax_overlap gemm algorithms 2\nlibrary cuBLASLt 130100 libcublasLt.so.13\ndevice NVIDIA H200 sm_90 sms " \
         "132\ndriver 13000"


@needs_native
def test_the_cache_file_round_trips(tmp_path):
  nat, harness = native.module(), native_testing.module()
  (pid,) = nat.gemm_problems("ag_matmul", 1, _call(stages=[1]), 132)
  path = harness.gemm_cache_path(str(tmp_path / "cache"), HEADER)
  entries = {pid: ("ab" * (harness.GEMM_ALGO_HEX_DIGITS // 2), 3, 1310.5, 1467.25)}
  harness.write_gemm_cache(path, HEADER, entries)
  assert os.path.basename(path).startswith("gemm-") and os.listdir(tmp_path / "cache") == [os.path.basename(path)]
  assert harness.read_gemm_cache(path, HEADER) == (entries, "")
  assert harness.read_gemm_cache(str(tmp_path / "none.txt"), HEADER) == ({}, "")
  assert harness.gemm_cache_path("d", HEADER) != harness.gemm_cache_path("d", HEADER.replace("130100", "130200"))


@needs_native
@pytest.mark.parametrize("damage,why", [
    (lambda text: text.replace("H200", "H100"), "another header"),
    (lambda text: text + "garbage\n", "entry line 2 does not parse"),
    (lambda text: text.replace(" 3 ", " three "), "entry line 1 does not parse"),
    (lambda text: text.replace("abab", "zzzz", 1), "entry line 1 does not parse"),
])
def test_a_damaged_or_foreign_cache_file_is_ignored_whole(tmp_path, damage, why):
  nat, harness = native.module(), native_testing.module()
  (pid,) = nat.gemm_problems("ag_matmul", 1, _call(stages=[1]), 132)
  path = str(tmp_path / "gemm.txt")
  harness.write_gemm_cache(path, HEADER, {pid: ("ab" * (harness.GEMM_ALGO_HEX_DIGITS // 2), 3, 1.0, 2.0)})
  with open(path) as fh:
    text = damage(fh.read())
  with open(path, "w") as fh:
    fh.write(text)
  entries, ignored = harness.read_gemm_cache(path, HEADER)
  assert entries == {} and why in ignored and path in ignored


@needs_native
def test_fault_gemm_cache_corrupt_ignores_a_good_file(tmp_path):
  harness = native_testing.module()
  path = str(tmp_path / "gemm.txt")
  harness.write_gemm_cache(path, HEADER, {})
  harness.set_faults("gemm_cache_corrupt")
  try:
    assert harness.read_gemm_cache(path, HEADER) == ({}, f"{path}: fault gemm_cache_corrupt")
  finally:
    harness.set_faults("")
  assert harness.read_gemm_cache(path, HEADER) == ({}, "")


def test_the_figures_use_the_overheads_they_carry():
  """The stage and call overheads are figures (their defaults the module's constants): a sweep that fits them
  (benchmarks/bench_model_sweep.py) changes the estimate by exactly its stages' and call's share."""
  import dataclasses
  from jax_overlap.ops import ag_matmul
  from jax_overlap.planning import figures, pipelined
  f = figures.Figures(gemm_us=(100.0, 190.0, 280.0, 370.0), chunk_bytes=1, link_bytes_per_us=1e9,
                      local_bytes_per_us=1e9)
  base = ag_matmul.pipelined_us((1, 1, 2), f)
  more = ag_matmul.pipelined_us((1, 1, 2), dataclasses.replace(f, stage_overhead_us=pipelined.STAGE_OVERHEAD_US + 1,
                                                               call_overhead_us=pipelined.CALL_OVERHEAD_US + 10))
  assert np.isclose(more - base, 2 * 1 + 10)
