"""The GPU lowering on a CPU machine: lower for "cuda" with a stand-in runtime and read the custom calls.

No GPU runs here; this checks what the lowering hands the FFI handlers: the target, the config
attribute, and each group's global device ids in rank order for the mesh axis.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap import config, native, runtime

pytestmark = pytest.mark.skipif(native.platform() != "cuda", reason="needs the CUDA build of the extension")


@pytest.fixture
def fake_gpu_runtime(monkeypatch):
  """A runtime that believes it has every CPU device as a reachable GPU."""
  monkeypatch.setattr(runtime._state, "active", True)
  monkeypatch.setattr(runtime._state, "workspace_bytes", 1 << 30)
  monkeypatch.setattr(runtime._state, "next_offset", native.module().REGIONS_OFFSET)
  monkeypatch.setattr(runtime._state, "regions", {})
  monkeypatch.setattr(runtime._state, "reachable", {d.id for d in jax.devices()})
  monkeypatch.setattr(runtime, "initialize", lambda **kw: runtime.workspace_info())
  monkeypatch.setattr(runtime, "device_props", lambda: config.DeviceProps(sm_count=132, smem_per_block=232448))
  monkeypatch.setattr(native, "ensure_registered", lambda: None)


def _custom_calls(text):
  return [line for line in text.splitlines() if "stablehlo.custom_call @jax_overlap" in line]


def _groups(line):
  ids = re.search(r"groups = (?:dense<\[?([-\d, ]+)\]?>|array<i64: ([-\d, ]+)>)", line)
  return [int(v) for v in (ids.group(1) or ids.group(2)).split(",")]


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
  assert len(runtime._state.regions) == 2  # one region per (op, group, shape)


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
  assert "groups" not in calls[0] and "world" not in calls[0]
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
  nbytes = native.module().tail_scratch_bytes(0, slots)
  assert nbytes == (1056 + 132 * 128 * 256 * 4 if slots else 0)  # 8-byte flags (16-byte multiple), fp32 tiles
  assert re.search(rf"-> \(tensor<2048x3584xbf16>, tensor<{nbytes}xui8>\)$", calls[0].split(" : ")[-1].strip())


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
