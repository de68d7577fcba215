"""Planning float8 calls (planning/, the ops' pipelined models) on a stand-in GPU (tests/fake_gpu.py, an H200's
sm_90): which algorithm may take them, the figures their models get, and matmul_rs's reduction under its last
GEMM in the model."""

import dataclasses

import pytest

from jax_overlap import planning
from jax_overlap.runtime import native, workspace
from jax_overlap.ops import OPS, ag_matmul, matmul_rs
from jax_overlap.planning import figures, pipelined
from jax_overlap.quantization import scaling



def _problem(op, x="float8_e4m3fn", w="float8_e4m3fn", out="bfloat16", world=4, rows=4096, k=1024, n=1024):
  return planning.Problem(op, x, 1, rows, k, n, world, (tuple(range(world)),), True, out_dtype_name=out,
                          w_dtype_name=w, scaling=scaling.TENSOR)


@pytest.mark.parametrize("op", list(OPS))
def test_fused_declines_float8_saying_why(fake, op):
  why = planning.eligible(_problem(op), OPS[op], "fused")
  assert why == "dtype float8_e4m3fn (the fused algorithm takes bfloat16, float16)"


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("x,w,refused", [("float8_e4m3fn", "float8_e5m2", None),
                                         ("float8_e5m2", "float8_e4m3fn", None),
                                         ("float8_e4m3fnuz", "float8_e4m3fnuz", "float8_e4m3fnuz"),
                                         ("float8_e4m3fn", "float8_e5m2fnuz", "float8_e5m2fnuz")])
def test_pipelined_takes_the_float8_formats_the_device_runs(fake, op, x, w, refused):
  why = planning.eligible(_problem(op, x, w), OPS[op], "pipelined")
  if refused is None:
    assert why is None
  else:
    assert why == (f"{refused} on this device (FakeNative GPU, sm_90): FNUZ float8 formats run on gfx942")


def test_a_device_without_float8_refuses_every_format(fake, monkeypatch):
  info = fake.device_info
  monkeypatch.setattr(fake, "device_info", lambda ordinal: dict(info(ordinal), arch="sm_80"))
  why = planning.eligible(_problem("ag_matmul"), ag_matmul.OP, "pipelined")
  assert why == ("float8_e4m3fn on this device (FakeNative GPU, sm_80): OCP float8 formats run on sm_89+ or "
                 "gfx950")


def test_ag_matmul_float8_figures(fake):
  """A float8 ag_matmul moves 1-byte shards and runs one GEMM per gathered shard: a stage of s shards takes s
  one-shard GEMMs, and so does the XLA path (one dot per shard and its scale), not the one GEMM over every row."""
  f = figures.measure(ag_matmul.OP, "float8_e4m3fn", 1024, 512, 256, 4, True, types=("float8_e5m2", "bfloat16"))
  assert fake.timed_gemms == [("float8_e4m3fn", "float8_e5m2", "bfloat16", True)]
  assert f.chunk_bytes == 1024 * 512 and f.reduce_us is None
  assert f.stage_gemm_us == tuple(s * f.gemm_us[0] for s in range(1, 5))
  assert pipelined.gemm_us(f, 4) == 4 * f.gemm_us[0] != f.gemm_us[3]  # the fake's whole GEMM runs 5% faster
  assert pipelined.xla_us(4, f) == 3 * f.chunk_bytes / f.link_bytes_per_us + 4 * f.gemm_us[0]


@pytest.mark.parametrize("world", [4, 8])
def test_a_float8_ag_matmul_plan_takes_one_shard_per_stage(fake, world):
  """One GEMM per shard whatever the stages: the plan waits for no shard but its own, where the model alone would
  group the peers' shards to save stage overheads (and a 16-bit call, whose stage is one GEMM, still groups)."""
  f = figures.measure(ag_matmul.OP, "float8_e4m3fn", 1024, 512, 256, world, True, types=("float8_e4m3fn", "bfloat16"))
  assert pipelined.plan(ag_matmul.OP, world, f).stages == (1,) * world
  assert min(ag_matmul.stage_candidates(world), key=lambda c: (ag_matmul.pipelined_us(c, f), len(c))) != (1,) * world
  assert pipelined.plan(ag_matmul.OP, world, f, (1, world - 1)).stages == (1, world - 1)  # a pinned plan stays
  bf16 = figures.measure(ag_matmul.OP, "bfloat16", 1024, 512, 256, world, True)
  assert pipelined.plan(ag_matmul.OP, world, bf16).stages != (1,) * world


@pytest.mark.parametrize("world", [4, 8])
def test_a_shared_x_scale_lets_a_float8_ag_matmul_stage_take_several_shards(fake, world):
  """Shards that share one x scale (Scaling.x_shared) take one GEMM over a stage's rows, as 16-bit shards do, and
  so does the XLA path: the figures and plans of a bf16 call, timed on the same float8 GEMMs (one figure)."""
  types = ("float8_e4m3fn", "bfloat16")
  shared = scaling.TENSOR.sharing_x(True)
  f = figures.measure(ag_matmul.OP, "float8_e4m3fn", 1024, 512, 256, world, True, types=types, scaling=shared)
  assert f.stage_gemm_us is None
  assert pipelined.xla_us(world, f) == (world - 1) * f.chunk_bytes / f.link_bytes_per_us + f.gemm_us[-1]
  assert pipelined.plan(ag_matmul.OP, world, f).stages != (1,) * world
  g = figures.measure(ag_matmul.OP, "float8_e4m3fn", 1024, 512, 256, world, True, types=types, scaling=scaling.TENSOR)
  assert g.gemm_us == f.gemm_us and len(fake.timed_gemms) == 1  # the unshared call found the shared call's figure
  assert _problem("ag_matmul").x_scale_shared is False
  assert dataclasses.replace(_problem("ag_matmul"), scaling=shared).x_scale_shared is True


@pytest.mark.parametrize("out,itemsize", [("bfloat16", 2), ("float32", 4)])
def test_matmul_rs_float8_figures(fake, out, itemsize):
  """A float8 matmul_rs moves and reduces partials in its output's dtype, one GEMM per stage (one scale pair)."""
  calls = []
  timed = fake.time_reduce
  fake.time_reduce = lambda *args: calls.append(args) or timed(*args)
  f = figures.measure(matmul_rs.OP, "float8_e4m3fn", 4096, 512, 1024, 4, True, types=("float8_e4m3fn", out))
  assert calls == [(workspace.first_ordinal(), out, 4, 1024, 1024)]
  assert f.chunk_bytes == 1024 * 1024 * itemsize and f.stage_gemm_us is None


def test_a_float8_shard_carries_its_scale_in_a_slot_header():
  if native.platform() != "cuda":
    pytest.skip("needs the CUDA build of the extension (csrc/pipelined/layout.h GatherRegion)")
  region = lambda op, scaled: native.module().pipelined_region_bytes(op, 4, 1, 1024, 512, 256, 1, 2, scaled)
  assert region("ag_matmul", True) - region("ag_matmul", False) == 2 * 256  # a header per parity's slot
  assert region("matmul_rs", True) == region("matmul_rs", False)


def _rs_figures(world=4, reduce_us=200.0):
  gemm = tuple(1000.0 * s / world for s in range(1, world + 1))
  return figures.Figures(gemm, 8 << 20, 3e5, 2e6, reduce_us=reduce_us)


@pytest.mark.parametrize("stages", [(1, 1, 1, 1), (2, 2), (4,), (1, 3)])
def test_matmul_rs_model_reduces_after_the_last_gemm_and_pull(stages):
  """The model is the stages' GEMMs (or the last pull, if later), then the whole reduction."""
  f = _rs_figures()
  gemms = sum(f.stage_overhead_us + pipelined.gemm_us(f, s) for s in stages)
  whole = matmul_rs.pipelined_us(stages, f)
  assert whole >= gemms + 200.0 + f.call_overhead_us
  assert whole == pytest.approx(matmul_rs.pipelined_us(stages, _rs_figures(reduce_us=0.0)) + 200.0)


def test_matmul_rs_model_starts_the_pulls_of_an_early_stage_under_the_later_gemms():
  """With a slow link the pulls decide: a plan that stages the peers' blocks before my own, (3, 1), ends before
  one that stages every block in one GEMM, (4,), whose pulls all start after it."""
  f = dataclasses.replace(_rs_figures(), link_bytes_per_us=1e3)
  assert matmul_rs.pipelined_us((3, 1), f) < matmul_rs.pipelined_us((4,), f)
