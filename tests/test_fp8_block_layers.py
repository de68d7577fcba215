"""Fp8AgDotGeneral and Fp8RsDotGeneral with scaling="block": values and gradients against a float64 reference of
the same block-quantized computation, written here in NumPy (ml_dtypes rounds to the float8 formats), on random
data whose magnitude changes from block to block (so that block scales differ from one scale per tensor).

The reference quantizes as the layers do: x and the cotangent per 1x128 block of their last dim, the kernel per
128x128 tile (the dual op reads the forward's tiles), each scale a power of two from its block's amax; the weight
gradient's operands again with their blocks along the rows, x from its float8 value and the cotangent from its
16-bit one (Fp8RsDotGeneral: from its gathered float8 value). Shards are whole blocks, so the quantization does
not depend on the sharding; what is left to compare is the GEMMs' float32 accumulation and the roundings of the
results (tolerance.py). Also: gradients within float8's error of the unquantized ones, and the bad inputs.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap
from fake_gpu import custom_calls, cuda_text
from test_fp8_layers import E4M3, E5M2, _check, _vjp, f64, rounded, scale_of, split

WORLD = 4
B = 128
DN = (((2,), (0,)), ((), ()))  # x [2, S, K] with a kernel [K, N]


# --- the reference -------------------------------------------------------------------

def _scales(blocks, fmt, axes):
  """The power-of-two scale of each block (numerics.fp8_scale of its amax), blocks reduced over `axes`."""
  amax = np.max(np.abs(blocks), axis=axes)
  return np.vectorize(lambda a: scale_of(np.float32(a), fmt), otypes=[np.float32])(amax)


def block_q(a, fmt):
  """(a [..., c] quantized per 1x128 block of its last dim, the scales [..., c/128])."""
  blocks = np.asarray(a, np.float32).reshape(*np.shape(a)[:-1], -1, B)
  scales = _scales(blocks, fmt, -1)
  q = (blocks * (np.float32(1) / scales)[..., None]).astype(jnp.dtype(fmt)).reshape(np.shape(a))
  return q, scales


def block_value(q, scales):
  return (f64(q).reshape(*q.shape[:-1], -1, B) * scales[..., None]).reshape(q.shape)


def tile_q(a, fmt, scales=None):
  """(a [r, c] quantized per 128x128 tile, the scales [r/128, c/128], or quantized with `scales`)."""
  r, c = a.shape
  tiles = np.asarray(a, np.float32).reshape(r // B, B, c // B, B)
  scales = _scales(tiles, fmt, (1, 3)) if scales is None else scales
  return (tiles * (np.float32(1) / scales)[:, None, :, None]).astype(jnp.dtype(fmt)).reshape(r, c), scales


def tile_value(q, scales):
  r, c = q.shape
  return (f64(q).reshape(r // B, B, c // B, B) * scales[:, None, :, None]).reshape(r, c)


def weight_grad(x_value, dy):
  """dW from x's value [..., R, K] and the cotangent [..., R, N], both blocked along the rows again."""
  a = block_value(*block_q(x_value.reshape(-1, x_value.shape[-1]).T.astype(np.float32), E4M3))
  b = tile_value(*tile_q(np.asarray(dy, np.float32).reshape(-1, dy.shape[-1]).T, E5M2))
  return a @ b.T


def ag_reference(x, w, dy, blocks: int):
  """(y, dx, dW) of Fp8AgDotGeneral(scaling="block") on x [2, S, K], w [K, N] with its columns in `blocks` (the
  ranks: dx's partials rounded per block, then summed), dy [2, S, N]."""
  x_value = block_value(*block_q(x, E4M3))
  wq, ws = tile_q(np.asarray(w, np.float32).T, E4M3)
  y = x_value @ tile_value(wq, ws).T
  dy_value = block_value(*block_q(dy, E5M2))
  w_value = tile_value(*tile_q(np.asarray(w, np.float32), E4M3, ws.T))
  dx = sum(rounded(d @ wb.T, x.dtype) for d, wb in zip(split(dy_value, blocks, 2), split(w_value, blocks, 1)))
  return y, dx, weight_grad(x_value, dy)


def rs_reference(x, w, dz, blocks: int):
  """(z, dx, dW) of Fp8RsDotGeneral(scaling="block") on x [2, S, K] with K in `blocks` (the ranks: z's partials
  rounded per block, then summed), w [K, N], dz [2, S, N]."""
  x_value = block_value(*block_q(x, E4M3))
  wq, ws = tile_q(np.asarray(w, np.float32).T, E4M3)
  w_value = tile_value(wq, ws).T
  z = sum(rounded(a @ b, x.dtype) for a, b in zip(split(x_value, blocks, 2), split(w_value, blocks, 0)))
  dz_value = block_value(*block_q(dz, E5M2))
  dx = dz_value @ w_value.T
  return z, dx, weight_grad(x_value, dz_value)


# --- the layers -------------------------------------------------------------------------

def _blocky(normal, shape, dtype, axis=-1):
  """Normal values whose magnitude changes by powers of ten from one 128-block of `axis` to the next."""
  a = np.asarray(normal(shape, np.float32))
  exps = np.arange(shape[axis] // B) % 4 - 2
  factor = np.repeat(10.0 ** exps, B).reshape([-1 if d == axis % len(shape) else 1 for d in range(len(shape))])
  return (a * factor).astype(dtype)


def _ag_operands(normal, dtype, k=2 * B, n=WORLD * B):
  x = _blocky(normal, (2, WORLD * 16, k), dtype)  # 128 rows in all: the weight gradient's one block
  w = (_blocky(normal, (k, n), np.float32, axis=0) / np.sqrt(k)).astype(dtype)
  return x, w, _blocky(normal, (2, WORLD * 16, n), dtype)


def _rs_operands(normal, dtype, k=WORLD * B, n=2 * B):
  x = _blocky(normal, (2, WORLD * 16, k), dtype)
  w = (_blocky(normal, (k, n), np.float32, axis=1) / np.sqrt(k)).astype(dtype)
  return x, w, _blocky(normal, (2, WORLD * 16, n), dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_ag_layer_in_shard_map(dtype, normal, make_mesh, assert_close):
  mesh = make_mesh((WORLD,), ("tp",))
  x, w, dy = _ag_operands(normal, dtype)
  dot = jax_overlap.Fp8AgDotGeneral(axis_name="tp", scaling="block")
  f = jax.shard_map(lambda x, w: dot(x, w, DN), mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp")),
                    out_specs=P(None, None, "tp"))
  got = jax.jit(lambda x, w, dy: _vjp(f, x, w, dy))(x, w, dy)
  _check(got, ag_reference(x, w, dy, WORLD), dtype, (x.shape[2], w.shape[1], 2 * WORLD * 16), assert_close)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_rs_layer_in_shard_map(dtype, normal, make_mesh, assert_close):
  mesh = make_mesh((WORLD,), ("tp",))
  x, w, dz = _rs_operands(normal, dtype)
  dot = jax_overlap.Fp8RsDotGeneral(axis_name="tp", scaling="block")
  f = jax.shard_map(lambda x, w: dot(x, w, DN), mesh=mesh, in_specs=(P(None, None, "tp"), P("tp", None)),
                    out_specs=P(None, "tp", None))
  got = jax.jit(lambda x, w, dz: _vjp(f, x, w, dz))(x, w, dz)
  _check(got, rs_reference(x, w, dz, WORLD), dtype, (w.shape[0], w.shape[1], 2 * WORLD * 16), assert_close)


@pytest.mark.parametrize("layer", ["ag", "rs"])
def test_layers_on_global_arrays(layer, normal, make_mesh, assert_close):
  mesh = make_mesh((WORLD,), ("tp",))
  if layer == "ag":
    x, w, ct = _ag_operands(normal, "bfloat16")
    specs, out_spec = (P(None, "tp", None), P(None, "tp")), P(None, None, "tp")
    dot, want = jax_overlap.Fp8AgDotGeneral(scaling="block"), ag_reference(x, w, ct, 1)
  else:
    x, w, ct = _rs_operands(normal, "bfloat16")
    specs, out_spec = (P(None, None, "tp"), P("tp", None)), P(None, "tp", None)
    dot, want = jax_overlap.Fp8RsDotGeneral(scaling="block"), rs_reference(x, w, ct, WORLD)
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w, ct), (*specs, out_spec))]
  got = jax.jit(lambda x, w, ct: _vjp(lambda x, w: dot(x, w, DN), x, w, ct))(*args)
  _check(got, want, "bfloat16", (x.shape[2], w.shape[1], 2 * WORLD * 16), assert_close)


@pytest.mark.parametrize("layer", ["ag", "rs"])
def test_gradients_within_float8_error_of_the_unquantized(layer, normal, make_mesh):
  """Close to float32's derivative within e5m2 and e4m3 rounding (relative 2-norm error 0.1), with magnitudes that
  change by 10^4 across blocks."""
  mesh = make_mesh((WORLD,), ("tp",))
  if layer == "ag":
    x, w, _ = _ag_operands(normal, "float32")
    specs, out_spec, dot = (P(None, "tp"), P(None, "tp")), P(None, None, "tp"), jax_overlap.Fp8AgDotGeneral
  else:
    x, w, _ = _rs_operands(normal, "float32")
    specs, out_spec, dot = (P(None, None, "tp"), P("tp", None)), P(None, "tp", None), jax_overlap.Fp8RsDotGeneral
  f = jax.shard_map(lambda x, w: dot(axis_name="tp", scaling="block")(x, w, DN), mesh=mesh, in_specs=specs,
                    out_specs=out_spec)
  loss = lambda f: jax.jit(jax.value_and_grad(lambda x, w: jnp.mean(jnp.square(f(x, w))), argnums=(0, 1)))
  got = loss(f)(x, w)
  want = loss(lambda x, w: jax.lax.dot_general(x, w, DN, precision="highest"))(x, w)
  for name, g, r in zip(("loss", "dx", "dW"), jax.tree.leaves(got), jax.tree.leaves(want)):
    err = np.linalg.norm(np.asarray(g, np.float64) - r) / np.linalg.norm(r)
    assert err < 0.1, f"{name}: relative error {err:.3f}"


def test_multi_dim_kernel_is_flattened(normal, assert_close):
  """A kernel [K, heads, head_dim] runs as [K, heads * head_dim]: the same values as the 2-D kernel."""
  x, w, dy = _ag_operands(normal, "float32", n=2 * B)
  dot = jax_overlap.Fp8AgDotGeneral(scaling="block")
  flat = jax.jit(lambda x, w, dy: _vjp(lambda x, w: dot(x, w, DN), x, w, dy))(x, w, dy)
  w3, dy3 = w.reshape(w.shape[0], 4, -1), dy.reshape(*dy.shape[:2], 4, -1)
  multi = jax.jit(lambda x, w, dy: _vjp(lambda x, w: dot(x, w, (((2,), (0,)), ((), ()))), x, w, dy))(x, w3, dy3)
  for a, b in zip(flat, (multi[0].reshape(flat[0].shape), multi[1], multi[2].reshape(w.shape))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("cls", ["Fp8AgDotGeneral", "Fp8RsDotGeneral"])
def test_bad_inputs(cls):
  dot = getattr(jax_overlap, cls)
  x = jnp.ones((2, 128, 256), jnp.bfloat16) * 0.5
  with pytest.raises(ValueError, match=rf"{cls}: scaling must be one of \('tensor', 'block'\), got 'rows'"):
    dot(scaling="rows")  # at construction
  with pytest.raises(ValueError, match=rf"{cls} \(scaling='block', each rank's kernel\): block scales need K and N "
                                       r"multiples of 128.*N = 200"):
    dot(scaling="block")(x, jnp.ones((256, 200), jnp.bfloat16), DN)
  rows_100 = jnp.ones((100, 256), jnp.bfloat16)
  f = lambda x, w: jnp.sum(dot(scaling="block")(x, w, (((1,), (0,)), ((), ()))).astype(jnp.float32))
  dot(scaling="block")(rows_100, jnp.ones((256, 256), jnp.bfloat16), (((1,), (0,)), ((), ())))  # forward: fine
  with pytest.raises(ValueError, match=r"weight gradient of scaling='block' contracts the rows.*got 100"):
    jax.grad(f, argnums=1)(rows_100, jnp.ones((256, 256), jnp.bfloat16))


@pytest.mark.parametrize("layer", ["ag", "rs"])
def test_training_step_lowers_to_block_scaled_calls(fake_gpu_runtime, make_mesh, layer):
  """On 4 GPUs (the stand-in runtime, an H200's sm_90) with x [rows, K]: the forward and the dual op are pipelined
  calls over the group with block scales, dW the vendor's GEMM of a group of one."""
  mesh = make_mesh((WORLD,), ("tp",))
  dn = (((1,), (0,)), ((), ()))
  if layer == "ag":
    dot, specs, out_spec = jax_overlap.Fp8AgDotGeneral(axis_name="tp", algorithm="pipelined", scaling="block"), \
        (P("tp"), P(None, "tp"), P(None, "tp")), (P(None, "tp"), P("tp"), P(None, "tp"))
    shapes = ((WORLD * 64, 256), (256, WORLD * 128), (WORLD * 64, WORLD * 128))
  else:
    dot, specs, out_spec = jax_overlap.Fp8RsDotGeneral(axis_name="tp", algorithm="pipelined", scaling="block"), \
        (P(None, "tp"), P("tp"), P("tp")), (P("tp"), P(None, "tp"), P("tp"))
    shapes = ((WORLD * 64, WORLD * 128), (WORLD * 128, 256), (WORLD * 64, 256))

  def step(x, w, ct):
    y, vjp = jax.vjp(lambda x, w: dot(x, w, dn), x, w)
    return (y, *vjp(ct))
  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=specs, out_specs=out_spec))
  calls = custom_calls(cuda_text(f, *(jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes)))
  targets = sorted(re.search(r"@(\w+)\(", c).group(1) for c in calls)
  assert targets == sorted(["jax_overlap_ag_matmul_pipelined", "jax_overlap_matmul_rs_pipelined",
                            "jax_overlap_vendor_gemm"]), calls
  # block scales, never one scale per operand (f32[1]); e.g. the forward ag_matmul's x [64, 256] has 64 x 2
  for c in calls:
    assert "tensor<1xf32>" not in c and "tensor<0xf32>" not in c, c
  if layer == "ag":
    assert any("tensor<64x256xf8E4M3FN>" in c and "tensor<128xf32>" in c for c in calls), calls
