"""The GPU lowering of float8 calls on a CPU machine: lower for "cuda" on a stand-in runtime (tests/fake_gpu.py, an
H200's sm_90) and read the custom calls: their operands (x, w K-major, bias, x_scale f32[1], w_scale f32[1]),
their results, the bias XLA adds after a float32 GEMM, and the calls no GPU algorithm takes."""

import inspect
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap.runtime import backend

from fake_gpu import custom_calls as _custom_calls, cuda_text as _lowered

pytestmark = pytest.mark.skipif("x_scale" not in inspect.signature(jax_overlap.ag_matmul).parameters,
                                reason="needs the float8 API of issue 27 (x_scale, w_scale, out_dtype)")

E4M3 = jnp.float8_e4m3fn


def _spec(*shape, dtype=E4M3):
  return jax.ShapeDtypeStruct(shape, dtype)


def _fn(op, mesh, *, algorithm="pipelined", bias=False, out_dtype=jnp.bfloat16, w_kmajor=False, **kwargs):
  """jit(shard_map(op)) over "tp" of float8 x and w with each rank's scales (one per rank, P("tp"))."""
  fn = getattr(jax_overlap, op)
  if op == "ag_matmul":
    specs = [P("tp"), P("tp", None) if w_kmajor else P(None, "tp")]
    bias_spec, out_spec = P("tp"), P(None, "tp")
  else:
    specs = [P(None, "tp"), P(None, "tp") if w_kmajor else P("tp", None)]
    bias_spec, out_spec = P(), P("tp")

  def body(x, w, sx, sw, *b):
    return fn(x, w, *b, x_scale=sx[0], w_scale=sw[0], out_dtype=out_dtype, w_kmajor=w_kmajor, axis_name="tp",
              algorithm=algorithm, **kwargs)

  in_specs = (*specs, P("tp"), P("tp"), *([bias_spec] if bias else []))
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec))


def _operands(op, world, rows=4096, k=512, n=256, w_kmajor=False, bias_dtype=None):
  """Global shapes whose per-rank GEMM is [rows, k] @ [k, n] (ag_matmul: rows of the gathered x)."""
  if op == "ag_matmul":
    x, w, bias_n = _spec(rows, k), _spec(world * n, k) if w_kmajor else _spec(k, world * n), world * n
  else:
    x, w, bias_n = _spec(rows, world * k), _spec(n, world * k) if w_kmajor else _spec(world * k, n), n
  scales = (_spec(world, dtype=jnp.float32),) * 2
  return (x, w, *scales, *([_spec(bias_n, dtype=bias_dtype)] if bias_dtype is not None else []))


def _signature(call):
  operands, results = call.split(" : ")[-1].split(" -> ")
  return operands, results


@pytest.mark.parametrize("w_kmajor", [False, True])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_float8_call_with_peers(fake_gpu_runtime, make_mesh, op, w_kmajor):
  """w reaches the call K-major ([n, k], w_kmajor = 1): transposed by the lowering when given [k, n]; the scales
  as f32[1]; ag_matmul returns the gathered float8 x and each shard's scale."""
  mesh = make_mesh((4,), ("tp",))
  text = _lowered(_fn(op, mesh, w_kmajor=w_kmajor), *_operands(op, 4, w_kmajor=w_kmajor))
  calls = _custom_calls(text)
  assert len(calls) == 1 and f"@jax_overlap_{op}_pipelined(" in calls[0], calls
  assert "w_kmajor = 1" in calls[0]
  assert ("stablehlo.transpose" in text) != w_kmajor
  operands, results = _signature(calls[0])
  x = "tensor<1024x512xf8E4M3FN>" if op == "ag_matmul" else "tensor<4096x512xf8E4M3FN>"
  assert operands == f"({x}, tensor<256x512xf8E4M3FN>, tensor<0xbf16>, tensor<1xf32>, tensor<1xf32>)"
  if op == "ag_matmul":
    assert re.match(r"\(tensor<4096x256xbf16>, tensor<4096x512xf8E4M3FN>, tensor<4xf32>, tensor<\d+xui8>\)",
                    results), results
  else:
    assert re.match(r"\(tensor<1024x256xbf16>, tensor<\d+xui8>\)", results), results


@pytest.mark.parametrize("world", [1, 4])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_fast_accumulation_reaches_the_custom_call(fake_gpu_runtime, make_mesh, op, world):
  """fast_accumulation is an attribute of the vendor GEMM's call (a group of one) and of the pipelined call's
  config: 1 when asked for, 0 by default."""
  mesh = make_mesh((world,), ("tp",))
  target = "vendor_gemm" if world == 1 else f"{op}_pipelined"
  for fast in (False, True):
    calls = _custom_calls(_lowered(_fn(op, mesh, fast_accumulation=fast), *_operands(op, world)))
    assert len(calls) == 1 and f"@jax_overlap_{target}" in calls[0], calls
    assert f"fast_accumulation = {int(fast)}" in calls[0], calls[0]


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_a_shared_x_scale_reaches_the_custom_call(fake_gpu_runtime, make_mesh, op):
  """x_scale_shared is 1 in the pipelined call's config where x_scale is the same on every rank: replicated into
  shard_map (invariant over "tp"), not where each rank has its own; matmul_rs reduces partials and never shares."""
  mesh = make_mesh((4,), ("tp",))
  fn = getattr(jax_overlap, op)
  for x_scale_spec, shared in ((P("tp"), False), (P(), op == "ag_matmul")):
    body = lambda x, w, sx, sw: fn(x, w, x_scale=sx[0], w_scale=sw[0], axis_name="tp",  # noqa: E731
                                   algorithm="pipelined")
    specs = (P("tp"), P(None, "tp")) if op == "ag_matmul" else (P(None, "tp"), P("tp", None))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(*specs, x_scale_spec, P("tp")),
                              out_specs=P(None, "tp") if op == "ag_matmul" else P("tp")))
    x, w, _, sw = _operands(op, 4)
    calls = _custom_calls(_lowered(f, x, w, _spec(4 if x_scale_spec == P("tp") else 1, dtype=jnp.float32), sw))
    assert len(calls) == 1 and f"@jax_overlap_{op}_pipelined(" in calls[0], calls
    assert f"x_scale_shared = {int(shared)}" in calls[0], calls[0]


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_float8_region_follows_the_element_sizes(fake_gpu_runtime, make_mesh, op):
  """A float8 call's region is sized for its 1-byte x, its output's partials and (ag_matmul) its shards' scale
  headers, and keyed by them."""
  calls = []
  sizes = fake_gpu_runtime.pipelined_region_bytes
  fake_gpu_runtime.pipelined_region_bytes = lambda *args: calls.append(args) or sizes(*args)
  _lowered(_fn(op, make_mesh((4,), ("tp",)), out_dtype=jnp.float32), *_operands(op, 4))
  m = 1024 if op == "ag_matmul" else 4096  # x's rows per rank
  assert calls == [(op, 4, 1, m, 512, 256, 1, 4, True, False)]
  ((key, (_, nbytes)),) = backend.current().state.regions.items()
  assert key[2][-4:] == (1, 4, True, False) and nbytes == sizes(*calls[0])


@pytest.mark.parametrize("world", [1, 4])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
@pytest.mark.parametrize("bias_dtype,out_dtype", [(jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.bfloat16),
                                                  (jnp.float32, jnp.float32)])
def test_float8_bias(fake_gpu_runtime, make_mesh, op, world, bias_dtype, out_dtype):
  """A bias in a 16-bit output's dtype goes to the call (the GEMM's epilogue, or matmul_rs's reduction); a
  float32 one goes to matmul_rs's reduction, and where a GEMM would add it, the call writes y in float32 without
  it and XLA adds it in float32, rounding once."""
  mesh = make_mesh((world, 8 // world), ("tp", "dp"))
  text = _lowered(_fn(op, mesh, bias=True, out_dtype=out_dtype), *_operands(op, world, bias_dtype=bias_dtype))
  (call,) = _custom_calls(text)
  operands, results = _signature(call)
  by_reduction = op == "matmul_rs" and world > 1
  by_xla = not by_reduction and (bias_dtype == jnp.float32)
  bias_type = {jnp.bfloat16: "bf16", jnp.float32: "f32"}[bias_dtype]
  out_type = {jnp.bfloat16: "bf16", jnp.float32: "f32"}[out_dtype]
  if by_xla:
    assert f"tensor<0x{out_type}>, tensor<1xf32>, tensor<1xf32>)" in operands
    assert results.startswith("(tensor<") and "xf32>" in results.split(",")[0]
    assert re.search(r"stablehlo.add .*tensor<\d+x\d+xf32>", text.split("@jax_overlap")[-1])
  else:
    assert re.search(rf"tensor<\d+x{bias_type}>, tensor<1xf32>, tensor<1xf32>\)$", operands), operands
    assert f"x{out_type}>" in results.split(",")[0]


def test_float8_format_the_device_cannot_run(fake_gpu_runtime, make_mesh):
  """The H200 (sm_90) runs the OCP formats only: an explicit pipelined call of e4m3fnuz raises naming the format
  and the device; auto takes the XLA path."""
  mesh = make_mesh((4,), ("tp",))
  fnuz = [_spec(*s.shape, dtype=jnp.float8_e4m3fnuz) if s.dtype == E4M3 else s for s in _operands("ag_matmul", 4)]
  with pytest.raises(ValueError, match=r"float8_e4m3fnuz.*sm_90"):
    _lowered(_fn("ag_matmul", mesh), *fnuz)
  assert _custom_calls(_lowered(_fn("ag_matmul", mesh, algorithm="auto"), *fnuz)) == []


def test_fused_refuses_float8_saying_why(fake_gpu_runtime, make_mesh):
  mesh = make_mesh((4,), ("tp",))
  with pytest.raises(ValueError, match=r"fused.*float8_e4m3fn"):
    _lowered(_fn("ag_matmul", mesh, algorithm="fused"), *_operands("ag_matmul", 4))


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_auto_takes_the_float8_pipelined_call(fake_gpu_runtime, make_mesh, op):
  mesh = make_mesh((8,), ("tp",))
  calls = _custom_calls(_lowered(_fn(op, mesh, algorithm="auto"), *_operands(op, 8, 16384, 8192, 8192)))
  assert len(calls) == 1 and f"@jax_overlap_{op}_pipelined(" in calls[0]


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_auto_takes_the_vendor_float8_gemm_for_a_group_of_one(fake_gpu_runtime, make_mesh, op):
  """XLA's fp8 forms ran 1.1x (16384 rows) to 3.1x (2048 rows) slower than cuBLASLt's fp8 GEMM on the H200 (jax
  0.11.2, 2026-12-01): a float8 group of one under auto is the vendor GEMM, where a 16-bit one stays XLA's dot."""
  mesh = make_mesh((1,), ("tp",))
  calls = _custom_calls(_lowered(_fn(op, mesh, algorithm="auto"), *_operands(op, 1)))
  assert len(calls) == 1 and "@jax_overlap_vendor_gemm" in calls[0]
  bf16 = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16)
  f = jax.jit(jax.shard_map(lambda x, w: getattr(jax_overlap, op)(x, w, axis_name="tp"), mesh=mesh,
                            in_specs=(P("tp"), P()), out_specs=P("tp")))
  assert _custom_calls(_lowered(f, bf16, bf16)) == []


@pytest.mark.parametrize("rows, dw_gemms", [(32, 1), (25, 0)])
def test_fp8_layer_weight_gradient_is_a_group_of_ones_vendor_gemm(fake_gpu_runtime, make_mesh, rows, dw_gemms):
  """Fp8AgDotGeneral(algorithm="pipelined")'s training step over 4 GPUs: the forward and the dual op are pipelined
  calls over the group, and dW is the vendor's fp8 GEMM of a group of one, or XLA's dot where its contraction
  (the 4 * rows gathered rows) is no multiple of 16: never an error, whatever algorithm the layer was given. The
  casts without a transpose (x, dy, and w again for the dual op) are the project's float8 cast."""
  mesh = make_mesh((4,), ("tp",))
  dot = jax_overlap.Fp8AgDotGeneral(axis_name="tp", algorithm="pipelined")

  def step(x, w, ct):
    y, vjp = jax.vjp(lambda x, w: dot(x, w, (((1,), (0,)), ((), ()))), x, w)
    return (y, *vjp(ct))
  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P(None, "tp")),
                            out_specs=(P(None, "tp"), P("tp"), P(None, "tp"))))
  bf16 = jnp.bfloat16
  calls = _custom_calls(_lowered(f, _spec(4 * rows, 256, dtype=bf16), _spec(256, 512, dtype=bf16),
                                 _spec(4 * rows, 512, dtype=bf16)))
  targets = sorted(re.search(r"@(\w+)\(", call).group(1) for call in calls)
  assert targets == sorted(["jax_overlap_ag_matmul_pipelined", "jax_overlap_matmul_rs_pipelined"]
                           + ["jax_overlap_vendor_gemm"] * dw_gemms + ["jax_overlap_fp8_cast"] * 3), calls
  # The forward GEMM accumulates fast (TransformerEngine's forward numerics); the gradients' GEMMs do not.
  fast = {re.search(r"@(\w+)\(", c).group(1): re.search(r"fast_accumulation = (\d)", c).group(1) for c in calls
          if "fast_accumulation" in c}
  assert fast == {"jax_overlap_ag_matmul_pipelined": "1", "jax_overlap_matmul_rs_pipelined": "0",
                  **({"jax_overlap_vendor_gemm": "0"} if dw_gemms else {})}, calls


@pytest.mark.parametrize("fast", [True, False])
def test_delayed_layer_forward_accumulates_as_flaxs(fake_gpu_runtime, fast):
  """Fp8DelayedAgDotGeneral's forward GEMM (a group of one: the vendor GEMM) accumulates fast unless told not to,
  as Flax's op (its forward dot at precision DEFAULT)."""
  from jax_overlap import Fp8DelayedAgDotGeneral
  dims = (((1,), (0,)), ((), ()))
  module = Fp8DelayedAgDotGeneral(fast_accumulation=fast)
  x, w = jnp.ones((256, 512), jnp.bfloat16), jnp.ones((512, 256), jnp.bfloat16)
  variables = jax.eval_shape(lambda: module.init(jax.random.key(0), x, w, dims))
  variables = jax.tree.map(lambda v: jnp.ones(v.shape, v.dtype), variables)
  f = jax.jit(lambda v, x, w: module.apply(v, x, w, dims))
  calls = [c for c in _custom_calls(_lowered(f, variables, x, w)) if "@jax_overlap_vendor_gemm" in c]
  assert len(calls) == 1 and f"fast_accumulation = {int(fast)}" in calls[0], calls
