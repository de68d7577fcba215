"""Float8 ag_matmul and matmul_rs on the XLA path, against float64 of the dequantized operands on random data.

Every format pair a GPU can take (one family, not both e5m2) and every out_dtype, inside shard_map with each
rank's own scales (not powers of two) and on global arrays with one scale per array; bias in out_dtype and in
float32; batch dims, other gather / scatter dims, w_kmajor; the gathered scales; vmap; the form XLA rewrites
into its fp8 GEMM (one dot per shard of scalar scales); and the refusal to differentiate a float8 call.
"""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap
from jax_overlap.quantization import formats

from fake_gpu import FakeNative, install

WORLD = 4
FORMATS = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]
# (x, w): one family, e5m2 on one side at most (gradients times e4m3 values).
PAIRS = [(x, w) for x in FORMATS for w in FORMATS
         if x.endswith("fnuz") == w.endswith("fnuz") and not ("e5m2" in x and "e5m2" in w)]
OUT_DTYPES = ["bfloat16", "float16", "float32"]


def _pair_id(pair):
  return "-".join(f.replace("float8_", "") for f in pair)


@pytest.fixture
def scales(rng):
  """scales(count): float32 scales in [0.3, 3), not powers of two (one per rank)."""
  def draw(count):
    return rng.uniform(0.3, 3.0, count).astype(np.float32)
  return draw


def dequantized(q, scale_per_block, axis: int):
  """q in float64, each of len(scale_per_block) blocks along `axis` times its scale."""
  q = np.asarray(q.astype(np.float32), np.float64)
  reps = q.shape[axis] // len(scale_per_block)
  shape = [1] * q.ndim
  shape[axis] = q.shape[axis]
  return q * np.repeat(np.asarray(scale_per_block, np.float64), reps).reshape(shape)


def term_scale(sx, sw) -> float:
  """The magnitude of one product term (unit-normal operands times their scales): tolerance.py's `scale`."""
  return float(np.sqrt(np.mean(np.square(sx)) * np.mean(np.square(sw))))


def ag_shard_map(mesh, nlead=1, gather=-2, **kwargs):
  """jit(shard_map(ag_matmul)) on x [..., T*m, K] (rows on tp, or the dim `gather`), w [K, T*n], bias [T*n],
  x_scale and w_scale [T] (each rank's own)."""
  lead = [None] * nlead
  x_spec = [*lead, None, None]
  x_spec[len(x_spec) + gather] = "tp"
  y_spec = [*lead, None, "tp"]

  def body(x, w, b, sx, sw):
    return jax_overlap.ag_matmul(x, w, b, x_scale=sx[0], w_scale=sw[0], axis_name="tp", gather_axis=gather,
                                 **kwargs)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(*x_spec), P(None, "tp"), P("tp"), P("tp"), P("tp")),
                               out_specs=P(*y_spec)))


def rs_shard_map(mesh, nlead=1, **kwargs):
  """jit(shard_map(matmul_rs)) on x [..., M, T*k], w [T*k, N], bias [N] (replicated), scales [T]."""
  lead = [None] * nlead

  def body(x, w, b, sx, sw):
    return jax_overlap.matmul_rs(x, w, b, x_scale=sx[0], w_scale=sw[0], axis_name="tp", **kwargs)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(*lead, None, "tp"), P("tp", None), P(), P("tp"), P("tp")),
                               out_specs=P(*lead, "tp", None)))


# --- inside shard_map: each rank's own scales -----------------------------------------------

@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
def test_ag_matmul_per_rank_scales(pair, out_dtype, fp8, scales, normal, make_mesh, assert_close):
  """Each gathered shard keeps its own rank's x_scale; each rank's columns its own w_scale; bias in out_dtype."""
  mesh = make_mesh((WORLD,), ("tp",))
  x, w = fp8((2, WORLD * 8, 64), pair[0]), fp8((64, WORLD * 16), pair[1])
  bias, sx, sw = normal((WORLD * 16,), out_dtype), scales(WORLD), scales(WORLD)
  y = ag_shard_map(mesh, out_dtype=out_dtype)(x, w, bias, sx, sw)
  assert y.dtype == jnp.dtype(out_dtype)
  want = dequantized(x, sx, 1) @ dequantized(w, sw, 1) + bias.astype(np.float64)
  assert_close(y, want, out_dtype, 64, term_scale(sx, sw))


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
def test_matmul_rs_per_rank_scales(pair, out_dtype, fp8, scales, normal, make_mesh, assert_close):
  """Each rank's partial scaled by its own scales and staged in out_dtype, summed in float32; bias float32."""
  mesh = make_mesh((WORLD,), ("tp",))
  x, w = fp8((2, WORLD * 4, WORLD * 16), pair[0]), fp8((WORLD * 16, 24), pair[1])
  bias, sx, sw = normal((24,), np.float32), scales(WORLD), scales(WORLD)
  z = rs_shard_map(mesh, out_dtype=out_dtype)(x, w, bias, sx, sw)
  assert z.dtype == jnp.dtype(out_dtype)
  want = dequantized(x, sx, 2) @ dequantized(w, sw, 0) + bias.astype(np.float64)
  assert_close(z, want, out_dtype, WORLD * 16, term_scale(sx, sw))


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
@pytest.mark.parametrize("bias_dtype", [None, "float32", "bfloat16"])
def test_bias_dtypes(op, bias_dtype, fp8, scales, normal, make_mesh, assert_close):
  """No bias, a float32 bias with a bfloat16 result, a bias in out_dtype: added once in float32."""
  mesh = make_mesh((WORLD,), ("tp",))
  sx, sw = scales(WORLD), scales(WORLD)
  if op == "ag_matmul":
    x, w = fp8((WORLD * 8, 32), "float8_e4m3fn"), fp8((32, WORLD * 8), "float8_e5m2")
    specs, out_spec, bias_spec, k = (P("tp"), P(None, "tp")), P(None, "tp"), P("tp"), 32
    want = dequantized(x, sx, 0) @ dequantized(w, sw, 1)
  else:
    x, w = fp8((WORLD * 8, WORLD * 8), "float8_e5m2"), fp8((WORLD * 8, 16), "float8_e4m3fn")
    specs, out_spec, bias_spec, k = (P(None, "tp"), P("tp")), P("tp"), P(), WORLD * 8
    want = dequantized(x, sx, 1) @ dequantized(w, sw, 0)
  bias = () if bias_dtype is None else (normal((w.shape[1],), bias_dtype),)

  def body(x, w, sx, sw, *bias):
    return getattr(jax_overlap, op)(x, w, *bias, x_scale=sx[0], w_scale=sw[0], axis_name="tp")
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(*specs, P("tp"), P("tp"), *(bias_spec,) * len(bias)),
                            out_specs=out_spec))
  y = f(x, w, sx, sw, *bias)
  assert y.dtype == jnp.bfloat16
  assert_close(y, want + sum(b.astype(np.float64) for b in bias), jnp.bfloat16, k, term_scale(sx, sw))


def test_return_gathered_carries_each_shards_scale(fp8, scales, make_mesh):
  """(y, gathered, gathered_scales): the gathered float8 x bit for bit, and every rank's x_scale in rank order."""
  mesh = make_mesh((WORLD,), ("tp",))
  x, w, sx, sw = fp8((WORLD * 8, 32), "float8_e4m3fnuz"), fp8((32, WORLD * 8), "float8_e4m3fnuz"), scales(WORLD), \
      scales(WORLD)

  def body(x, w, sx, sw):
    return jax_overlap.ag_matmul(x, w, x_scale=sx[0], w_scale=sw[0], axis_name="tp", return_gathered=True)
  _, gathered, gathered_scales = jax.jit(jax.shard_map(  # every rank's copy, one after the other
      body, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp"), P("tp")),
      out_specs=(P(None, "tp"), P("tp"), P("tp"))))(x, w, sx, sw)
  assert gathered.dtype == x.dtype and gathered_scales.dtype == jnp.float32
  for rank in range(WORLD):
    np.testing.assert_array_equal(np.asarray(gathered).reshape(WORLD, *x.shape)[rank].view(np.uint8),
                                  x.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(gathered_scales).reshape(WORLD, WORLD)[rank], sx)


@pytest.mark.parametrize("gather", [-2, -3], ids=["rows", "batch"])
def test_ag_matmul_gather_axis_keeps_shard_scales(gather, fp8, scales, make_mesh, assert_close):
  """Another gathered dim folds into the rows: each shard stays one block with its scale."""
  mesh = make_mesh((WORLD,), ("tp",))
  x, w = fp8((WORLD * 2, 6, 32), "float8_e5m2"), fp8((32, WORLD * 8), "float8_e4m3fn")
  if gather == -2:
    x = x.reshape(2, WORLD * 6, 32)
  sx, sw = scales(WORLD), scales(WORLD)
  y = ag_shard_map(mesh, gather=gather, out_dtype=jnp.float32)(x, w, np.zeros(w.shape[1], np.float32), sx, sw)
  want = dequantized(x, sx, x.ndim + gather) @ dequantized(w, sw, 1)
  assert_close(y, want, jnp.float32, 32, term_scale(sx, sw))


def test_matmul_rs_scatter_axis(fp8, scales, make_mesh, assert_close):
  """The output's batch dim scattered (folded into the rows), multi-dim contraction."""
  mesh = make_mesh((WORLD,), ("tp",))
  x, w = fp8((WORLD * 2, 3, WORLD * 2, 8), "float8_e4m3fn"), fp8((WORLD * 2, 8, 16), "float8_e4m3fn")
  sx, sw = scales(WORLD), scales(WORLD)

  def body(x, w, sx, sw):
    return jax_overlap.matmul_rs(x, w, x_scale=sx[0], w_scale=sw[0], axis_name="tp", scatter_axis=0)
  z = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, None, "tp"), P("tp"), P("tp"), P("tp")),
                            out_specs=P("tp")))(x, w, sx, sw)
  want = np.einsum("bmhd,hdn->bmn", dequantized(x, sx, 2), dequantized(w, sw, 0))
  assert_close(z, want, jnp.bfloat16, WORLD * 16, term_scale(sx, sw))


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_w_kmajor(op, dtype, fp8, scales, normal, make_mesh, assert_close):
  """w stored with the contraction last, several output (ag) or contracted (rs) dims: the same product."""
  mesh = make_mesh((WORLD,), ("tp",))
  draw = (lambda shape: fp8(shape, dtype)) if "float8" in dtype else (lambda shape: normal(shape, dtype))
  sx, sw = (scales(WORLD), scales(WORLD)) if "float8" in dtype else (np.ones(WORLD, np.float32),) * 2
  kw = (lambda sx, sw: dict(x_scale=sx[0], w_scale=sw[0])) if "float8" in dtype else (lambda sx, sw: {})
  if op == "ag_matmul":
    x, w = draw((WORLD * 4, 32)), draw((2, WORLD * 4, 32))  # w [*n, K]

    def body(x, w, sx, sw):
      return jax_overlap.ag_matmul(x, w, **kw(sx, sw), w_kmajor=True, axis_name="tp")
    specs, out_spec = (P("tp"), P(None, "tp"), P("tp"), P("tp")), P(None, None, "tp")
    want = np.einsum("mk,ank->man", dequantized(x, sx, 0), dequantized(w, sw, 1))
    k = 32
  else:
    x, w = draw((16, WORLD * 2, 8)), draw((24, WORLD * 2, 8))  # w [N, *k]

    def body(x, w, sx, sw):
      return jax_overlap.matmul_rs(x, w, **kw(sx, sw), w_kmajor=True, axis_name="tp")
    specs, out_spec = (P(None, "tp"), P(None, "tp"), P("tp"), P("tp")), P("tp")
    want = np.einsum("mhd,nhd->mn", dequantized(x, sx, 1), dequantized(w, sw, 1))
    k = WORLD * 16
  y = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_spec))(x, w, sx, sw)
  assert_close(y, want, jnp.bfloat16, k, term_scale(sx, sw))


def test_xla_algorithm_is_auto_bit_for_bit(fp8, scales, normal, make_mesh):
  """algorithm="xla" (plain JAX ops) and the primitive's XLA lowering compute alike, to the bit."""
  mesh = make_mesh((WORLD,), ("tp",))
  sx, sw = scales(WORLD), scales(WORLD)
  x, w, b = fp8((2, WORLD * 4, 32), "float8_e4m3fn"), fp8((32, WORLD * 8), "float8_e5m2"), normal((WORLD * 8,), "f4")
  args = (x, w, b, sx, sw)
  np.testing.assert_array_equal(ag_shard_map(mesh)(*args), ag_shard_map(mesh, algorithm="xla")(*args))
  x2, w2 = fp8((2, WORLD * 4, WORLD * 8), "float8_e5m2"), fp8((WORLD * 8, 16), "float8_e4m3fn")
  args = (x2, w2, normal((16,), "f4"), sx, sw)
  np.testing.assert_array_equal(rs_shard_map(mesh)(*args), rs_shard_map(mesh, algorithm="xla")(*args))


def test_one_dot_per_shard_of_scalar_scales(fp8, scales, normal, make_mesh):
  """The XLA path's form: per shard, each operand converted to float32 times a scalar, into one dot (what XLA
  rewrites into its fp8 GEMM); a dot of per-row scales would run at float32 speed."""
  mesh = make_mesh((WORLD,), ("tp",))
  args = (fp8((WORLD * 4, 32), "float8_e4m3fn"), fp8((32, WORLD * 8), "float8_e4m3fn"), normal((WORLD * 8,), "f4"),
          scales(WORLD), scales(WORLD))
  f = jax.jit(jax.shard_map(
      lambda x, w, b, sx, sw: jax_overlap.ag_matmul(x, w, b, x_scale=sx[0], w_scale=sw[0], axis_name="tp"),
      mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp"), P("tp"), P("tp")), out_specs=P(None, "tp")))
  dots = [eqn for eqn in _equations(jax.make_jaxpr(f)(*args).jaxpr) if eqn.primitive.name == "dot_general"]
  hlo = f.lower(*args).as_text()
  assert hlo.count("stablehlo.dot_general") == WORLD, hlo
  assert all(v.aval.dtype == jnp.float32 for eqn in dots for v in eqn.invars), dots
  # each shard [4, 32] converted from float8 to float32 on its own
  assert hlo.count("stablehlo.convert") >= WORLD and "tensor<4x32xf8E4M3FN>) -> tensor<4x32xf32>" in hlo, hlo


@pytest.mark.parametrize("check_vma", [True, False])
def test_a_shared_x_scale_takes_one_dot(check_vma, fp8, scales, normal, make_mesh, assert_close):
  """An x_scale replicated into shard_map (invariant over "tp") is every shard's: the XLA path multiplies the
  gathered x in one dot, to the same values. Without shard_map's type checks nothing says it is shared: one dot
  per shard."""
  mesh = make_mesh((WORLD,), ("tp",))
  sx, sw = scales(1), scales(WORLD)
  x, w, b = fp8((WORLD * 4, 32), "float8_e4m3fn"), fp8((32, WORLD * 8), "float8_e4m3fn"), normal((WORLD * 8,), "f4")
  f = jax.jit(jax.shard_map(
      lambda x, w, b, sx, sw: jax_overlap.ag_matmul(x, w, b, x_scale=sx[0], w_scale=sw[0], axis_name="tp",
                                                    out_dtype=jnp.float32),
      mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp"), P(), P("tp")), out_specs=P(None, "tp"),
      check_vma=check_vma))
  hlo = f.lower(x, w, b, sx, sw).as_text()
  assert hlo.count("stablehlo.dot_general") == (1 if check_vma else WORLD), hlo
  want = dequantized(x, sx, 0) @ dequantized(w, sw, 1) + b.astype(np.float64)
  assert_close(f(x, w, b, sx, sw), want, jnp.float32, 32, term_scale(sx, sw))


def _equations(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _equations(sub)


# --- global arrays: one scale per array ------------------------------------------------------

@pytest.mark.parametrize("case", ["gather", "reduce_scatter", "all_reduce", "plain"])
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_global_arrays(case, axis_type, fp8, scales, normal, make_mesh, assert_close):
  """The plans of global arrays with float8 operands: one replicated scale per array."""
  mesh = make_mesh((WORLD,), ("tp",), getattr(jax.sharding.AxisType, axis_type))
  sx, sw = scales(1), scales(1)
  if case == "gather":
    op, specs, out = jax_overlap.ag_matmul, (P("tp", None), P(None, "tp"), P("tp")), None
    x, w = fp8((WORLD * 4, 32), "float8_e4m3fn"), fp8((32, WORLD * 8), "float8_e4m3fn")
  elif case == "plain":
    op, specs, out = jax_overlap.ag_matmul, (P(None, "tp"), P(None, None), P()), None
    x, w = fp8((WORLD * 4, 32), "float8_e5m2"), fp8((32, WORLD * 8), "float8_e4m3fn")
  else:
    op, specs = jax_overlap.matmul_rs, (P(None, "tp"), P("tp", None), P())
    out = NamedSharding(mesh, P("tp", None) if case == "reduce_scatter" else P())
    x, w = fp8((WORLD * 4, WORLD * 8), "float8_e4m3fn"), fp8((WORLD * 8, 16), "float8_e5m2")
  bias = normal((w.shape[1],), np.float32)
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w, bias), specs)]
  f = jax.jit(lambda x, w, b, sx, sw: op(x, w, b, x_scale=sx, w_scale=sw, out_dtype=jnp.float32, out_sharding=out))
  y = f(*args, sx[0], sw[0])
  want = dequantized(x, sx, 0) @ dequantized(w, sw, 0) + bias.astype(np.float64)
  assert_close(y, want, jnp.float32, x.shape[1], term_scale(sx, sw))


def test_global_return_gathered(fp8, scales, make_mesh):
  """On global arrays gathered is x and gathered_scales is [x_scale]: one scale for the whole of x."""
  mesh = make_mesh((WORLD,), ("tp",))
  x, w, sx, sw = fp8((WORLD * 4, 32), "float8_e4m3fn"), fp8((32, WORLD * 8), "float8_e4m3fn"), scales(1), scales(1)
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in ((x, P("tp")), (w, P(None, "tp")))]
  y, gathered, gathered_scales = jax.jit(
      lambda x, w, sx, sw: jax_overlap.ag_matmul(x, w, x_scale=sx, w_scale=sw, return_gathered=True))(*args, *sx, *sw)
  np.testing.assert_array_equal(np.asarray(gathered).view(np.uint8), x.view(np.uint8))
  assert gathered_scales.shape == (1,) and gathered_scales.dtype == jnp.float32
  np.testing.assert_array_equal(gathered_scales, sx)


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_global_w_kmajor(op, fp8, scales, make_mesh, assert_close):
  mesh = make_mesh((WORLD,), ("tp",))
  sx, sw = scales(1), scales(1)
  if op == "ag_matmul":
    x, w = fp8((WORLD * 4, 32), "float8_e4m3fn"), fp8((WORLD * 8, 32), "float8_e4m3fn")
    specs = (P("tp"), P("tp"))
  else:
    x, w = fp8((WORLD * 4, WORLD * 8), "float8_e4m3fn"), fp8((16, WORLD * 8), "float8_e4m3fn")
    specs = (P(None, "tp"), P(None, "tp"))
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), specs)]
  y = jax.jit(lambda x, w: getattr(jax_overlap, op)(x, w, x_scale=sx[0], w_scale=sw[0], w_kmajor=True))(*args)
  assert_close(y, dequantized(x, sx, 0) @ dequantized(w, sw, 0).T, jnp.bfloat16, x.shape[1], term_scale(sx, sw))


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_global_fast_accumulation(op, axis_type, fp8, scales, make_mesh, assert_close):
  """On global arrays (the custom partitioning's bodies, compiled) fast_accumulation reaches every dot: DEFAULT
  precision with it, HIGHEST without."""
  mesh = make_mesh((WORLD,), ("tp",), getattr(jax.sharding.AxisType, axis_type))
  sx, sw = scales(1), scales(1)
  if op == "ag_matmul":
    x, w, specs = fp8((WORLD * 4, 32), "float8_e4m3fn"), fp8((32, WORLD * 8), "float8_e4m3fn"), (P("tp"), P(None, "tp"))
  else:
    x, w, specs = fp8((WORLD * 4, WORLD * 8), "float8_e4m3fn"), fp8((WORLD * 8, 16), "float8_e4m3fn"), \
        (P(None, "tp"), P("tp"))
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), specs)]
  want = dequantized(x, sx, 0) @ dequantized(w, sw, 0)
  for fast in (False, True):
    f = jax.jit(lambda x, w: getattr(jax_overlap, op)(x, w, x_scale=sx[0], w_scale=sw[0], fast_accumulation=fast))
    dots = [line for line in f.lower(*args).compile().as_text().splitlines() if " dot(" in line]
    assert dots and all(("operand_precision={highest,highest}" in line) != fast for line in dots), dots
    assert_close(f(*args), want, jnp.bfloat16, x.shape[1], term_scale(sx, sw))


# --- vmap, empty shapes, differentiation ------------------------------------------------------

@pytest.mark.parametrize("batched", ["x", "scales"])
def test_vmap(batched, fp8, scales, make_mesh, assert_close):
  """A batched x folds into the rows (the scales stay the shards'); batched scales take the reference, vmapped."""
  mesh = make_mesh((WORLD,), ("tp",))
  x, w = fp8((3, WORLD * 4, 32), "float8_e4m3fn"), fp8((32, WORLD * 8), "float8_e4m3fn")
  sx, sw = scales(3 * WORLD).reshape(3, WORLD), scales(WORLD)

  def body(x, w, sx, sw):
    if batched == "x":
      return jax.vmap(lambda x: jax_overlap.ag_matmul(x, w, x_scale=sx[0, 0], w_scale=sw[0], axis_name="tp"))(x)
    return jax.vmap(lambda x, s: jax_overlap.ag_matmul(x, w, x_scale=s[0], w_scale=sw[0], axis_name="tp"))(x, sx)
  y = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), P(None, "tp"), P("tp")),
                            out_specs=P(None, None, "tp")))(x, w, sx, sw)
  for b in range(3):
    x_scales = sx[0] if batched == "x" else sx[b]
    want = dequantized(x[b], x_scales, 0) @ dequantized(w, sw, 1)
    assert_close(y[b], want, jnp.bfloat16, 32, term_scale(x_scales, sw), what=f"element {b}")


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_empty_rows(op, make_mesh):
  """No rows: the bias in out_dtype (and an empty gathered x, with the scales)."""
  x, w = jnp.zeros((0, 16), jnp.float8_e4m3fn), jnp.zeros((16, 8), jnp.float8_e4m3fn)
  bias = jnp.arange(8, dtype=jnp.float32)
  kwargs = dict(x_scale=2.0, w_scale=jnp.float32(0.5), out_dtype=jnp.float16)
  if op == "ag_matmul":
    y, gathered, gathered_scales = jax_overlap.ag_matmul(x, w, bias, return_gathered=True, **kwargs)
    assert gathered.shape == (0, 16) and gathered.dtype == x.dtype
    np.testing.assert_array_equal(gathered_scales, [2.0])
  else:
    y = jax_overlap.matmul_rs(x, w, bias, **kwargs)
  assert y.shape == (0, 8) and y.dtype == jnp.float16


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_the_xla_path_accumulates_as_asked(op, fp8, scales, normal, make_mesh, assert_close):
  """XLA's fp8 GEMM accumulates fast at precision DEFAULT: the XLA path's dots are HIGHEST (float32 sums, the GPU
  paths' default) unless fast_accumulation=True asks for DEFAULT; the values agree with float64 either way."""
  mesh = make_mesh((WORLD,), ("tp",))
  sx, sw = scales(WORLD), scales(WORLD)
  if op == "ag_matmul":
    x, w, b = fp8((WORLD * 4, 32), "float8_e4m3fn"), fp8((32, WORLD * 8), "float8_e4m3fn"), normal((WORLD * 8,), "f4")
    make = functools.partial(ag_shard_map, mesh, nlead=0)
    want = np.concatenate([dequantized(x[r * 4:(r + 1) * 4], [sx[r]], 0) for r in range(WORLD)]) @ \
        np.concatenate([dequantized(w[:, r * 8:(r + 1) * 8], [sw[r]], 1) for r in range(WORLD)], 1)
    want = want + np.asarray(b, np.float64)
  else:
    x, w, b = fp8((16, WORLD * 8), "float8_e4m3fn"), fp8((WORLD * 8, 16), "float8_e4m3fn"), normal((16,), "f4")
    make = functools.partial(rs_shard_map, mesh, nlead=0)
    want = sum(dequantized(x[:, r * 8:(r + 1) * 8], [sx[r]], 1) @ dequantized(w[r * 8:(r + 1) * 8], [sw[r]], 0)
               for r in range(WORLD)) + np.asarray(b, np.float64)
  args = (x, w, b, sx, sw)
  for fast in (False, True):
    f = make(fast_accumulation=fast, algorithm="xla")
    dots = [line for line in f.lower(*args).as_text().splitlines() if "stablehlo.dot_general" in line]
    assert dots and all(("HIGHEST" in line) != fast for line in dots), dots
    assert_close(f(*args), want, jnp.bfloat16, 32, term_scale(sx, sw))


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_fast_accumulation_takes_tensor_scaled_float8(op, fp8, normal):
  """fast_accumulation is a bool for float8 operands with tensor scales: an error names it otherwise."""
  fn = getattr(jax_overlap, op)
  x, w = fp8((8, 256), "float8_e4m3fn"), fp8((256, 128), "float8_e4m3fn")
  with pytest.raises(TypeError, match=rf"{op}: fast_accumulation applies to float8 operands only, got "
                                      r"fast_accumulation=True with x and w of dtype bfloat16"):
    fn(normal((8, 16), jnp.bfloat16), normal((16, 8), jnp.bfloat16), fast_accumulation=True)
  with pytest.raises(TypeError, match=rf"{op}: fast_accumulation must be a bool, got 'yes'"):
    fn(x, w, x_scale=1.0, w_scale=1.0, fast_accumulation="yes")
  with pytest.raises(ValueError, match=rf"{op}: fast_accumulation=True takes tensor scales .* got block scales"):
    fn(x, w, x_scale=jnp.ones((8, 2), jnp.float32), w_scale=jnp.ones((2, 1), jnp.float32), fast_accumulation=True)


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
@pytest.mark.parametrize("argnum", [0, 2], ids=["x", "x_scale"])
def test_grad_of_a_float8_call_raises(op, argnum, fp8):
  """A float8 operand is a quantized value: differentiating the call raises, pointing to the fp8 layers."""
  x, w = fp8((8, 16), "float8_e4m3fn"), fp8((16, 8), "float8_e4m3fn")

  def loss(x, w, sx):
    return jnp.sum(getattr(jax_overlap, op)(x, w, x_scale=sx, w_scale=jnp.float32(1)).astype(jnp.float32))
  with pytest.raises(TypeError, match=rf"jax_overlap\.{op}: differentiating a call with float8 operands .*"
                                      r"jax_overlap\.Fp8AgDotGeneral and Fp8RsDotGeneral.*algorithm='xla'"):
    jax.grad(loss, argnums=argnum)(x, w, jnp.float32(2))


def test_grad_on_the_xla_algorithm_is_jaxs(fp8):
  """algorithm="xla": JAX's derivative of the plain ops (the scale's gradient is exact in float32)."""
  x, w = fp8((8, 16), "float8_e4m3fn"), fp8((16, 8), "float8_e4m3fn")

  def loss(sx):
    return jnp.sum(jax_overlap.ag_matmul(x, w, x_scale=sx, w_scale=jnp.float32(1), out_dtype=jnp.float32,
                                         algorithm="xla"))
  want = np.sum(x.astype(np.float64) @ w.astype(np.float64))
  np.testing.assert_allclose(jax.grad(loss)(jnp.float32(3)), want, rtol=1e-6)


def test_lax_all_gather_of_float8(fp8, make_mesh):
  """The XLA path moves float8 bytes: the gathered x in its own format, not widened."""
  mesh = make_mesh((WORLD,), ("tp",))
  x, w = fp8((WORLD * 4, 32), "float8_e4m3fn"), fp8((32, WORLD * 8), "float8_e4m3fn")
  f = jax.jit(jax.shard_map(
      lambda x, w: jax_overlap.ag_matmul(x, w, x_scale=jnp.float32(1), w_scale=jnp.float32(1), axis_name="tp"),
      mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")))
  text = f.lower(x, w).as_text()
  gathers = [line for line in text.splitlines() if "all_gather" in line and "tensor<16x32x" in line]
  assert gathers and all("f8E4M3FN" in line for line in gathers), gathers


# --- the device: the formats it runs ------------------------------------------------------

class _FakeArch(FakeNative):
  """FakeNative's GPUs (CPU devices) as GPUs of another architecture."""

  def __init__(self, arch: str):
    super().__init__()
    self.arch = arch

  def device_info(self, ordinal):
    return {**super().device_info(ordinal), "arch": self.arch}


@pytest.fixture
def gpus_of(monkeypatch):
  """gpus_of(arch): a fresh runtime whose GPUs are of `arch` (fake_gpu.py)."""
  def install_arch(arch):
    install(monkeypatch.setattr, _FakeArch(arch))
    jax.clear_caches()
  yield install_arch
  jax.clear_caches()


@pytest.mark.parametrize("arch,family", [("sm_89", "ocp"), ("sm_90", "ocp"), ("sm_100", "ocp"), ("sm_120", "ocp"),
                                         ("gfx950", "ocp"), ("gfx942", "fnuz"), ("sm_80", None), ("gfx90a", None)])
def test_float8_family_of_each_arch(arch, family):
  assert formats.fp8_family_of(arch) == family


def _shape_of(op, x_dtype, w_dtype, algorithm):
  return jax.eval_shape(lambda x, w: getattr(jax_overlap, op)(x, w, x_scale=1.0, w_scale=1.0, algorithm=algorithm),
                        jax.ShapeDtypeStruct((8, 16), x_dtype), jax.ShapeDtypeStruct((16, 8), w_dtype))


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
@pytest.mark.parametrize("arch,fmt,family,devices", [
    ("sm_90", "float8_e4m3fnuz", "FNUZ", "gfx942"),
    ("gfx942", "float8_e4m3fn", "OCP", r"sm_89\+ or gfx950"),
    ("sm_80", "float8_e4m3fn", "OCP", r"sm_89\+ or gfx950"),
])
def test_explicit_algorithm_on_a_device_without_the_format(op, arch, fmt, family, devices, gpus_of):
  """A format the GPU cannot run: an error at trace time naming the dtype and the device."""
  gpus_of(arch)
  with pytest.raises(ValueError, match=rf"{op}: algorithm='pipelined' cannot run {fmt} on this device \(FakeNative "
                                       rf"GPU, {arch}\): {family} float8 formats run on {devices}; use "
                                       rf"algorithm='auto' or 'xla'"):
    _shape_of(op, fmt, fmt, "pipelined")


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_explicit_fused_declines_float8(op, gpus_of):
  gpus_of("sm_90")
  with pytest.raises(ValueError, match=rf"{op}: algorithm='fused' does not take float8 operands \(the fused kernels "
                                       rf"are 16-bit only; 'fused' takes bfloat16, float16\).*'pipelined', 'auto' or "
                                       rf"'xla'"):
    _shape_of(op, "float8_e4m3fn", "float8_e4m3fn", "fused")


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_explicit_algorithm_on_a_device_with_the_format(op, gpus_of):
  gpus_of("gfx942")
  _shape_of(op, "float8_e5m2fnuz", "float8_e4m3fnuz", "pipelined")


def test_auto_takes_the_xla_path_for_a_format_the_device_lacks(gpus_of, make_mesh, caplog):
  """Lowered for "cuda" on GPUs of sm_90, an fnuz call under "auto" is the XLA decomposition, said at DEBUG."""
  gpus_of("sm_90")
  mesh = make_mesh((WORLD,), ("tp",))
  f = jax.jit(jax.shard_map(
      lambda x, w: jax_overlap.ag_matmul(x, w, x_scale=jnp.float32(1), w_scale=jnp.float32(1), axis_name="tp"),
      mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")))
  args = [jax.ShapeDtypeStruct(s, jnp.float8_e4m3fnuz, sharding=NamedSharding(mesh, p))
          for s, p in (((WORLD * 64, 256), P("tp")), ((256, WORLD * 64), P(None, "tp")))]
  with caplog.at_level(logging.DEBUG, logger="jax_overlap"):
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "custom_call @jax_overlap" not in text and "all_gather" in text
  assert "XLA path (float8_e4m3fnuz on this device (FakeNative GPU, sm_90)" in caplog.text
