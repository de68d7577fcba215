"""The scaling mode travels to the GPU calls in their attributes (issue 52.6): one enum, csrc/core/scale_mode.h
ScaleMode, that Scaling.code mirrors (the header and the harness module's SCALE_MODES against Python), and in every
float8 call's config as the lowering emits it on a stand-in GPU runtime (tests/fake_gpu.py). The handlers' refusal
of scales whose shape disagrees with the mode: tests/test_native_contracts.py (check_gemm on a CPU) and
tests/gpu/test_scale_mode_gpu.py (through a call on a GPU)."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap.quantization import scaling
from jax_overlap.runtime import native

import native_testing
from fake_gpu import cuda_text, custom_calls

CSRC = Path(__file__).parents[1] / "csrc"
E4M3 = jnp.float8_e4m3fn


def python_modes() -> dict:
  return {"none": scaling.NO_SCALES_CODE, **{m.name: m.code for m in scaling.MODES.values()}}


def test_the_header_enum_is_pythons():
  text = (CSRC / "core" / "scale_mode.h").read_text()
  enum = re.search(r"enum class ScaleMode : int64_t \{(.*?)\};", text, re.S).group(1)
  values = {name.lower(): int(v) for name, v in re.findall(r"k(\w+) = (\d+)", enum)}
  assert values == python_modes()
  assert scaling.code(None) == 0 and scaling.code(scaling.TENSOR.accumulating(True)) == scaling.TENSOR.code


@pytest.mark.skipif(native.module() is None, reason="needs jax_overlap's native module (a pure-Python install has "
                                                    "none)")
def test_the_native_modes_are_pythons():
  assert dict(native_testing.module().SCALE_MODES) == python_modes()


def _config(call: str) -> dict:
  """The members of a custom call's `config` dictionary attribute, by name."""
  body = re.search(r"config = \{(.*?)\}", call).group(1)
  return {k: int(v) for k, v in re.findall(r"(\w+) = (-?\d+) : i64", body)}


def _pipelined_config_members() -> list:
  common_h = (CSRC / "ffi" / "common.h").read_text()
  decoding = re.search(r"XLA_FFI_REGISTER_STRUCT_ATTR_DECODING\(::jo::PipelinedConfig,(.*?)\);", common_h,
                       re.S).group(1)
  return re.findall(r'StructMember<int64_t>\("(\w+)"\)', decoding)


def _lower(op, mesh, x, w, sx=None, sw=None):
  fn = getattr(jax_overlap, op)
  scaled = sx is not None
  if op == "ag_matmul":
    specs, out_spec = (P("tp"), P("tp", None)), P(None, "tp")
  else:
    specs, out_spec = (P(None, "tp"), P(None, "tp")), P("tp")
  world = mesh.shape["tp"]
  scale_specs = ((P("tp"), P("tp")) if sx.ndim == 1 else (P(), P())) if scaled else ()

  def body(x, w, *s):
    kw = dict(x_scale=s[0][0] if s[0].ndim == 1 else s[0], w_scale=s[1][0] if s[1].ndim == 1 else s[1]) \
        if s else {}
    return fn(x, w, axis_name="tp", algorithm="pipelined", w_kmajor=True, **kw)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(*specs, *scale_specs), out_specs=out_spec))
  args = (x, w) + ((sx, sw) if scaled else ())
  calls = custom_calls(cuda_text(f, *args))
  assert len(calls) == 1, calls
  target = "vendor_gemm" if world == 1 else f"{op}_pipelined"
  assert f"@jax_overlap_{target}(" in calls[0], calls
  return calls[0]


def _spec(*shape, dtype=E4M3):
  return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
@pytest.mark.parametrize("mode", ["none", "tensor"])
def test_the_pipelined_config_carries_the_mode_and_every_member(fake_gpu_runtime, make_mesh, op, mode):
  mesh = make_mesh((4,), ("tp",))
  dtype = jnp.bfloat16 if mode == "none" else E4M3
  x = _spec(4096, 512, dtype=dtype) if op == "ag_matmul" else _spec(4096, 4 * 512, dtype=dtype)
  w = _spec(4 * 256, 512, dtype=dtype) if op == "ag_matmul" else _spec(256, 4 * 512, dtype=dtype)
  scales = (_spec(4, dtype=jnp.float32),) * 2 if mode == "tensor" else (None, None)
  config = _config(_lower(op, mesh, x, w, *scales))
  assert sorted(config) == sorted(_pipelined_config_members())
  assert config["scaling"] == python_modes()[mode]


def test_block_scales_reach_the_pipelined_config_as_block(fake_gpu_runtime, make_mesh):
  """matmul_rs with peers and block scales (w K-major [n, k], x_scale [..., m, k/128], w_scale [n/128, k/128])."""
  mesh = make_mesh((4,), ("tp",))
  m, k, n = 1024, 4 * 512, 256
  x, w = _spec(m, k), _spec(n, k)
  sx, sw = _spec(m, k // 128, dtype=jnp.float32), _spec(n // 128, k // 128, dtype=jnp.float32)
  fn = lambda x, w, sx, sw: jax_overlap.matmul_rs(x, w, x_scale=sx, w_scale=sw, axis_name="tp",  # noqa: E731
                                                  algorithm="pipelined", w_kmajor=True)
  f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), P(None, "tp"), P(None, "tp")),
                            out_specs=P("tp")))
  calls = custom_calls(cuda_text(f, x, w, sx, sw))
  assert len(calls) == 1 and "@jax_overlap_matmul_rs_pipelined(" in calls[0], calls
  assert _config(calls[0])["scaling"] == scaling.BLOCK.code


@pytest.mark.parametrize("mode", ["none", "tensor"])
def test_the_vendor_gemm_of_a_group_of_one_carries_the_mode(fake_gpu_runtime, make_mesh, mode):
  mesh = make_mesh((1,), ("tp",))
  dtype = jnp.bfloat16 if mode == "none" else E4M3
  scales = (_spec(1, dtype=jnp.float32),) * 2 if mode == "tensor" else (None, None)
  call = _lower("matmul_rs", mesh, _spec(256, 512, dtype=dtype), _spec(256, 512, dtype=dtype), *scales)
  assert f"scaling = {python_modes()[mode]} : i64" in call, call
