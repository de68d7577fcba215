"""Issue 39 on one GPU: the vendor GEMM's algorithm chosen by timing the heuristic's candidates
(csrc/blas/tuning.cc), its plans' products against float64, the tuning cache between processes, the group of
one's per-call path (no plan lookup after its first call, no descriptor write while its pointers stay), the
schedule's cross-stream edges per call, and the fallbacks under fault injection: a tuning that cannot time
(the heuristic's first), a corrupt cache (ignored), a BLAS handle that cannot be made (the call declined).

  python -m pytest -q tests/gpu/test_vendor_gemm.py     (about a minute on the H200)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_overlap as jo
import native_testing
from gpu_util import on_gpu, poisoned, pointer, random, requires_gpu, vendor_gemm_runs
from jax_overlap.runtime import native
from tolerance import assert_close

pytestmark = [pytest.mark.gpu, requires_gpu]

nat = native.module()
harness = native_testing.module()
E4M3 = jnp.float8_e4m3fn


@pytest.fixture
def faults():
  """set(spec) for the test; afterwards no faults, and no compiled call made under them."""
  yield harness.set_faults
  harness.set_faults("")
  jax.clear_caches()


def _mesh():
  return Mesh(np.array(jax.devices()[:1]), ("tp",))


def _problem(dtype="bfloat16", m=2048, k=4096, n=3584, bias=False, w_kmajor=False, blocks=False):
  call = dict(dtype=dtype, batch=1, m=m, k=k, n=n, w_kmajor=w_kmajor, bias=bias, stages=[1])
  if dtype.startswith("float8"):
    call.update(out_dtype="bfloat16", blocks=blocks)
  (pid,) = nat.gemm_problems("ag_matmul", 1, call, nat.device_info(0)["sm_count"])
  return pid


# --- the timing ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,bias,w_kmajor,blocks", [
    ("bfloat16", False, False, False), ("float16", True, True, False), ("float8_e4m3fn", False, True, False),
    ("float8_e4m3fn", True, True, False), ("float8_e4m3fn", False, True, True)],
    ids=["bf16", "f16-bias-kmajor", "fp8", "fp8-bias", "fp8-blocks"])
def test_tuning_times_the_candidates_and_keeps_a_faster_one(dtype, bias, w_kmajor, blocks):
  pid = _problem(dtype, bias=bias, w_kmajor=w_kmajor, blocks=blocks)
  r = nat.tune_gemm(0, pid, 16, 0.02)
  assert r["source"] == "timed" and r["candidates"] >= 1 and 1 <= r["timed"] <= r["candidates"], r
  assert r["us"] > 0 and r["first_us"] > 0 and r["us"] <= r["first_us"], r
  assert r["index"] == 0 or r["us"] < 0.98 * r["first_us"], r  # another only when faster by the margin
  plan = harness.gemm_plan(0, pid)
  assert (plan["source"], plan["index"], plan["choice"]) == ("timed", r["index"], r["choice"])
  again = nat.tune_gemm(0, pid, 16, 0.02)  # chosen once per process, its timings kept
  assert (again["choice"], again["detail"], again["us"], again["first_us"]) == (
      r["choice"], "chosen before in this process", r["us"], r["first_us"])


def test_every_candidate_is_timed_or_says_why_and_no_plan_changes():
  pid = _problem(m=1280)
  times = harness.gemm_candidate_times(0, pid, 8, 200.0, 2, 1000.0)
  assert [t["index"] for t in times] == list(range(len(times))) and times[0]["status"] == "timed", times
  assert all(t["status"] in ("timed", "slow", "wrong", "failed") for t in times), times
  assert all((t["us"] > 0) == (t["status"] == "timed") for t in times), times
  assert harness.gemm_plan(0, pid)["source"] == "heuristic"  # a tool: the problem's plan is not tuned by it


def test_tuning_off_is_the_heuristics_first():
  r = nat.tune_gemm(0, _problem(m=1536), 1, 0.02)
  assert (r["source"], r["index"], r["timed"]) == ("heuristic", 0, 0) and "tuning is off" in r["detail"]


def test_fault_gemm_tuning_fails_keeps_the_heuristics_first(faults):
  faults("gemm_tuning_fails")
  r = nat.tune_gemm(0, _problem(m=1792), 16, 0.02)
  assert (r["source"], r["index"]) == ("heuristic", 0) and "fault gemm_tuning_fails" in r["detail"], r
  assert harness.gemm_plan(0, _problem(m=1792))["source"] == "heuristic"


def test_install_takes_a_listed_choice_and_refuses_others():
  pid = _problem(m=2304)
  r = nat.tune_gemm(0, pid, 16, 0.02)
  assert nat.install_gemm_algo(0, pid, r["choice"], 16)  # the choosing GPU's own: kept
  refused = harness.blas_counters()["installs_refused"]
  other = _problem(m=2560)
  flipped = r["choice"][:-2] + f"{int(r['choice'][-2:], 16) ^ 0xFF:02x}"
  assert not nat.install_gemm_algo(0, other, flipped, 16)
  assert harness.blas_counters()["installs_refused"] == refused + 1
  assert harness.gemm_plan(0, other)["source"] == "heuristic"
  with pytest.raises(RuntimeError, match="hex digits"):
    nat.install_gemm_algo(0, other, "xyz", 16)


# --- the products of tuned plans, through JAX --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.bfloat16, E4M3])
def test_a_tuned_group_of_one_computes_the_product(dtype, monkeypatch):
  monkeypatch.setenv("JAX_OVERLAP_GEMM_CANDIDATES", "16")
  rng = np.random.default_rng(3)
  m, k, n = 1000, 4096, 3584
  x, w = random(rng, (m, k), dtype), random(rng, (n, k), dtype, 1.0 if dtype == E4M3 else k ** -0.5)
  sx, sw = jnp.float32(0.5), jnp.float32(k ** -0.5)
  scaled = dtype == E4M3

  def body(x, w, sx, sw):
    if scaled:
      return jo.ag_matmul(x, w, x_scale=sx, w_scale=sw, out_dtype=jnp.bfloat16, w_kmajor=True, axis_name="tp",
                          algorithm="pipelined")
    return jo.ag_matmul(x, w, w_kmajor=True, axis_name="tp", algorithm="pipelined")
  f = jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=(P("tp"), P("tp"), P(), P()), out_specs=P(None, "tp")))
  compiled = f.lower(x, w, sx, sw).compile()  # the lowering tunes the call's GEMM (once per process per problem)
  made = harness.blas_counters()["plans_made"]
  y = compiled(x, w, sx, sw)
  # The call found the tuned plan: XLA's buffers are 256-byte aligned, as the problems tuned at lowering assume
  # (planning/tuning.py); a call on buffers aligned otherwise would make a plan of its own here.
  assert harness.blas_counters()["plans_made"] == made
  x64, w64 = (np.asarray(np.asarray(a).astype(np.float32), np.float64) for a in (x, w))
  ref = x64 @ w64.T * (float(sx) * float(sw) if scaled else 1.0)
  assert_close(y, ref, jnp.bfloat16, k, k ** -0.5)  # terms of k^-0.5 (float8: 0.5 x N(0, 1) times k^-0.5)


# --- the cache between processes -----------------------------------------------------------------------------------

_TUNE = """
import json, sys
from jax_overlap.runtime import native
from jax_overlap import _native_testing
nat = native.module()
call = dict(dtype="bfloat16", batch=1, m=2048, k=4096, n=3584, w_kmajor=False, bias=True, stages=[1])
(pid,) = nat.gemm_problems("ag_matmul", 1, call, nat.device_info(0)["sm_count"])
_native_testing.set_faults(sys.argv[2])
print(json.dumps(nat.tune_gemm(0, pid, 16, 0.02, sys.argv[1])))
"""


def _tune_in_a_process(cache: str, faults: str = "") -> dict:
  run = subprocess.run([sys.executable, "-P", "-c", _TUNE, cache, faults], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "JAX_PLATFORMS": "cuda"})
  assert run.returncode == 0, run.stderr
  return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_cache_gives_the_next_process_the_choice_and_a_corrupt_one_is_ignored(tmp_path):
  cache = str(tmp_path / "gemm_cache")
  first = _tune_in_a_process(cache)
  assert first["source"] == "timed" and first["detail"] == "", first
  (name,) = os.listdir(cache)
  with open(os.path.join(cache, name)) as fh:
    lines = fh.read().splitlines()
  assert lines[0] == "jax_overlap gemm algorithms 2" and lines[1].startswith("library ") and len(lines) == 5
  second = _tune_in_a_process(cache)
  assert (second["source"], second["choice"], second["timed"]) == ("disk_cache", first["choice"], 0), second
  # Fault gemm_cache_corrupt: the file reads as corrupt; the problem is timed again and the file rewritten.
  third = _tune_in_a_process(cache, "gemm_cache_corrupt")
  assert third["source"] == "timed" and "tuning cache ignored" in third["detail"], third
  with open(os.path.join(cache, name), "a") as fh:
    fh.write("not an entry\n")
  fourth = _tune_in_a_process(cache)
  assert fourth["source"] == "timed" and "does not parse" in fourth["detail"], fourth
  assert _tune_in_a_process(cache)["source"] == "disk_cache"  # rewritten whole by the fourth


# --- a BLAS handle that cannot be made ---------------------------------------------------------------------------

_NO_HANDLE = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import jax_overlap as jo
from jax_overlap import _native_testing
_native_testing.set_faults("blas_handle_fails")
mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
x = jnp.ones((256, 512), jnp.float8_e4m3fn); w = jnp.ones((384, 512), jnp.float8_e4m3fn); s = jnp.float32(1)
def f(algorithm):
  return jax.jit(jax.shard_map(lambda x, w, sx, sw: jo.ag_matmul(x, w, x_scale=sx, w_scale=sw, w_kmajor=True,
      out_dtype=jnp.bfloat16, axis_name="tp", algorithm=algorithm), mesh=mesh, in_specs=(P("tp"), P("tp"), P(), P()),
      out_specs=P(None, "tp")))
print("auto", "jax_overlap_vendor_gemm" in f("auto").lower(x, w, s, s).as_text())
try:
  f("pipelined").lower(x, w, s, s)
  print("pipelined lowered")
except ValueError as e:
  print("pipelined", e)
"""


def test_a_blas_handle_that_cannot_be_made_declines_the_call():
  """In a process of its own: a GPU's handles are made once per process (the first lowering that needs them)."""
  run = subprocess.run([sys.executable, "-P", "-c", _NO_HANDLE], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "JAX_PLATFORMS": "cuda"})
  assert run.returncode == 0, run.stderr
  out = run.stdout.splitlines()
  assert out[0] == "auto False", run.stdout  # auto: the XLA path
  assert out[1].startswith("pipelined ") and "fault blas_handle_fails" in out[1], run.stdout


# --- the group of one's per-call path -------------------------------------------------------------------------------

def test_a_group_of_one_looks_up_no_plan_and_writes_no_pointer_after_its_first_run(faults):
  """Six chained float8 calls outside command buffers (the no-graph target, under fault capture_check_fails, so
  that the handler runs on every call): the second run finds every call checked and every pointer set."""
  faults("capture_check_fails")
  rng = np.random.default_rng(5)
  x, w = random(rng, (512, 1024), E4M3), random(rng, (1024, 1024), E4M3)
  sx, sw = jnp.float32(0.25), jnp.float32(1 / 32)
  call = jax.shard_map(lambda x, w, sx, sw: jo.ag_matmul(x, w, x_scale=sx, w_scale=sw, out_dtype=jnp.bfloat16,
                                                         w_kmajor=True, axis_name="tp", algorithm="pipelined"),
                       mesh=_mesh(), in_specs=(P("tp"), P("tp"), P(), P()), out_specs=P(None, "tp"))
  chain = jax.jit(lambda x, w, sx, sw: [x := call(x, w, sx, sw).astype(E4M3) for _ in range(6)])
  assert "jax_overlap_vendor_gemm_no_graph" in chain.lower(x, w, sx, sw).compile().as_text()
  jax.block_until_ready(chain(x, w, sx, sw))
  before = harness.blas_counters()
  runs, captured = vendor_gemm_runs(lambda: jax.block_until_ready(chain(x, w, sx, sw)))
  after = harness.blas_counters()
  assert (runs, captured) == (6, 0)
  assert after["plan_lookups"] == before["plan_lookups"], (before, after)
  assert after["descriptor_writes"] == before["descriptor_writes"], (before, after)


# --- cross-stream edges per call -------------------------------------------------------------------------------------

def _edges(op, stages):
  """(records, waits) the schedule enqueues (pipelined/streams.h): the fork (one record, a wait per stream with
  work), ag_matmul's arrivals (a record per pulled shard, a wait per stage after the first), the join (a record
  and a wait per stream with work; matmul_rs's second compute stream only with two stages or more)."""
  world = sum(stages)
  if op == "ag_matmul":
    streams = 3
    return 1 + (world - 1) + streams, streams + (len(stages) - 1) + streams
  streams = 3 if len(stages) > 1 else 2
  return 1 + streams, streams + streams


@pytest.mark.parametrize("op,dtype,world,stages", [
    ("ag_matmul", "bfloat16", 4, (1, 3)), ("ag_matmul", "bfloat16", 8, (1,) * 8),
    ("matmul_rs", "bfloat16", 4, (4,)), ("matmul_rs", "bfloat16", 4, (2, 2)),
    ("matmul_rs", "float8_e4m3fn", 4, (4,)), ("matmul_rs", "float8_e4m3fn", 4, (1, 3))])
def test_a_call_forks_and_joins_only_the_streams_with_work(op, dtype, world, stages):
  m, k, n = 256, 512, 1024
  fp8 = dtype != "bfloat16"
  rows = m if op == "ag_matmul" else world * m  # x's rows per rank
  x = on_gpu(jnp.ones((1, rows, k), dtype))
  w = on_gpu(jnp.ones((n, k) if fp8 else (k, n), dtype))
  out = poisoned((1, world * m if op == "ag_matmul" else m, n), jnp.bfloat16)
  gathered = poisoned((1, world * m, k), jnp.bfloat16) if op == "ag_matmul" else None  # bf16 rows only (params)
  scales = on_gpu(jnp.ones((8 + world,), jnp.float32))
  scratch = on_gpu(jnp.zeros((nat.pipelined_scratch_bytes(op, world, 1, rows, n, 2, True),), jnp.uint8))
  call = dict(dtype=dtype, x=pointer(x), w=pointer(w), bias=0, out=pointer(out), gathered=pointer(gathered),
              scratch=pointer(scratch), batch=1, m=rows, k=k, n=n, w_kmajor=fp8, stages=list(stages))
  if fp8:
    base = pointer(scales)
    call.update(out_dtype="bfloat16", x_scale=base, w_scale=base + 16, gathered_scales=base + 32)
  edges = harness.loopback_edges(0, op, world, call)
  assert (edges["records"], edges["waits"]) == _edges(op, stages), edges
