"""The float8 cast primitive (jax_overlap/ops/fp8_cast.py) on CPU: its value is quantization/numerics.quantize's
(eager, jit, vmap with a shared scale or a scale per element), and where its GPU lowering takes the kernel, from
the custom calls of a lowering for "cuda" on the stand-in runtime (tests/fake_gpu.py, an H200's sm_90): one device
and each shard inside shard_map take it; global arrays over several devices, a partially manual shard_map,
algorithm="xla", JAX_OVERLAP_DISABLE, a format of the other family and a float8 input keep XLA's form. The
delayed-scaling step scales (ops/fp8_scales.py) alike: one step kernel where the casts take theirs, the casts'
amaxes then starting from its zeros. The kernels' values against XLA's, bit for bit:
tests/gpu/test_fp8_cast_kernel.py, tests/gpu/test_fp8_scales_kernel.py."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_overlap
from jax_overlap.integration import fp8_lowering
from jax_overlap.ops import fp8_cast, fp8_scales
from jax_overlap.quantization import numerics
from jax_overlap.runtime import native

import native_testing
from fake_gpu import FakeNative, custom_calls, cuda_text, install

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FORMATS = [E4M3, E5M2, jnp.float8_e4m3fnuz, jnp.float8_e5m2fnuz]


def _x(shape=(64, 96), dtype=jnp.bfloat16, seed=0):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_normal(shape) * 10.0 ** rng.uniform(-6, 1, shape), dtype)


def _bits(a):
  return np.asarray(a).view(np.uint8)


@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda d: np.dtype(d).name)
def test_value_is_numerics_quantize(fmt, x_dtype):
  x = _x(dtype=x_dtype)
  q, scale = jax.jit(lambda x: fp8_cast.current_scaling(x, fmt))(x)
  want = numerics.quantize(x, fmt, numerics.fp8_scale(jnp.max(jnp.abs(x)), fmt))
  assert q.dtype == jnp.dtype(fmt) and q.shape == x.shape
  np.testing.assert_array_equal(_bits(q), _bits(want))
  np.testing.assert_array_equal(_bits(fp8_cast.cast(x, scale, fmt)), _bits(want))  # eager
  # the scale maps the amax onto the format's range, and the cast keeps every value within it
  assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) <= float(jnp.finfo(fmt).max)
  assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) > float(jnp.finfo(fmt).max) / 2


def test_vmap_with_a_shared_scale_and_with_a_scale_each():
  xs = jnp.stack([_x(seed=s) for s in range(3)])
  scale = jnp.float32(0.25)
  shared = jax.vmap(lambda x: fp8_cast.cast(x, scale, E4M3), in_axes=0)(xs)
  np.testing.assert_array_equal(_bits(shared), _bits(numerics.quantize(xs, E4M3, scale)))
  q, scales = jax.vmap(lambda x: fp8_cast.current_scaling(x, E4M3), in_axes=1, out_axes=(1, 0))(xs.transpose(1, 0, 2))
  for i in range(3):
    want = numerics.quantize(xs[i], E4M3, numerics.fp8_scale(jnp.max(jnp.abs(xs[i])), E4M3))
    np.testing.assert_array_equal(_bits(q[:, i]), _bits(want))
    assert float(scales[i]) == float(numerics.fp8_scale(jnp.max(jnp.abs(xs[i])), E4M3))


@pytest.fixture
def fake_gpu(monkeypatch):
  install(monkeypatch.setattr, FakeNative())


def _casts(f, *args) -> list:
  return [c for c in custom_calls(cuda_text(jax.jit(f), *args)) if "@jax_overlap_fp8_cast(" in c]


def test_one_device_takes_the_kernel(fake_gpu):
  x = jax.ShapeDtypeStruct((64, 96), jnp.bfloat16)
  calls = _casts(lambda x: fp8_cast.current_scaling(x, E4M3)[0], x)
  assert len(calls) == 1
  assert "tensor<64x96xbf16>" in calls[0] and "tensor<f32>" in calls[0] and "tensor<64x96xf8E4M3FN>" in calls[0]
  assert _casts(lambda x: fp8_cast.current_scaling(x, E5M2, algorithm="xla")[0], x) == []


def test_shards_inside_shard_map_take_the_kernel(fake_gpu, make_mesh):
  mesh = make_mesh((4,), ("tp",))
  f = jax.shard_map(lambda x: fp8_cast.current_scaling(x, E4M3)[0], mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))
  calls = _casts(f, jax.ShapeDtypeStruct((64, 96), jnp.float32))
  assert len(calls) == 1 and "tensor<16x96xf32>" in calls[0]


def test_global_arrays_over_several_devices_keep_xlas_cast(fake_gpu, make_mesh):
  mesh = make_mesh((4,), ("tp",))
  x = jax.ShapeDtypeStruct((64, 96), jnp.bfloat16, sharding=NamedSharding(mesh, P("tp")))
  assert _casts(lambda x: fp8_cast.current_scaling(x, E4M3)[0], x) == []


def test_partially_manual_shard_map_keeps_xlas_cast(fake_gpu, make_mesh):
  mesh = make_mesh((2, 2), ("dp", "tp"))
  f = jax.shard_map(lambda x: fp8_cast.current_scaling(x, E4M3)[0], mesh=mesh, in_specs=P("tp"), out_specs=P("tp"),
                    axis_names={"tp"})
  x = jax.ShapeDtypeStruct((64, 96), jnp.bfloat16, sharding=NamedSharding(mesh, P("tp", "dp")))
  assert _casts(f, x) == []


def test_what_the_kernel_does_not_take_keeps_xlas_cast(fake_gpu, monkeypatch):
  x = jax.ShapeDtypeStruct((64, 96), jnp.bfloat16)
  # a format of the other family (fnuz: gfx942's) on an sm_90
  assert _casts(lambda x: fp8_cast.current_scaling(x, jnp.float8_e4m3fnuz)[0], x) == []
  # a float8 input
  assert _casts(lambda x: fp8_cast.cast(x, jnp.float32(2.0), E5M2), jax.ShapeDtypeStruct((8, 8), E4M3)) == []
  monkeypatch.setenv("JAX_OVERLAP_DISABLE", "1")
  assert _casts(lambda x: fp8_cast.current_scaling(x, E4M3)[0], x) == []


def test_fp8_layers_cast_with_the_kernel_unless_xla(fake_gpu, make_mesh):
  """The layers' casts without a transpose (x; in the backward pass dy and w again for the dual op) take the kernel;
  with algorithm="xla", or cast_algorithm="xla" (the ops still the pipelined path's), none does."""
  mesh = make_mesh((2,), ("tp",))
  dims = (((1,), (0,)), ((), ()))
  x, w = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16), jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)

  def grads(algorithm, cast_algorithm="auto"):
    dot = jax_overlap.Fp8RsDotGeneral(axis_name="tp", algorithm=algorithm, cast_algorithm=cast_algorithm)
    loss = lambda x, w: jnp.sum(dot(x, w, dims).astype(jnp.float32) ** 2)
    return jax.shard_map(jax.grad(loss, argnums=(0, 1)), mesh=mesh, in_specs=(P(None, "tp"), P("tp")),
                         out_specs=(P(None, "tp"), P("tp")))
  assert len(_casts(grads("auto"), x, w)) == 3
  assert _casts(grads("xla"), x, w) == []
  assert _casts(grads("auto", cast_algorithm="xla"), x, w) == []
  assert _casts(grads("auto", cast_algorithm="kernels"), x, w) == _casts(grads("auto"), x, w)


@pytest.mark.parametrize("layer", ["Fp8AgDotGeneral", "Fp8RsDotGeneral", "Fp8DelayedAgDotGeneral",
                                   "Fp8DelayedRsDotGeneral"])
def test_fp8_layers_bad_cast_algorithm_is_an_error_naming_it(layer):
  with pytest.raises(ValueError, match=rf"jax_overlap.{layer}: cast_algorithm must be one of "
                                       r"\('auto', 'kernels', 'xla'\), got 'kernel'"):
    getattr(jax_overlap, layer)(cast_algorithm="kernel")


@pytest.mark.parametrize("devices", [1, 4])
def test_explicit_meshes(fake_gpu, make_mesh, devices):
  """Arrays typed by an Explicit mesh: one device takes the kernel, four keep XLA's cast; the value stays
  numerics.quantize's (run on the CPU devices)."""
  mesh = make_mesh((devices,), ("tp",), AxisType.Explicit)
  x = jax.device_put(_x(), NamedSharding(mesh, P("tp")))
  f = jax.jit(lambda x: fp8_cast.current_scaling(x, E4M3)[0])
  with jax.set_mesh(mesh):
    calls = [c for c in custom_calls(cuda_text(f, x)) if "@jax_overlap_fp8_cast(" in c]
    got = f(x)
  assert len(calls) == (1 if devices == 1 else 0)
  want = numerics.quantize(_x(), E4M3, numerics.fp8_scale(jnp.max(jnp.abs(_x())), E4M3))
  np.testing.assert_array_equal(_bits(got), _bits(want))


def test_bad_scale_and_dtype_raise_at_trace_time():
  x = _x()
  with pytest.raises(TypeError, match="scale must be a float32 scalar"):
    fp8_cast.cast(x, jnp.ones((2,), jnp.float32), E4M3)
  with pytest.raises(TypeError, match="scale must be a float32 scalar"):
    fp8_cast.cast(x, jnp.bfloat16(1.0), E4M3)
  with pytest.raises(TypeError, match="dtype must be a float8 format"):
    fp8_cast.cast(x, jnp.float32(1.0), jnp.bfloat16)


def test_inside_shard_map_the_result_varies_with_the_scale(make_mesh):
  """x the same on every rank, each rank's own scale: each rank's cast with its scale (the result varies)."""
  mesh = make_mesh((4,), ("tp",))
  x = _x((8, 128))
  scales = jnp.asarray([2.0 ** -e for e in range(4)], jnp.float32)
  f = jax.jit(jax.shard_map(lambda x, s: fp8_cast.cast(x, s[0], E4M3), mesh=mesh, in_specs=(P(), P("tp")),
                            out_specs=P("tp")))
  got = f(x, scales)
  for r in range(4):
    np.testing.assert_array_equal(_bits(got[8 * r:8 * (r + 1)]), _bits(numerics.quantize(x, E4M3, scales[r])))


# --- the variant with amax (the delayed-scaling layers') ------------------------------------------------------------

@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda d: np.dtype(d).name)
def test_cast_with_amax_is_the_saturated_cast_and_the_amax(fmt, x_dtype):
  """Its cast is numerics.quantize_saturated's (quantize's where x is within the scale's range, the format's largest
  value of the sign beyond it) and its amax is max |x| in float32, eager and under jit."""
  x = _x(dtype=x_dtype)
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  for scale in (numerics.fp8_scale(amax, fmt), amax / float(jnp.finfo(fmt).max) / 8):  # covering x; an eighth
    for run in (fp8_cast.cast_with_amax, jax.jit(fp8_cast.cast_with_amax, static_argnums=2)):
      q, got_amax = run(x, scale, fmt)
      assert q.dtype == jnp.dtype(fmt) and got_amax.dtype == jnp.float32 and got_amax.shape == ()
      np.testing.assert_array_equal(_bits(q), _bits(numerics.quantize_saturated(x, fmt, scale)))
      assert float(got_amax) == float(amax)
  within = jnp.abs(x.astype(jnp.float32)) <= amax / 8
  q, _ = fp8_cast.cast_with_amax(x, scale, fmt)
  np.testing.assert_array_equal(_bits(q)[np.asarray(within)],
                                _bits(numerics.quantize(x, fmt, scale))[np.asarray(within)])
  top = float(jnp.finfo(fmt).max)
  assert set(np.unique(np.asarray(q.astype(jnp.float32))[~np.asarray(within)]).tolist()) <= {-top, top}


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda d: np.dtype(d).name)
def test_cast_with_amax_nan_inf_and_empty(fmt):
  x = np.array(_x((4, 33), jnp.float32))
  x[1, 5], x[3, 0] = np.nan, -np.inf
  q, amax = fp8_cast.cast_with_amax(jnp.asarray(x), jnp.float32(0.5), fmt)
  assert np.isnan(float(amax))
  qf = np.asarray(q.astype(jnp.float32))
  assert np.isnan(qf[1, 5]) and qf[3, 0] == -float(jnp.finfo(fmt).max)
  x[1, 5] = 0
  assert float(fp8_cast.cast_with_amax(jnp.asarray(x), jnp.float32(0.5), fmt)[1]) == np.inf
  q, amax = fp8_cast.cast_with_amax(jnp.zeros((0, 8), jnp.bfloat16), jnp.float32(1), fmt)
  assert q.shape == (0, 8) and float(amax) == 0.0


def test_cast_with_amax_vmapped_gives_each_elements_amax():
  xs = jnp.stack([_x(seed=s) * (s + 1) for s in range(3)])
  q, amaxes = jax.vmap(lambda x: fp8_cast.cast_with_amax(x, jnp.float32(0.25), E4M3))(xs)
  np.testing.assert_array_equal(np.asarray(amaxes), np.asarray(jnp.max(jnp.abs(xs), axis=(1, 2)), np.float32))
  np.testing.assert_array_equal(_bits(q), _bits(numerics.quantize_saturated(xs, E4M3, jnp.float32(0.25))))


def _amax_casts(f, *args) -> list:
  return [c for c in custom_calls(cuda_text(jax.jit(f), *args)) if "@jax_overlap_fp8_cast_amax(" in c]


def test_cast_with_amax_lowers_to_its_kernel_where_the_cast_does(fake_gpu, make_mesh):
  """One device and each shard inside shard_map take the kernel's variant (two results: the cast and an f32[]);
  global arrays over several devices and algorithm="xla" keep XLA's form."""
  x = jax.ShapeDtypeStruct((64, 96), jnp.bfloat16)
  calls = _amax_casts(lambda x: fp8_cast.cast_with_amax(x, jnp.float32(2), E4M3), x)
  assert len(calls) == 1 and "tensor<64x96xf8E4M3FN>" in calls[0] and "tensor<f32>" in calls[0]
  assert _amax_casts(lambda x: fp8_cast.cast_with_amax(x, jnp.float32(2), E4M3, algorithm="xla"), x) == []
  mesh = make_mesh((4,), ("tp",))
  f = jax.shard_map(lambda x: fp8_cast.cast_with_amax(x, jnp.float32(2), E5M2)[0], mesh=mesh, in_specs=P("tp"),
                    out_specs=P("tp"))
  calls = _amax_casts(f, jax.ShapeDtypeStruct((64, 96), jnp.float32))
  assert len(calls) == 1 and "tensor<16x96xf32>" in calls[0]
  sharded = jax.ShapeDtypeStruct((64, 96), jnp.bfloat16, sharding=NamedSharding(mesh, P("tp")))
  assert _amax_casts(lambda x: fp8_cast.cast_with_amax(x, jnp.float32(2), E4M3), sharded) == []


# --- the transposing variant (cast_with_amax's lead: a weight cast into the GEMM's K-major layout) --------------

LEADS = [((64, 96), 1), ((32, 4, 24), 1), ((4, 8, 40), 2)]


@pytest.mark.parametrize("shape,lead", LEADS, ids=lambda v: str(v))
@pytest.mark.parametrize("fmt", [E4M3, jnp.float8_e5m2fnuz], ids=lambda d: np.dtype(d).name)
def test_cast_with_amax_moves_the_leading_dims_last(fmt, shape, lead):
  """lead > 0: the saturated cast of x with its first `lead` dims moved last, and the amax of x, eager and under
  jit; vmapped, each element's own."""
  x = _x(shape)
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  scale = amax / float(jnp.finfo(fmt).max) / 4  # a quarter of x saturates
  moved = jnp.moveaxis(x, tuple(range(lead)), tuple(range(-lead, 0)))
  for run in (fp8_cast.cast_with_amax, jax.jit(fp8_cast.cast_with_amax, static_argnums=2, static_argnames="lead")):
    q, got_amax = run(x, scale, fmt, lead=lead)
    assert q.shape == moved.shape and q.dtype == jnp.dtype(fmt)
    np.testing.assert_array_equal(_bits(q), _bits(numerics.quantize_saturated(moved, fmt, scale)))
    assert float(got_amax) == float(amax)
  xs = jnp.stack([x, x * 3])
  q, amaxes = jax.vmap(lambda x: fp8_cast.cast_with_amax(x, scale, fmt, lead=lead))(xs)
  np.testing.assert_array_equal(np.asarray(amaxes), [float(amax), float(jnp.max(jnp.abs(x * 3)))])
  np.testing.assert_array_equal(_bits(q[1]), _bits(numerics.quantize_saturated(moved * 3, fmt, scale)))


@pytest.mark.parametrize("lead", [-1, 2, True, 1.0])
def test_cast_with_amax_bad_lead_is_an_error_naming_it(lead):
  with pytest.raises(ValueError, match=r"lead must be 0 or an int from 1 to x.ndim - 1 \(1\), got"):
    fp8_cast.cast_with_amax(_x(), jnp.float32(1), E4M3, lead=lead)


@pytest.mark.skipif(native.module() is None, reason="needs jax_overlap's native module (a pure-Python install has "
                                                       "none)")
def test_transposing_variants_rule_is_the_kernels():
  """One rule in two languages: the shapes ops/fp8_cast.py sends to the transposing kernel are those its launch
  (kernels/fp8_cast.cu transposed_cast_declined) takes."""
  harness = native_testing.module()
  for rows in (16, 24, 32, 48, 128, 130, 8192, 128 * 65535, 128 * 65535 + 16):
    for cols in (8, 12, 40, 128, 3584, 3588):
      python = fp8_lowering.transposed_declined((rows, cols), 1)
      assert (python is None) == (harness.transposed_cast_declined(rows, cols) is None), (rows, cols, python)


def _transposed(f, *args) -> list:
  return [c for c in custom_calls(cuda_text(jax.jit(f), *args)) if "@jax_overlap_fp8_cast_amax_transposed(" in c]


def test_transposing_variant_lowers_where_its_tiles_take_x(fake_gpu, make_mesh, caplog):
  """The transposing kernel (its lead as an attribute, the moved shape as the result) where the moved dims hold a
  multiple of 16 elements and the others of 8; XLA's form otherwise (why at DEBUG), with algorithm="xla" and on
  global arrays over several devices; each shard inside shard_map takes it."""
  cast = lambda lead, **kw: lambda x: fp8_cast.cast_with_amax(x, jnp.float32(2), E4M3, lead=lead, **kw)
  calls = _transposed(cast(1), jax.ShapeDtypeStruct((64, 96), jnp.bfloat16))
  assert len(calls) == 1 and "tensor<96x64xf8E4M3FN>" in calls[0] and "lead = 1 : i64" in calls[0], calls
  calls = _transposed(cast(2), jax.ShapeDtypeStruct((4, 8, 40), jnp.float32))
  assert len(calls) == 1 and "tensor<40x4x8xf8E4M3FN>" in calls[0]
  with caplog.at_level("DEBUG", logger="jax_overlap"):
    for shape in ((24, 96), (64, 20)):  # 24 rows; 20 columns
      assert _transposed(cast(1), jax.ShapeDtypeStruct(shape, jnp.bfloat16)) == []
  assert "the transposing kernel takes multiples of 16 rows and 8 columns" in caplog.text
  assert _transposed(cast(1, algorithm="xla"), jax.ShapeDtypeStruct((64, 96), jnp.bfloat16)) == []
  mesh = make_mesh((4,), ("tp",))
  sharded = jax.ShapeDtypeStruct((64, 96), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "tp")))
  assert _transposed(cast(1), sharded) == []
  f = jax.shard_map(lambda x: cast(1)(x)[0], mesh=mesh, in_specs=P(None, "tp"), out_specs=P("tp"))
  calls = _transposed(f, jax.ShapeDtypeStruct((64, 128), jnp.bfloat16))
  assert len(calls) == 1 and "tensor<32x64xf8E4M3FN>" in calls[0]


@pytest.mark.parametrize("devices", [1, 4])
def test_transposing_variant_on_explicit_meshes(fake_gpu, make_mesh, devices):
  """x typed by an Explicit mesh, its columns on the axis: the result's type moves the spec with the dims (the
  columns' axis now leads), and the value is the moved saturated cast."""
  mesh = make_mesh((devices,), ("tp",), AxisType.Explicit)
  x = jax.device_put(_x((64, 96)), NamedSharding(mesh, P(None, "tp")))
  f = jax.jit(lambda x: fp8_cast.cast_with_amax(x, jnp.float32(0.01), E4M3, lead=1))
  with jax.set_mesh(mesh):
    calls = _transposed(f, x)
    q, amax = f(x)
  assert len(calls) == (1 if devices == 1 else 0)
  assert q.sharding.spec == P("tp", None) or devices == 1
  np.testing.assert_array_equal(_bits(q), _bits(numerics.quantize_saturated(_x((64, 96)).T, E4M3, 0.01)))
  assert float(amax) == float(jnp.max(jnp.abs(_x((64, 96)))))


def _calls(f, *args, target: str) -> list:
  """The custom calls of jax_overlap target `target` (exactly) in f's lowering for "cuda"."""
  return [c for c in custom_calls(cuda_text(jax.jit(f), *args)) if f"@jax_overlap_{target}(" in c]


def test_delayed_layers_cast_x_and_the_cotangent_with_the_kernels_variant(fake_gpu):
  """Fp8DelayedAgDotGeneral on one GPU: each step's scales from one step kernel (the forward's for x and the
  kernel, the backward's for the cotangent), x, the cotangent and the forward's kernel cast by the variants whose
  amax starts from the step kernel's zero (the amax result aliasing it: no memset), the dual op's kernel by the
  plain amax variant; with algorithm="xla" or cast_algorithm="xla" none of them."""
  from jax_overlap.layers.fp8_delayed import Fp8DelayedAgDotGeneral
  dims = (((1,), (0,)), ((), ()))
  x, w = jnp.zeros((64, 128), jnp.bfloat16), jnp.zeros((128, 256), jnp.bfloat16)

  def grads(algorithm, cast_algorithm="auto"):
    layer = Fp8DelayedAgDotGeneral(algorithm=algorithm, cast_algorithm=cast_algorithm)
    state = layer.init(jax.random.key(0), x, w, dims)
    return lambda x, w: jax.grad(lambda s, x, w: jnp.sum(layer.apply(s, x, w, dims).astype(jnp.float32) ** 2),
                                 argnums=(0, 1, 2))(state, x, w)
  targets = ("fp8_step_scales", "fp8_cast_amax_from", "fp8_cast_amax_from_transposed", "fp8_cast_amax",
             "fp8_cast_amax_transposed")
  for cast_algorithm in ("auto", "kernels"):
    calls = {t: _calls(grads("auto", cast_algorithm), x, w, target=t) for t in targets}
    assert [len(calls[t]) for t in targets] == [2, 2, 1, 1, 0], cast_algorithm
    assert sum("tensor<f32>, tensor<f32>, tensor<f32>, tensor<f32>" in c for c in calls["fp8_step_scales"]) == 1
    for c in calls["fp8_cast_amax_from"] + calls["fp8_cast_amax_from_transposed"]:
      assert "output_operand_aliases" in c and "operand_index = 2" in c, c
  for f in (grads("xla"), grads("auto", cast_algorithm="xla")):
    assert all(_calls(f, x, w, target=t) == [] for t in targets)
  assert any("jax_overlap_vendor_gemm" in c for c in custom_calls(cuda_text(jax.jit(grads("auto", "xla")), x, w)))


def test_step_scales_lower_to_the_kernel_where_the_casts_do(fake_gpu, make_mesh, caplog):
  """One device and each shard inside shard_map: one step kernel for all operands (their formats' largest values
  as its attribute); XLA's form with algorithm="xla", on global arrays over several devices, and for more operands
  than the kernel takes (why at DEBUG)."""
  s, h = jnp.float32(1), jnp.zeros(16, jnp.float32)
  steps = lambda n, **kw: lambda s, h: fp8_scales.step_scales([s] * n, [h] * n, [E4M3, E5M2, E4M3, E5M2, E4M3][:n],
                                                              **kw)
  calls = _calls(steps(2), s, h, target="fp8_step_scales")
  assert len(calls) == 1 and "fp8_max = dense<[4.480000e+02, 5.734400e+04]> : tensor<2xf32>" in calls[0], calls
  assert _calls(steps(2, algorithm="xla"), s, h, target="fp8_step_scales") == []
  with caplog.at_level(logging.DEBUG, logger="jax_overlap"):
    assert _calls(steps(5), s, h, target="fp8_step_scales") == []
  assert "5 operands; the kernel takes at most 4" in caplog.text
  mesh = make_mesh((4,), ("tp",))
  inside = jax.shard_map(lambda s, h: steps(2)(s, h)[0], mesh=mesh, in_specs=(P(), P()), out_specs=P())
  assert len(_calls(inside, s, h, target="fp8_step_scales")) == 1
  replicated = jax.ShapeDtypeStruct((16,), jnp.float32, sharding=NamedSharding(mesh, P()))
  assert _calls(steps(2), s, replicated, target="fp8_step_scales") == []


def test_step_scales_bad_operands_are_errors_naming_them():
  s, h = jnp.float32(1), jnp.zeros(16, jnp.float32)
  with pytest.raises(ValueError, match="one scale, history and dtype per operand"):
    fp8_scales.step_scales([s], [h, h], [E4M3])
  with pytest.raises(TypeError, match="scales must be float32 scalars"):
    fp8_scales.step_scales([jnp.ones(1)], [h], [E4M3])
  with pytest.raises(TypeError, match="histories must be float32 vectors of one length"):
    fp8_scales.step_scales([s, s], [h, jnp.zeros(8)], [E4M3, E4M3])
  with pytest.raises(TypeError, match="dtypes must be float8 formats"):
    fp8_scales.step_scales([s], [h], [jnp.bfloat16])
  with pytest.raises(TypeError, match="amax_from must be a float32 scalar"):
    fp8_cast.cast_with_amax(jnp.ones((4, 8)), s, E4M3, amax_from=jnp.zeros(2))


def test_step_scales_vmapped_and_cast_with_amax_from():
  """vmapped over states (XLA's form per element), and cast_with_amax's amax the max of amax_from and |x|."""
  scales = jnp.asarray([0.5, 2.0], jnp.float32)
  histories = jnp.asarray([[1.0, 3.0, 0.0], [0.0, 0.0, 0.0]], jnp.float32)
  (steps,), (zeros,) = jax.vmap(lambda s, h: fp8_scales.step_scales([s], [h], [E4M3]))(scales, histories)
  np.testing.assert_array_equal(np.asarray(steps), np.asarray([3.0 / 448.0, 2.0], np.float32))
  np.testing.assert_array_equal(np.asarray(zeros), np.zeros(2, np.float32))
  x = jnp.asarray([[-3.0, 1.0]], jnp.float32)
  for start, want in ((0.0, 3.0), (5.0, 5.0), (np.nan, np.nan)):
    _, amax = jax.jit(lambda x, a: fp8_cast.cast_with_amax(x, jnp.float32(1), E4M3, amax_from=a))(
        x, jnp.float32(start))
    np.testing.assert_array_equal(np.asarray(amax), np.float32(want))
