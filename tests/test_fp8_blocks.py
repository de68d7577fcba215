"""Float8 block scales (1x128 for x, 128x128 for w: the DeepSeek-V3 recipe) on CPU: the XLA path against float64 of
the dequantized operands on random data, with random scales per block, in every mode (a local call, shard_map with
each rank's own scales, global arrays sharded with their scales, vmap, gather / scatter dims other than the rows);
the refusals of bad scales; and the GPU lowering (read on a stand-in runtime, tests/fake_gpu.py): the scales' layouts
the custom calls take, the bias XLA adds, and the calls that fall back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap
from jax_overlap.runtime import backend

from block_scales import dequantized as value
from fake_gpu import custom_calls as _custom_calls, cuda_text as _lowered

WORLD = 4
B = 128
PAIRS = [("float8_e4m3fn", "float8_e4m3fn"), ("float8_e5m2", "float8_e4m3fn"), ("float8_e4m3fn", "float8_e5m2"),
         ("float8_e4m3fnuz", "float8_e4m3fnuz")]


def _pair_id(pair):
  return "-".join(f.replace("float8_", "") for f in pair)


@pytest.fixture
def block_scales(rng):
  """block_scales(shape): float32 scales in [0.3, 3), not powers of two, one per block."""
  def draw(shape):
    return rng.uniform(0.3, 3.0, shape).astype(np.float32)
  return draw


def want(x, w, sx, sw, bias=None, w_kmajor=False):
  y = value(x, sx) @ (value(w, sw).T if w_kmajor else value(w, sw))
  return y if bias is None else y + np.asarray(bias, np.float64)


def term(sx, sw) -> float:
  return float(np.sqrt(np.mean(np.square(sx)) * np.mean(np.square(sw))))


# --- a local call (no mesh) ------------------------------------------------------------------

@pytest.mark.parametrize("w_kmajor", [False, True])
@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_local_call(op, pair, w_kmajor, fp8, block_scales, normal, assert_close):
  """Every element takes its row's scale for its block of K and its 128x128 tile's of w; bias in float32."""
  x = fp8((2, 24, 2 * B), pair[0])
  w = fp8((3 * B, 2 * B) if w_kmajor else (2 * B, 3 * B), pair[1])
  sx, sw = block_scales((2, 24, 2)), block_scales((3, 2) if w_kmajor else (2, 3))
  bias = normal((3 * B,), np.float32)
  y = jax.jit(lambda *a: getattr(jax_overlap, op)(*a[:3], x_scale=a[3], w_scale=a[4], w_kmajor=w_kmajor))(
      x, w, bias, sx, sw)
  assert y.dtype == jnp.bfloat16 and y.shape == (2, 24, 3 * B)
  assert_close(y, want(x, w, sx, sw, bias, w_kmajor), "bfloat16", 2 * B, term(sx, sw))


@pytest.mark.parametrize("out_dtype", ["float16", "float32"])
def test_local_out_dtypes_and_gathered_scales(out_dtype, fp8, block_scales, assert_close):
  """out_dtype as with scalar scales; a group of one's gathered scales are x_scale itself."""
  x, w = fp8((16, B), "float8_e4m3fn"), fp8((B, B), "float8_e4m3fn")
  sx, sw = block_scales((16, 1)), block_scales((1, 1))
  y, gathered, scales = jax_overlap.ag_matmul(x, w, x_scale=sx, w_scale=sw, out_dtype=out_dtype,
                                              return_gathered=True)
  assert y.dtype == jnp.dtype(out_dtype)
  np.testing.assert_array_equal(gathered, x)
  np.testing.assert_array_equal(scales, sx)
  assert_close(y, want(x, w, sx, sw), out_dtype, B, term(sx, sw))


# --- inside shard_map: each rank's own block scales ------------------------------------------

@pytest.mark.parametrize("gather", [-2, 0])
def test_ag_matmul_shard_map(gather, fp8, block_scales, normal, make_mesh, assert_close):
  """The block scales travel with their rows: y from every rank's shard with its own scales, and gathered_scales
  is x_scale gathered as x is (also gathered along another dim than the rows)."""
  mesh = make_mesh((WORLD,), ("tp",))
  shape = (2, WORLD * 8, 2 * B) if gather == -2 else (WORLD * 2, 8, 2 * B)
  x, w = fp8(shape, "float8_e4m3fn"), fp8((2 * B, WORLD * B), "float8_e4m3fn")
  sx, sw = block_scales((*shape[:-1], 2)), block_scales((2, WORLD))
  bias = normal((WORLD * B,), np.float32)
  x_spec = P(None, "tp", None) if gather == -2 else P("tp", None, None)

  def body(x, w, b, sx, sw):
    y, gathered, scales = jax_overlap.ag_matmul(x, w, b, x_scale=sx, w_scale=sw, axis_name="tp",
                                                gather_axis=gather, return_gathered=True)
    return y, gathered[None], scales[None]  # every rank's gathered x and scales
  y, gathered, scales = jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=(x_spec, P(None, "tp"), P("tp"), x_spec, P(None, "tp")),
      out_specs=(P(None, None, "tp"), P("tp"), P("tp"))))(x, w, bias, sx, sw)
  for rank in range(WORLD):
    np.testing.assert_array_equal(gathered[rank], x)
    np.testing.assert_array_equal(scales[rank], sx)
  assert_close(y, want(x, w, sx, sw, bias), "bfloat16", 2 * B, term(sx, sw))


@pytest.mark.parametrize("scatter", [-2, 0])
def test_matmul_rs_shard_map(scatter, fp8, block_scales, normal, make_mesh, assert_close):
  """Each rank's partial from its k blocks with their scales, reduced over the group (scattered over the rows or
  another dim)."""
  mesh = make_mesh((WORLD,), ("tp",))
  shape = (2, WORLD * 4, WORLD * B) if scatter == -2 else (WORLD * 2, 4, WORLD * B)
  x, w = fp8(shape, "float8_e4m3fn"), fp8((WORLD * B, 2 * B), "float8_e5m2")
  sx, sw = block_scales((*shape[:-1], WORLD)), block_scales((WORLD, 2))
  bias = normal((2 * B,), np.float32)
  out_spec = P(None, "tp", None) if scatter == -2 else P("tp", None, None)

  def body(x, w, b, sx, sw):
    return jax_overlap.matmul_rs(x, w, b, x_scale=sx, w_scale=sw, axis_name="tp", scatter_axis=scatter)
  z = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, None, "tp"), P("tp", None), P(),
                                                       P(None, None, "tp"), P("tp", None)),
                            out_specs=out_spec))(x, w, bias, sx, sw)
  assert_close(z, want(x, w, sx, sw, bias), "bfloat16", WORLD * B, term(sx, sw))


# --- global arrays: the scales sharded as their operands -----------------------------------------

@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_global_ag_matmul(axis_type, fp8, block_scales, make_mesh, assert_close, compiled_collectives):
  """x's rows and w's columns sharded alike, with their scales: the gather plan, its x_scale blocks gathered."""
  mesh = make_mesh((WORLD,), ("tp",), getattr(jax.sharding.AxisType, axis_type))
  x, w = fp8((WORLD * 8, 2 * B), "float8_e4m3fn"), fp8((2 * B, WORLD * B), "float8_e4m3fn")
  sx, sw = block_scales((WORLD * 8, 2)), block_scales((2, WORLD))
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
  args = (put(x, P("tp", None)), put(w, P(None, "tp")), put(sx, P("tp", None)), put(sw, P(None, "tp")))
  f = jax.jit(lambda x, w, sx, sw: jax_overlap.ag_matmul(x, w, x_scale=sx, w_scale=sw, return_gathered=True))
  y, gathered, scales = f(*args)
  found = compiled_collectives(f, *args)
  assert ("all-gather", (WORLD * 8, 2 * B)) in found, found
  np.testing.assert_array_equal(gathered, x)
  np.testing.assert_array_equal(scales, sx)
  assert_close(y, want(x, w, sx, sw), "bfloat16", 2 * B, term(sx, sw))


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_global_matmul_rs(axis_type, fp8, block_scales, make_mesh, assert_close, compiled_collectives):
  """The contraction sharded on x, w and both scales: the reduction plan."""
  mesh = make_mesh((WORLD,), ("tp",), getattr(jax.sharding.AxisType, axis_type))
  x, w = fp8((16, WORLD * B), "float8_e4m3fn"), fp8((WORLD * B, 2 * B), "float8_e4m3fn")
  sx, sw = block_scales((16, WORLD)), block_scales((WORLD, 2))
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
  args = (put(x, P(None, "tp")), put(w, P("tp", None)), put(sx, P(None, "tp")), put(sw, P("tp", None)))
  f = jax.jit(lambda x, w, sx, sw: jax_overlap.matmul_rs(x, w, x_scale=sx, w_scale=sw))
  z = f(*args)
  found = compiled_collectives(f, *args)
  assert found and all(kind != "all-gather" or dims != (16, WORLD * B) for kind, dims in found), found
  assert_close(z, want(x, w, sx, sw), "bfloat16", WORLD * B, term(sx, sw))


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_vmap(op, fp8, block_scales, assert_close):
  """vmap over x and its block scales (the weights shared), and over x alone (its scales shared)."""
  x, w = fp8((3, 8, 2 * B), "float8_e4m3fn"), fp8((2 * B, B), "float8_e4m3fn")
  sx, sw = block_scales((3, 8, 2)), block_scales((2, 1))
  fn = getattr(jax_overlap, op)
  y = jax.vmap(lambda x, sx: fn(x, w, x_scale=sx, w_scale=sw))(x, sx)
  z = jax.vmap(lambda x: fn(x, w, x_scale=sx[0], w_scale=sw))(x)
  for i in range(3):
    assert_close(y[i], want(x[i], w, sx[i], sw), "bfloat16", 2 * B, term(sx, sw))
    assert_close(z[i], want(x[i], w, sx[0], sw), "bfloat16", 2 * B, term(sx, sw))


# --- refusals ---------------------------------------------------------------------------------

def _trace(op, x_shape=(8, 2 * B), w_shape=(2 * B, B), x_scale=(8, 2), w_scale=(2, 1), scale_dtype=jnp.float32,
           **kwargs):
  spec = jax.ShapeDtypeStruct
  args = (spec(x_shape, jnp.float8_e4m3fn), spec(w_shape, jnp.float8_e4m3fn), spec(x_scale, scale_dtype),
          spec(w_scale, scale_dtype))
  return jax.eval_shape(lambda x, w, sx, sw: getattr(jax_overlap, op)(x, w, x_scale=sx, w_scale=sw, **kwargs),
                        *args)


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
@pytest.mark.parametrize("case, kwargs, error, match", [
    ("x_scale shape", dict(x_scale=(8, 1)), ValueError, r"x_scale must have shape \(8, 2\) \(one per row of x and "
                                                        r"128 of K\), got \(8, 1\)"),
    ("w_scale shape", dict(w_scale=(1, 2)), ValueError, r"w_scale must have shape \(2, 1\) \(one per 128x128 tile"),
    ("w_kmajor", dict(w_shape=(B, 2 * B), w_kmajor=True), ValueError, r"w_scale must have shape \(1, 2\)"),
    ("K", dict(x_shape=(8, 192), w_shape=(192, B), x_scale=(8, 1), w_scale=(1, 1)), ValueError,
     r"need K and N multiples of 128 .* got K = 192, N = 128"),
    ("N", dict(w_shape=(2 * B, 64), w_scale=(2, 1)), ValueError, r"got K = 256, N = 64"),
    ("3-D w", dict(w_shape=(2 * B, 2, 64), w_scale=(2, 1)), ValueError, r"block scales take a 2-D w"),
    ("dtype", dict(scale_dtype=jnp.bfloat16), TypeError, r"with block scales x_scale must be a float32 array, got "
                                                          r"dtype bfloat16"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_refused(op, case, kwargs, error, match):
  if case == "3-D w" and op == "matmul_rs":  # two contracted dims
    kwargs = dict(x_shape=(8, 2, B), w_shape=(2, B, B), w_scale=(2, 1))
  with pytest.raises(error, match=rf"jax_overlap.{op}: .*{match}"):
    _trace(op, **kwargs)


# --- the GPU lowering (a stand-in runtime: an H200's sm_90) ----------------------------------------

def _spec(*shape, dtype=jnp.float8_e4m3fn):
  return jax.ShapeDtypeStruct(shape, dtype)


def _shard_map(op, mesh, *, algorithm="pipelined", bias=False, lead=()):
  """jit(shard_map(op)) over "tp" with block scales sharded as their operands."""
  fn = getattr(jax_overlap, op)
  none = (None,) * len(lead)
  if op == "ag_matmul":
    x_spec, w_spec, out_spec, b_spec = P(*none, "tp", None), P(None, "tp"), P(*none, None, "tp"), P("tp")
  else:
    x_spec, w_spec, out_spec, b_spec = P(*none, None, "tp"), P("tp", None), P(*none, "tp", None), P()

  def body(x, w, sx, sw, *b):
    return fn(x, w, *b, x_scale=sx, w_scale=sw, axis_name="tp", algorithm=algorithm)
  in_specs = (x_spec, w_spec, x_spec, w_spec, *([b_spec] if bias else []))
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec))


def _operands(op, world, rows=4096, lead=()):
  k, n = 512, 256 * world
  if op == "ag_matmul":
    return (_spec(*lead, rows, k), _spec(k, n), _spec(*lead, rows, k // B, dtype=jnp.float32),
            _spec(k // B, n // B, dtype=jnp.float32))
  return (_spec(*lead, rows, world * k), _spec(world * k, 256), _spec(*lead, rows, world * k // B, dtype=jnp.float32),
          _spec(world * k // B, 2, dtype=jnp.float32))


def _operand_types(call):
  return call.split(" : (")[1].split(") -> ")[0]


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_lowered_layouts(fake_gpu_runtime, make_mesh, op):
  """The custom call takes the scales flat in cuBLASLt's layouts (x's per GEMM's rows, transposed; w's K-major
  [n/128][k/128 padded to 4]); ag_matmul returns its gathered scales flat, turned back into [T*m, k/128]; the
  region is sized with the blocks."""
  calls = []
  sizes = fake_gpu_runtime.pipelined_region_bytes
  fake_gpu_runtime.pipelined_region_bytes = lambda *args: calls.append(args) or sizes(*args)
  text = _lowered(_shard_map(op, make_mesh((WORLD,), ("tp",))), *_operands(op, WORLD))
  (call,) = _custom_calls(text)
  assert f"@jax_overlap_{op}_pipelined(" in call
  if op == "ag_matmul":  # x [1024, 512] per rank: 4 blocks of K; w [512, 256] per rank: [2][4] K-major
    assert _operand_types(call) == ("tensor<1024x512xf8E4M3FN>, tensor<256x512xf8E4M3FN>, tensor<0xbf16>, "
                                    "tensor<4096xf32>, tensor<8xf32>")
    assert "tensor<16384xf32>" in call.split(" -> ")[1]
    assert calls[0][-2:] == (True, True)
  else:  # x [4096, 512] per rank: [4 row blocks][4][1024]; w [512, 256] per rank: [2][4]
    assert _operand_types(call) == ("tensor<4096x512xf8E4M3FN>, tensor<256x512xf8E4M3FN>, tensor<0xbf16>, "
                                    "tensor<16384xf32>, tensor<8xf32>")
    assert calls[0][-2:] == (True, True)
  assert "stablehlo.transpose" in text


def test_lowered_group_of_one_bias_after(fake_gpu_runtime):
  """A group of one's block-scaled GEMM writes float32 without the bias (cuBLASLt's block-scaled GEMM has no
  bias epilogue), and XLA adds the bias in float32 and rounds once; w's scales padded to 4 blocks of K."""
  f = jax.jit(lambda x, w, sx, sw, b: jax_overlap.ag_matmul(x, w, b, x_scale=sx, w_scale=sw))
  text = _lowered(f, _spec(2, 64, 5 * B), _spec(5 * B, B), _spec(2, 64, 5, dtype=jnp.float32),
                  _spec(5, 1, dtype=jnp.float32), _spec(B, dtype=jnp.bfloat16))
  (call,) = _custom_calls(text)
  assert "@jax_overlap_vendor_gemm" in call
  assert _operand_types(call) == ("tensor<2x64x640xf8E4M3FN>, tensor<128x640xf8E4M3FN>, tensor<0xbf16>, "
                                  "tensor<640xf32>, tensor<8xf32>")
  assert call.split(" -> ")[1].startswith("(tensor<2x64x128xf32>")


@pytest.mark.parametrize("case", ["rows", "batch", "arch"])
def test_lowering_falls_back(fake_gpu_runtime, make_mesh, monkeypatch, caplog, case):
  """What cuBLASLt's block-scaled GEMM cannot take falls back to XLA under "auto" (saying why at DEBUG) and is an
  error for "pipelined": rows per GEMM not a multiple of 4, batch dims with peers, a GPU other than Hopper."""
  mesh = make_mesh((WORLD,), ("tp",))
  lead, rows = ((2,), 1024) if case == "batch" else ((), 4 * 1022 if case == "rows" else 4096)
  if case == "arch":
    for device in backend.current().state.devices.values():
      monkeypatch.setattr(device, "arch", "gfx950")
  operands = _operands("matmul_rs", WORLD, rows, lead)
  why = {"rows": "1022 rows per GEMM", "batch": "leading batch dims", "arch": "Hopper \\(sm_90\\) only"}[case]
  with caplog.at_level("DEBUG", logger="jax_overlap"):
    text = _lowered(_shard_map("matmul_rs", mesh, algorithm="auto", lead=lead), *operands)
  assert not _custom_calls(text)
  assert any("block scales" in r.getMessage() for r in caplog.records)
  with pytest.raises(ValueError, match=rf"algorithm='pipelined' cannot take this call: .*{why}"):
    _lowered(_shard_map("matmul_rs", mesh, lead=lead), *operands)


def test_vmap_inside_shard_map(fp8, block_scales, make_mesh, assert_close):
  """vmap over the primitive inside shard_map: x and its block scales batched alike (the batch rule folds both
  into x's leading dims), the gathered scales batched with them."""
  mesh = make_mesh((WORLD,), ("tp",))
  x, w = fp8((3, WORLD * 8, 2 * B), "float8_e4m3fn"), fp8((2 * B, WORLD * B), "float8_e4m3fn")
  sx, sw = block_scales((3, WORLD * 8, 2)), block_scales((2, WORLD))

  def body(x, w, sx, sw):
    y, _, scales = jax.vmap(lambda x, sx: jax_overlap.ag_matmul(x, w, x_scale=sx, w_scale=sw, axis_name="tp",
                                                                 return_gathered=True))(x, sx)
    return y, scales[None]
  y, scales = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), P(None, "tp"),
                                                               P(None, "tp")),
                                    out_specs=(P(None, None, "tp"), P("tp"))))(x, w, sx, sw)
  for rank in range(WORLD):
    np.testing.assert_array_equal(scales[rank], sx)
  for i in range(3):
    assert_close(y[i], want(x[i], w, sx[i], sw), "bfloat16", 2 * B, term(sx, sw))
