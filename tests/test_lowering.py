"""The GPU lowering on a CPU machine: lower for "cuda" with a stand-in runtime and read the custom calls.

No GPU runs here; this checks what the lowering hands the FFI handlers: the target, the config
attribute, and each group's global device ids in rank order for the mesh axis.
"""

import os
import re
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap.runtime import backend
from jax_overlap.runtime import native, settings, workspace

import native_testing
from fake_gpu import FakeNative, custom_calls as _custom_calls, install

pytestmark = pytest.mark.skipif(native.platform() != "cuda", reason="needs the CUDA build of the extension")


class _CompiledFake(FakeNative):
  """FakeNative's runtime and model GPU (the GEMM at 700 TFLOP/s, each chunk's share of it 5% slower than the
  whole), with the compiled module's targets, tiles, sizes and launch geometry, at the kernels' occupancy on an
  H200 (no GPU to query here): the 8-warp tiles one workgroup per SM, the 4-warp ones two."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.compiled = native.module()
    self.gen = 7

  def targets(self):
    return self.compiled.targets()

  def tile_shapes(self):
    return self.compiled.tile_shapes()

  def gemm_geometry(self, op, tile, *args):
    threads = next(t["threads"] for t in self.compiled.tile_shapes() if t["index"] == tile)
    return self.compiled.gemm_geometry(op, tile, *args[:-1], 1 if threads >= 256 else 2)

  def pipelined_scratch_bytes(self, *args):
    return self.compiled.pipelined_scratch_bytes(*args)

  def pipelined_region_bytes(self, *args):
    return self.compiled.pipelined_region_bytes(*args)

  def all_gather_region_bytes(self, *args):
    return self.compiled.all_gather_region_bytes(*args)


def _install(monkeypatch, link=3e5, gpus=jax.devices, workspace_bytes=1 << 30, set_up=True):
  """A runtime on a _CompiledFake whose GPUs are `gpus()` (CPU devices), every one reachable, with a `link`
  bytes/us link; its workspace of `workspace_bytes` set up (set_up)."""
  fake = _CompiledFake(link_bytes_per_us=link)
  install(monkeypatch.setattr, fake, gpus=gpus)
  if set_up:
    jax_overlap.initialize(workspace_bytes=workspace_bytes)
  return fake


@pytest.fixture
def fake_gpu_runtime(monkeypatch):
  """A runtime that believes it has every CPU device as a reachable GPU, with a 300 GB/s link."""
  return _install(monkeypatch)


def _regions():
  return backend.current().state.regions


def _ints(line, name):
  """An integer-array attribute of a custom call, as either JAX version prints it (a splat included)."""
  found = re.search(rf"{name} = (?:dense<(\[?[-\d, ]+\]?)> : tensor<(\d+)xi64>|array<i64: ([-\d, ]+)>)", line)
  if found.group(3):
    return [int(v) for v in found.group(3).split(",")]
  values = [int(v) for v in found.group(1).strip("[]").split(",")]
  return values * int(found.group(2)) if len(values) == 1 else values


def _groups(line):
  return _ints(line, "groups")


@pytest.mark.parametrize("axis,want", [("tp", [0, 1, 2, 3, 4, 5, 6, 7]), ("dp", [0, 4, 1, 5, 2, 6, 3, 7])])
def test_groups_follow_the_mesh_axis(fake_gpu_runtime, make_mesh, axis, want):
  mesh = make_mesh((2, 4), ("dp", "tp"))
  x = jnp.zeros((256, 512), jnp.bfloat16)
  w = jnp.zeros((512, 256), jnp.bfloat16)
  f = jax.jit(jax.shard_map(lambda x, w: jax_overlap.ag_matmul(x, w, axis_name=axis, algorithm="fused"),
                            mesh=mesh, in_specs=(P(axis), P()), out_specs=P(axis)))
  calls = _custom_calls(f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text())
  assert len(calls) == 1 and "@jax_overlap_ag_matmul" in calls[0]
  assert _groups(calls[0]) == want
  assert f"world = {mesh.shape[axis]}" in calls[0]


def test_backward_uses_both_fused_ops_with_w_transposed(fake_gpu_runtime, make_mesh):
  mesh = make_mesh((4,), ("tp",))
  x, w = jnp.zeros((256, 512), jnp.bfloat16), jnp.zeros((512, 256), jnp.bfloat16)

  def loss(x, w):
    y = jax.shard_map(lambda x, w: jax_overlap.ag_matmul(x, w, axis_name="tp", algorithm="fused"), mesh=mesh,
                      in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"))(x, w)
    return jnp.sum(y.astype(jnp.float32))

  calls = _custom_calls(jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, w).lower(
      lowering_platforms=("cuda",)).as_text())
  assert [c.split("@")[1].split("(")[0] for c in calls] == ["jax_overlap_ag_matmul", "jax_overlap_matmul_rs"]
  assert "w_kmajor = 1" in calls[1]
  assert len(_regions()) == 2  # one region per (op, group, shape)


def test_fused_refused_where_it_cannot_run(fake_gpu_runtime, make_mesh):
  mesh = make_mesh((4,), ("tp",))
  x = jnp.zeros((256, 100), jnp.bfloat16)  # k not a multiple of 8
  f = jax.jit(jax.shard_map(lambda x, w: jax_overlap.ag_matmul(x, w, axis_name="tp", algorithm="fused"),
                            mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")))
  with pytest.raises(ValueError, match="algorithm='fused' cannot take this call: k=100"):
    f.trace(x, jnp.zeros((100, 256), jnp.bfloat16)).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_group_of_one_lowers_to_the_command_buffer_target(fake_gpu_runtime, make_mesh, op):
  mesh = make_mesh((8, 1), ("dp", "tp"))
  x, w = jnp.zeros((256, 512), jnp.bfloat16), jnp.zeros((512, 256), jnp.bfloat16)
  fn = getattr(jax_overlap, op)
  f = jax.jit(jax.shard_map(lambda x, w: fn(x, w, axis_name="tp", algorithm="fused"), mesh=mesh,
                            in_specs=(P("dp"), P()), out_specs=P(("dp", "tp"))))
  calls = _custom_calls(f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text())
  assert len(calls) == 1 and f"@jax_overlap_{op}_local(" in calls[0]
  assert not re.search(r"\b(groups|world) = ", calls[0])
  # y, no gathered result; an empty tail scratch (32 rows: no partial wave to even out)
  assert re.search(r"-> \(tensor<32x256xbf16>, tensor<0xui8>\)$", calls[0].split(" : ")[-1].strip())
  assert "tail_slots = 0" in calls[0]


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
@pytest.mark.parametrize("k,slots", [(512, 132), (520, 0)])
def test_group_of_one_with_a_partial_wave_gets_tail_scratch(fake_gpu_runtime, make_mesh, op, k, slots):
  # 2048 x 3584 per shard: 224 tiles of 128 x 256 on 132 SMs, a partial second wave; the tail
  # runs on whole tiles only, which k = 520 (not a multiple of 64) is not.
  mesh = make_mesh((8, 1), ("dp", "tp"))
  x, w = jnp.zeros((8 * 2048, k), jnp.bfloat16), jnp.zeros((k, 3584), jnp.bfloat16)
  fn = getattr(jax_overlap, op)
  f = jax.jit(jax.shard_map(lambda x, w: fn(x, w, axis_name="tp", algorithm="fused"), mesh=mesh,
                            in_specs=(P("dp"), P()), out_specs=P(("dp", "tp"))))
  calls = _custom_calls(f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text())
  assert len(calls) == 1 and f"tail_slots = {slots}" in calls[0] and "tile = 0" in calls[0]
  nbytes = native_testing.module().tail_scratch_bytes(0, slots)
  assert nbytes == (1056 + 132 * 128 * 256 * 4 if slots else 0)  # 8-byte flags (16-byte multiple), fp32 tiles
  assert re.search(rf"-> \(tensor<2048x3584xbf16>, tensor<{nbytes}xui8>\)$", calls[0].split(" : ")[-1].strip())


def _lowered(f, *args) -> str:
  return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _op_fn(op, mesh, algorithm, axis="tp"):
  specs = {"ag_matmul": (P(axis), P(None, axis), P(None, axis)), "matmul_rs": (P(None, axis), P(axis), P(axis))}
  x_spec, w_spec, out_spec = specs[op]
  fn = getattr(jax_overlap, op)
  return jax.jit(jax.shard_map(lambda x, w: fn(x, w, axis_name=axis, algorithm=algorithm), mesh=mesh,
                               in_specs=(x_spec, w_spec), out_specs=out_spec))


def _operands(op, world, rows, k, n):
  """Global x, w (shapes only) whose per-rank GEMM is [rows, k] @ [k, n] (ag_matmul: rows of the gathered x)."""
  spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  if op == "ag_matmul":
    return spec(rows, k), spec(k, world * n)
  return spec(rows, world * k), spec(world * k, n)


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_pipelined_lowers_to_its_target_with_its_plan(fake_gpu_runtime, make_mesh, op):
  mesh = make_mesh((4,), ("tp",))
  calls = _custom_calls(_lowered(_op_fn(op, mesh, "pipelined"), *_operands(op, 4, 4096, 512, 256)))
  assert len(calls) == 1 and f"@jax_overlap_{op}_pipelined(" in calls[0], calls
  stages = _ints(calls[0], "stages")
  assert sum(stages) == 4 and all(s >= 1 for s in stages)
  if op == "ag_matmul":
    assert stages[0] == 1  # its own shard first, alone
  assert "site = 1" in calls[0] and "generation = 7" in calls[0] and "world = 4" in calls[0]
  assert _groups(calls[0]) == [0, 1, 2, 3]
  m = 1024 if op == "ag_matmul" else 4096  # x's rows per rank
  scratch = native.module().pipelined_scratch_bytes(op, 4, 1, m, 256, 2)
  assert f"tensor<{scratch}xui8>" in calls[0].split(" : ")[-1]


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
@pytest.mark.parametrize("world", [1, 4])
def test_16bit_pipelined_calls_pass_empty_scales(fake_gpu_runtime, make_mesh, op, world):
  """The pipelined targets take (x, w, bias, x_scale, w_scale): a 16-bit call passes an empty bias and f32[0]
  scales, and ag_matmul's target with peers returns empty gathered scales (csrc/ffi/pipelined.cc)."""
  mesh = make_mesh((world, 8 // world), ("tp", "dp"))
  calls = _custom_calls(_lowered(_op_fn(op, mesh, "pipelined"), *_operands(op, world, 4096, 512, 256)))
  assert len(calls) == 1
  operands, results = calls[0].split(" : ")[-1].split(" -> ")
  assert operands.endswith("tensor<0xbf16>, tensor<0xf32>, tensor<0xf32>)")
  gathered_scales = world > 1 and op == "ag_matmul"
  assert ("tensor<0xf32>" in results) == gathered_scales


@pytest.mark.parametrize("op,pinned,want", [("ag_matmul", "1,2,1", [1, 2, 1]), ("matmul_rs", "4", [4]),
                                             ("matmul_rs", "1,3", [1, 3]), ("ag_matmul", "1,1", None)])
def test_pinned_stages_replace_the_cost_models_plan(fake_gpu_runtime, monkeypatch, make_mesh, op, pinned, want):
  """JAX_OVERLAP_PIPELINE_STAGES pins the plan of calls over as many ranks as its stages cover; others keep
  the model's."""
  monkeypatch.setenv("JAX_OVERLAP_PIPELINE_STAGES", pinned)
  mesh = make_mesh((4,), ("tp",))
  calls = _custom_calls(_lowered(_op_fn(op, mesh, "pipelined"), *_operands(op, 4, 4096, 512, 256)))
  stages = _ints(calls[0], "stages")
  if want is not None:
    assert stages == want
  else:
    monkeypatch.delenv("JAX_OVERLAP_PIPELINE_STAGES")
    jax.clear_caches()
    unpinned = _custom_calls(_lowered(_op_fn(op, mesh, "pipelined"), *_operands(op, 4, 4096, 512, 256)))
    assert stages == _ints(unpinned[0], "stages")


@pytest.mark.parametrize("pinned,why", [("2,2", "own shard alone"), ("1,a", "separated by commas"),
                                        ("1,0,3", "at least one chunk")])
def test_a_pinned_plan_that_cannot_be_the_calls_is_an_error(fake_gpu_runtime, monkeypatch, make_mesh, pinned, why):
  monkeypatch.setenv("JAX_OVERLAP_PIPELINE_STAGES", pinned)
  with pytest.raises(ValueError, match=f"JAX_OVERLAP_PIPELINE_STAGES.*{why}"):
    _lowered(_op_fn("ag_matmul", make_mesh((4,), ("tp",)), "pipelined"), *_operands("ag_matmul", 4, 4096, 512, 256))


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_pipelined_group_of_one_is_the_vendor_gemm(fake_gpu_runtime, make_mesh, op):
  mesh = make_mesh((8, 1), ("dp", "tp"))
  fn = getattr(jax_overlap, op)
  f = jax.jit(jax.shard_map(lambda x, w: fn(x, w, axis_name="tp", algorithm="pipelined"), mesh=mesh,
                            in_specs=(P("dp"), P()), out_specs=P(("dp", "tp"))))
  calls = _custom_calls(_lowered(f, jnp.zeros((256, 512), jnp.bfloat16), jnp.zeros((512, 256), jnp.bfloat16)))
  assert len(calls) == 1 and "@jax_overlap_vendor_gemm(" in calls[0]
  workspace = native.module().pipelined_scratch_bytes(op, 1, 1, 32, 256, 2)
  assert re.search(rf"-> \(tensor<32x256xbf16>, tensor<{workspace}xui8>\)$", calls[0].split(" : ")[-1].strip())


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
@pytest.mark.parametrize("link,target", [(3e5, "pipelined"), (3e7, None)])
def test_auto_takes_pipelined_where_the_cost_model_says_so(fake_gpu_runtime, monkeypatch, make_mesh, op, link,
                                                           target):
  # 300 GB/s: the transfer is a quarter of the GEMM and overlapping it pays; 30 TB/s: it is nearly free, and
  # chunking only costs.
  _install(monkeypatch, link=link)
  calls = _custom_calls(_lowered(_op_fn(op, make_mesh((8,), ("tp",)), "auto"), *_operands(op, 8, 16384, 8192, 8192)))
  if target is None:
    assert calls == []
  else:
    assert len(calls) == 1 and f"@jax_overlap_{op}_{target}(" in calls[0]


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_xla_and_a_group_of_one_under_auto_set_nothing_up(monkeypatch, make_mesh, op):
  fake = _install(monkeypatch, set_up=False)
  assert _custom_calls(_lowered(_op_fn(op, make_mesh((4,), ("tp",)), "xla"), *_operands(op, 4, 256, 64, 64))) == []
  mesh = make_mesh((8, 1), ("dp", "tp"))
  fn = getattr(jax_overlap, op)
  f = jax.jit(jax.shard_map(lambda x, w: fn(x, w, axis_name="tp", algorithm="auto"), mesh=mesh,
                            in_specs=(P("dp"), P()), out_specs=P(("dp", "tp"))))
  assert _custom_calls(_lowered(f, jnp.zeros((256, 512), jnp.bfloat16), jnp.zeros((512, 256), jnp.bfloat16))) == []
  state = backend.current().state
  assert fake.calls == [] and not state.prepared and state.regions == {} and state.sites == {}


@pytest.mark.parametrize("algorithm", ["fused", "pipelined", "auto"])
def test_kill_switch_forces_the_xla_path(fake_gpu_runtime, monkeypatch, make_mesh, algorithm):
  monkeypatch.setenv(settings.DISABLE, "1")
  text = _lowered(_op_fn("ag_matmul", make_mesh((4,), ("tp",)), algorithm), *_operands("ag_matmul", 4, 16384, 8192, 8192))
  assert _custom_calls(text) == [] and "all_gather" in text


@pytest.mark.parametrize("algorithm", ["pipelined", "fused"])
def test_call_sites_sharing_a_region_get_their_own_numbers(fake_gpu_runtime, make_mesh, algorithm):
  mesh = make_mesh((4,), ("tp",))

  def two_layers(x, w1, w2, b):  # the same shapes; one with a bias (JAX lowers identical calls once)
    y = jax_overlap.ag_matmul(x, w1, axis_name="tp", algorithm=algorithm)
    return jax_overlap.ag_matmul(x, w2, b, axis_name="tp", algorithm=algorithm) + y

  f = jax.jit(jax.shard_map(two_layers, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P(None, "tp"), P("tp")),
                            out_specs=P(None, "tp")))
  x, w = _operands("ag_matmul", 4, 1024, 256, 128)
  calls = _custom_calls(_lowered(f, x, w, w, jnp.zeros((512,), jnp.bfloat16)))
  assert len(calls) == 2 and len(_regions()) == 1  # one region, shared
  assert [int(re.search(r"site = (\d+)", c).group(1)) for c in calls] == [1, 2]
  assert len({re.search(r"region_offset = (\d+)", c).group(1) for c in calls}) == 1


def test_site_numbers_repeat_after_16_bits(fake_gpu_runtime):
  """A flag holds 16 bits of site: the 65536th call site of one region is number 1 again, never 0 (no check)."""
  key = ("ag_matmul/fused", ((0, 1),), (1, 64, 64, 64))
  sites = [workspace.site(key, ("jit_f", i)) for i in range(1, 65538)]
  assert sites[:2] == [1, 2] and sites[65534] == 65535 and sites[65535:] == [1, 2]
  assert workspace.site(key, ("jit_f", 2)) == 2  # a site named again keeps its number


def test_only_this_process_groups_must_be_reachable(fake_gpu_runtime, monkeypatch, make_mesh):
  # This process has devices 0-3 (one host); 4-7 are another host's, never mapped here.
  _install(monkeypatch, gpus=lambda: jax.devices()[:4])
  x, w = jnp.zeros((256, 512), jnp.bfloat16), jnp.zeros((512, 256), jnp.bfloat16)
  # tp inside the host (dp across hosts): this process's group is reachable.
  mesh = make_mesh((2, 4), ("dp", "tp"))
  f = jax.jit(jax.shard_map(lambda x, w: jax_overlap.ag_matmul(x, w, axis_name="tp", algorithm="fused"), mesh=mesh,
                            in_specs=(P("tp"), P()), out_specs=P("tp")))
  calls = _custom_calls(_lowered(f, x, w))
  assert len(calls) == 1 and _groups(calls[0]) == [0, 1, 2, 3, 4, 5, 6, 7]
  # tp across the hosts: refused when asked for, the XLA path under auto.
  mesh = make_mesh((2, 4), ("tp", "dp"))
  for algorithm in ("fused", "auto"):
    f = jax.jit(jax.shard_map(lambda x, w: jax_overlap.ag_matmul(x, w, axis_name="tp", algorithm=algorithm),
                              mesh=mesh, in_specs=(P("tp"), P()), out_specs=P("tp")))
    if algorithm == "fused":
      with pytest.raises(ValueError, match="cannot take this call: the group spans devices this process cannot reach"):
        _lowered(f, x, w)
    else:
      assert _custom_calls(_lowered(f, x, w)) == []


def test_a_full_workspace_falls_back_under_auto_and_raises_when_asked_for(fake_gpu_runtime, monkeypatch, make_mesh):
  _install(monkeypatch, workspace_bytes=4096)
  args = _operands("matmul_rs", 8, 16384, 8192, 8192)
  assert _custom_calls(_lowered(_op_fn("matmul_rs", make_mesh((8,), ("tp",)), "auto"), *args)) == []
  with pytest.raises(ValueError, match=r"algorithm='pipelined' cannot take this call: .*bytes of symmetric workspace"):
    _lowered(_op_fn("matmul_rs", make_mesh((8,), ("tp",)), "pipelined"), *args)


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_multi_dim_weights_reach_the_kernel_as_a_matrix(fake_gpu_runtime, make_mesh, op):
  """w [512, 2, 256] (ag_matmul) or [2, 256, 512] with x [..., 2, 256] (matmul_rs): one fused call on the
  row-major views [512, 512] and x [256, 512], the reshapes around it free."""
  mesh = make_mesh((4,), ("tp",))
  if op == "ag_matmul":
    x, w = jnp.zeros((4 * 64, 512), jnp.bfloat16), jnp.zeros((512, 2, 4 * 256), jnp.bfloat16)
    specs, out = (P("tp"), P(None, None, "tp")), P(None, None, "tp")
    want = "(tensor<64x512xbf16>, tensor<512x512xbf16>"
  else:
    x, w = jnp.zeros((256, 4 * 2, 256), jnp.bfloat16), jnp.zeros((4 * 2, 256, 512), jnp.bfloat16)
    specs, out = (P(None, "tp"), P("tp")), P("tp")
    want = "(tensor<256x512xbf16>, tensor<512x512xbf16>"
  fn = getattr(jax_overlap, op)
  f = jax.jit(jax.shard_map(lambda x, w: fn(x, w, axis_name="tp", algorithm="fused"), mesh=mesh,
                            in_specs=specs, out_specs=out))
  calls = _custom_calls(f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text())
  assert len(calls) == 1 and f"@jax_overlap_{op}(" in calls[0]
  assert want in calls[0].split(" : ")[-1]


def test_gather_axis_folds_into_the_kernels_rows(fake_gpu_runtime, make_mesh):
  mesh = make_mesh((4,), ("tp",))
  x, w = jnp.zeros((4 * 2, 32, 512), jnp.bfloat16), jnp.zeros((512, 4 * 256), jnp.bfloat16)
  f = jax.jit(jax.shard_map(lambda x, w: jax_overlap.ag_matmul(x, w, axis_name="tp", algorithm="fused",
                                                               gather_axis=0),
                            mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, None, "tp")))
  calls = _custom_calls(f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text())
  assert len(calls) == 1 and "(tensor<64x512xbf16>" in calls[0].split(" : ")[-1]


@pytest.mark.parametrize("op,pinned", [("ag_matmul", "1,2,1"), ("ag_matmul", "1,1,1,1"), ("matmul_rs", "1,2,1"),
                                       ("matmul_rs", "2,2")])
def test_the_multi_gpu_benchmark_reads_the_lowered_choice(fake_gpu_runtime, monkeypatch, make_mesh, op, pinned):
  """benchmarks/bench_multi_gpu.py records the algorithm and stage plan each call took from its lowering."""
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
  import bench_multi_gpu as bench

  monkeypatch.setenv("JAX_OVERLAP_PIPELINE_STAGES", pinned)
  mesh, operands = make_mesh((4,), ("tp",)), _operands(op, 4, 4096, 512, 256)
  want = [int(s) for s in pinned.split(",")]
  assert bench.lowered_choice(op, _lowered(_op_fn(op, mesh, "pipelined"), *operands)) == ("pipelined", want)
  assert bench.lowered_choice(op, _lowered(_op_fn(op, mesh, "fused"), *operands)) == ("fused", None)
  assert bench.lowered_choice(op, _lowered(_op_fn(op, mesh, "xla"), *operands)) == ("xla", None)
