"""The scaling modes (quantization/scaling.py): their constants against the native module's, the float8 formats
each GPU runs against the vendor GEMM's, and what each mode says of its scales."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import native_testing
from jax_overlap.quantization import formats, scaling
from jax_overlap.runtime import native

needs_native = pytest.mark.skipif(native.module() is None, reason="needs jax_overlap's native module (a pure-Python "
                                                                 "install has none)")


@needs_native
def test_block_layout_constants_match_the_native_module():
  harness = native_testing.module()
  assert (scaling.BLOCK_SIZE, scaling.BLOCK_ROW_MULTIPLE, scaling.W_SCALE_ROW_ALIGN) == (
      harness.SCALE_BLOCK, harness.SCALE_ROW_MULTIPLE, harness.W_SCALE_ROW_ALIGN)


@needs_native
@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "gfx90a", "gfx942", "gfx950"])
def test_the_float8_formats_of_each_gpu_match_the_vendor_gemm(arch):
  """One rule per language: formats.fp8_family_of (Python) and the vendor GEMM's runs_fp8 (csrc/blas/*_api.h)
  agree on every arch of the build's vendor."""
  ours = native.platform() == "cuda" and arch.startswith("sm_") or native.platform() == "rocm" and arch.startswith(
      "gfx")
  if not ours:
    pytest.skip(f"{arch} is not a {native.platform()} architecture")
  family = formats.fp8_family_of(arch)
  want = [] if family is None else list(formats.fp8_formats(family))
  assert sorted(native_testing.module().vendor_fp8_dtypes(arch)) == sorted(want)


def test_modes_are_values():
  """A mode is a hashable value a primitive carries as a parameter, equal to itself across instances."""
  assert scaling.BlockScaling() == scaling.BLOCK and hash(scaling.BlockScaling()) == hash(scaling.BLOCK)
  assert scaling.TENSOR != scaling.BLOCK and repr(scaling.BLOCK) == "block"
  assert set(scaling.MODES) == {"tensor", "block"}


def test_fast_accumulation_is_a_variant_of_the_tensor_mode():
  """A mode with fast accumulation is another parameter value (another lowering), with the XLA precision that
  gives it; block scales take none."""
  fast = scaling.TENSOR.accumulating(True)
  assert fast != scaling.TENSOR and hash(fast) != hash(scaling.TENSOR) and repr(fast) == "tensor+fast_accumulation"
  assert fast == scaling.TensorScaling().accumulating(True) and fast.accumulating(False) == scaling.TENSOR
  assert not scaling.TENSOR.fast_accumulation and scaling.TENSOR.accumulating(False) is scaling.TENSOR
  assert (fast.precision, scaling.TENSOR.precision) == (jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGHEST)
  with pytest.raises(ValueError, match="fast accumulation takes tensor scales"):
    scaling.BLOCK.accumulating(True)


def test_scales_travel_as_a_pytree():
  s = scaling.Scales(jnp.float32(2.0), jnp.float32(0.5), scaling.TENSOR)
  leaves, tree = jax.tree.flatten(s)
  assert len(leaves) == 2 and jax.tree.unflatten(tree, leaves).scaling is scaling.TENSOR


def test_of_tells_the_mode_from_the_scales():
  x, w = jnp.zeros((4, 256), jnp.float8_e4m3fn), jnp.zeros((256, 128), jnp.float8_e4m3fn)
  assert scaling.of("op", x, w, jnp.float32(1), 1.0, False).scaling is scaling.TENSOR
  blocks = scaling.of("op", x, w, jnp.ones((4, 2), jnp.float32), jnp.ones((2, 1), jnp.float32), False)
  assert blocks.scaling is scaling.BLOCK
  with pytest.raises(ValueError, match=r"op: block scales: x_scale must have shape \(4, 2\)"):
    scaling.of("op", x, w, jnp.ones((4, 3), jnp.float32), jnp.ones((2, 1), jnp.float32), False)


def test_block_gemm_forms_lay_scales_out_as_cublaslt_reads_them():
  """x's [rows, k/128] as [groups][k/128][rows/groups]; w's [k/128, n/128] as its K-major [n/128][k/128 padded]."""
  rng = np.random.default_rng(0)
  xs, ws = rng.standard_normal((8, 5)).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32)
  x_form, w_form = scaling.BLOCK.gemm_forms(2, w_kmajor=False)
  np.testing.assert_array_equal(np.asarray(x_form(xs)), xs.reshape(2, 4, 5).transpose(0, 2, 1).reshape(-1))
  padded = np.zeros((3, 8), np.float32)
  padded[:, :5] = ws.T
  np.testing.assert_array_equal(np.asarray(w_form(ws)), padded.reshape(-1))
  flat = x_form(xs)
  np.testing.assert_array_equal(np.asarray(scaling.BLOCK.gathered_from_gemm(flat, 2, (8, 5))), xs)


@pytest.mark.parametrize("archs,rows,batch,world,why", [
    (("sm_90",), 256, 1, 4, None),
    (("gfx942",), 256, 1, 4, "block scales on gfx942"),
    (("sm_90",), 130, 1, 1, "130 rows per GEMM"),
    (("sm_90",), 256, 2, 4, "leading batch dims of x (2 elements) in a group of 4"),
])
def test_block_gpu_eligibility(archs, rows, batch, world, why):
  got = scaling.BLOCK.gpu_refused(archs, rows, batch, world)
  assert got is None if why is None else why in got
  assert scaling.TENSOR.gpu_refused(archs, rows, batch, world) is None


def test_a_shared_x_scale_is_a_variant_of_tensor_scales():
  """x_shared is part of a mode's identity (primitives carry it as a parameter); block scales never share."""
  shared = scaling.TENSOR.sharing_x(True)
  assert shared.x_shared and not scaling.TENSOR.x_shared and shared != scaling.TENSOR
  assert hash(shared) != hash(scaling.TENSOR) and repr(shared) == "tensor+x_shared"
  assert shared.sharing_x(False) == scaling.TENSOR and scaling.TENSOR.sharing_x(False) is scaling.TENSOR
  assert shared.accumulating(True).x_shared and repr(shared.accumulating(True)) == "tensor+fast_accumulation+x_shared"
  assert scaling.BLOCK.sharing_x(False) is scaling.BLOCK
  with pytest.raises(ValueError, match="follow x's rows"):
    scaling.BLOCK.sharing_x(True)


@pytest.mark.parametrize("shape", [(1,), (1, 1), (1, 1, 1)])
def test_size_one_scales_are_tensor_scales(shape):
  x, w = jnp.zeros((4, 256), jnp.float8_e4m3fn), jnp.zeros((256, 128), jnp.float8_e4m3fn)
  s = scaling.of("op", x, w, jnp.full(shape, 2.0, jnp.float32), jnp.full(shape, 0.5, jnp.float32), False)
  assert s.scaling is scaling.TENSOR and s.x.shape == s.w.shape == ()
  assert (float(s.x), float(s.w)) == (2.0, 0.5)
  mixed = scaling.of("op", x, w, jnp.float32(2.0), jnp.full(shape, 0.5, jnp.float32), False)
  assert mixed.scaling is scaling.TENSOR and mixed.w.shape == ()


def test_size_one_scales_of_the_block_shapes_are_block_scales():
  x, w = jnp.zeros((1, 128), jnp.float8_e4m3fn), jnp.zeros((128, 128), jnp.float8_e4m3fn)
  assert scaling.of("op", x, w, jnp.ones((1, 1), jnp.float32), jnp.ones((1, 1), jnp.float32),
                    False).scaling is scaling.BLOCK


@pytest.mark.parametrize("where", ["global", "group_of_one"])
def test_gathered_scales_feed_back_as_tensor_scales(where, fp8, rng, make_mesh, assert_close):
  """ag_matmul's gathered_scales of a global x or a group of one are (1,): another call takes them as x_scale."""
  import jax_overlap
  from jax.sharding import NamedSharding, PartitionSpec as P
  world = 4 if where == "global" else 1
  mesh = make_mesh((world,), ("tp",))
  x, w1, w2 = fp8((world * 8, 48), "float8_e4m3fn"), fp8((48, world * 16), "float8_e4m3fn"), fp8((48, 24),
                                                                                                   "float8_e4m3fn")
  sx, s1, s2 = (jnp.asarray(rng.uniform(0.3, 3.0, (1,)), jnp.float32) for _ in range(3))

  def two_calls(x, w1, w2, sx, s1, s2, axis_name=None):
    _, gathered, gathered_scales = jax_overlap.ag_matmul(x, w1, x_scale=sx, w_scale=s1, axis_name=axis_name,
                                                         return_gathered=True)
    assert gathered_scales.shape == (1,)
    return jax_overlap.matmul_rs(gathered, w2, x_scale=gathered_scales, w_scale=s2, out_dtype=jnp.float32)

  if where == "global":
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in ((x, P("tp")), (w1, P(None, "tp")), (w2, P()))]
    y = jax.jit(two_calls)(*args, sx, s1, s2)
  else:
    y = jax.jit(jax.shard_map(lambda *a: two_calls(*a, axis_name="tp"), mesh=mesh, in_specs=P(),
                              out_specs=P("tp")))(x, w1, w2, sx, s1, s2)
  want = (x.astype(np.float64) * float(sx[0])) @ (w2.astype(np.float64) * float(s2[0]))
  assert_close(y, want, jnp.float32, x.shape[1], scale=float(sx[0] * s2[0]))
