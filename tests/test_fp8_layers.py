"""Fp8AgDotGeneral and Fp8RsDotGeneral: values and gradients against a float64 reference of the same quantized
computation, written here in NumPy (ml_dtypes rounds to the float8 formats), on random data.

The reference quantizes as the layers do (current scaling: the amax of each rank's shard inside shard_map, of the
whole array on global arrays; a power-of-two scale; round to nearest even), so the float8 operands agree bit for
bit, and what is left to compare is the GEMMs' float32 accumulation and the roundings of the results (tolerance.py
at the result's dtype). Also: gradients within float8's error of the unquantized ones (the VJP is the derivative
of the function it quantizes), the residuals the layers keep (float8, not the activation) under jax.checkpoint
policies, Flax models, and the layers' bad inputs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap
from jax_overlap import remat
from test_remat import count

WORLD = 4
DN = (((2,), (0,)), ((), ()))  # x [B, S, K] with a kernel [K, N]
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"


# --- the reference -------------------------------------------------------------------

def scale_of(a, fmt) -> np.float32:
  """The layers' current scaling (numerics.fp8_scale): 2^ceil(log2(amax / max)) in float32."""
  amax = np.float32(np.max(np.abs(np.asarray(a, np.float32))))
  ratio = amax / np.float32(jnp.finfo(fmt).max)
  if ratio == 0:
    return np.float32(1)
  mantissa, exponent = np.frexp(ratio)
  return np.ldexp(np.float32(1), exponent - (mantissa == 0.5)).astype(np.float32)


def quantized(a, fmt, scale=None):
  """(a rounded to fmt with `scale` (default: its own current scaling), the scale)."""
  scale = scale_of(a, fmt) if scale is None else np.float32(scale)
  return (np.asarray(a, np.float32) * (np.float32(1) / scale)).astype(jnp.dtype(fmt)), scale


def f64(q, scale=1.0):
  return np.asarray(q.astype(np.float32), np.float64) * np.float64(scale)


def split(a, parts: int, axis: int) -> list:
  return np.split(np.asarray(a), parts, axis=axis)


def rounded(a, dtype):
  return np.asarray(np.asarray(a, np.float64).astype(jnp.dtype(dtype)), np.float64)


def ag_layer_reference(x, w, dy, groups: int, blocks: int):
  """(y, dx, dW) of Fp8AgDotGeneral on x [B, S, K] gathered along S, w [K, N] with its columns in `blocks`, and
  the cotangent dy [B, S, N]: x and w quantized in `groups` shards each (blocks inside shard_map; one on global
  arrays), dy in each block's columns (or whole), dx's partials rounded per block and summed (matmul_rs)."""
  dtype = x.dtype
  xq = [quantized(s, E4M3) for s in split(x, groups, 1)]
  wq = [quantized(s, E4M3) for s in split(w, groups, 1)]
  gathered = np.concatenate([f64(q, s) for q, s in xq], axis=1)
  w_deq = np.concatenate([f64(q, s) for q, s in wq], axis=1)
  y = gathered @ w_deq
  dyq = [quantized(s, E5M2) for s in split(dy, groups, 2)]
  dy_deq = np.concatenate([f64(q, s) for q, s in dyq], axis=2)
  partials = [rounded(d @ wb.T, dtype) for d, wb in zip(split(dy_deq, blocks, 2), split(w_deq, blocks, 1))]
  dx = sum(partials)
  # dW: dy's rows times their shard's x scale, quantized with one scale per column group; the gathered x unscaled
  x_scales = np.repeat([s for _, s in xq], x.shape[1] // groups).reshape(1, -1, 1)
  if groups == 1:
    dyw = dy_deq * x_scales
  else:
    dyw = np.concatenate([f64(*quantized(np.asarray(s, np.float32) * x_scales.astype(np.float32), E5M2))
                          for s in split(dy, groups, 2)], axis=2)
  gathered_raw = np.concatenate([f64(q) for q, _ in xq], axis=1)
  dw = np.einsum("bsk,bsn->kn", gathered_raw, dyw)
  return y, dx, dw


def rs_layer_reference(x, w, dz, groups: int, blocks: int):
  """(z, dx, dW) of Fp8RsDotGeneral on x [B, S, K] with K in `blocks`, w [K, N], the cotangent dz [B, S, N]:
  x and w quantized in `groups` shards of K; dz in `groups` row blocks, gathered, its shards' scales folded into
  it by power-of-two shifts."""
  dtype = x.dtype
  xq = [quantized(s, E4M3) for s in split(x, groups, 2)]
  wq = [quantized(s, E4M3) for s in split(w, groups, 0)]
  x_deq = np.concatenate([f64(q, s) for q, s in xq], axis=2)
  w_deq = np.concatenate([f64(q, s) for q, s in wq], axis=0)
  z = sum(rounded(a @ b, dtype) for a, b in zip(split(x_deq, blocks, 2), split(w_deq, blocks, 0)))
  dzq = [quantized(s, E5M2) for s in split(dz, groups, 1)]
  dx = np.concatenate([f64(q, s) for q, s in dzq], axis=1) @ w_deq.T
  top = max(s for _, s in dzq)
  dzw = np.concatenate([f64(quantized(f64(q, s / top).astype(np.float32), E5M2, 1.0)[0], top) for q, s in dzq],
                       axis=1)
  dw = np.einsum("bsk,bsn->kn", x_deq, dzw)
  return z, dx, dw


# --- the layers -------------------------------------------------------------------------

def _operands(normal, dtype, k=64, n=WORLD * 16):
  x = normal((2, WORLD * 8, k), dtype)
  w = (normal((k, n), np.float32) / np.sqrt(k)).astype(dtype)
  return x, w


def _vjp(f, x, w, ct):
  y, vjp = jax.vjp(f, x, w)
  return (y, *vjp(ct))


def _check(got, want, dtype, terms, assert_close):
  for name, g, r, k in zip(("value", "dx", "dW"), got, want, terms):
    assert g.dtype == jnp.dtype(dtype), name
    assert_close(g, r, dtype, k, scale=float(np.sqrt(np.mean(np.square(r)) / k)), what=name)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_ag_layer_in_shard_map(dtype, normal, make_mesh, assert_close):
  """Each rank quantizes its own shard; the gathered shards keep their scales (dW folds them into dy)."""
  mesh = make_mesh((WORLD,), ("tp",))
  x, w = _operands(normal, dtype)
  dy = normal((2, WORLD * 8, w.shape[1]), dtype)
  f = jax.shard_map(lambda x, w: jax_overlap.Fp8AgDotGeneral(axis_name="tp")(x, w, DN), mesh=mesh,
                    in_specs=(P(None, "tp"), P(None, "tp")), out_specs=P(None, None, "tp"))
  got = jax.jit(lambda x, w, dy: _vjp(f, x, w, dy))(x, w, dy)
  _check(got, ag_layer_reference(x, w, dy, WORLD, WORLD), dtype, (64, w.shape[1], 2 * WORLD * 8), assert_close)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_rs_layer_in_shard_map(dtype, normal, make_mesh, assert_close):
  """Each rank's partial from its own scales; the gathered dz's shards folded into one scale for dW."""
  mesh = make_mesh((WORLD,), ("tp",))
  x, w = _operands(normal, dtype, k=WORLD * 16, n=32)
  dz = normal((2, WORLD * 8, 32), dtype)
  f = jax.shard_map(lambda x, w: jax_overlap.Fp8RsDotGeneral(axis_name="tp")(x, w, DN), mesh=mesh,
                    in_specs=(P(None, None, "tp"), P("tp", None)), out_specs=P(None, "tp", None))
  got = jax.jit(lambda x, w, dz: _vjp(f, x, w, dz))(x, w, dz)
  _check(got, rs_layer_reference(x, w, dz, WORLD, WORLD), dtype, (w.shape[0], 32, 2 * WORLD * 8), assert_close)


@pytest.mark.parametrize("layer", ["ag", "rs"])
def test_layers_on_the_batch_dim(layer, normal, make_mesh, assert_close):
  """gather_axis=0 / scatter_axis=0: the shards (and their scales) are blocks of the batch. The reference runs on
  x with its batch and sequence dims swapped, which moves the shards to dim 1 and changes nothing else."""
  mesh = make_mesh((WORLD,), ("tp",))
  swap = lambda a: np.swapaxes(np.asarray(a), 0, 1)
  if layer == "ag":
    x, w = normal((WORLD * 2, 8, 64), "float32"), normal((64, WORLD * 16), "float32") / 8
    dot, specs, out_spec = jax_overlap.Fp8AgDotGeneral(axis_name="tp", gather_axis=0), (P("tp"), P(None, "tp")), \
        P(None, None, "tp")
    ct = normal((WORLD * 2, 8, w.shape[1]), "float32")
  else:
    x, w = normal((WORLD * 2, 8, WORLD * 16), "float32"), normal((WORLD * 16, 32), "float32") / 8
    dot, specs, out_spec = jax_overlap.Fp8RsDotGeneral(axis_name="tp", scatter_axis=0), (P(None, None, "tp"),
                                                                                        P("tp")), P("tp")
    ct = normal((WORLD * 2, 8, 32), "float32")
  reference = ag_layer_reference if layer == "ag" else rs_layer_reference
  want = reference(swap(x), w, swap(ct), WORLD, WORLD)
  f = jax.shard_map(lambda x, w: dot(x, w, DN), mesh=mesh, in_specs=specs, out_specs=out_spec)
  got = jax.jit(lambda x, w, ct: _vjp(f, x, w, ct))(x, w, ct)
  _check((got[0], got[1], got[2]), (swap(want[0]), swap(want[1]), want[2]), "float32",
         (x.shape[2], w.shape[1], WORLD * 16), assert_close)


@pytest.mark.parametrize("layer", ["ag", "rs"])
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_layers_on_global_arrays(layer, axis_type, normal, make_mesh, assert_close):
  """One scale per array; the gradients in their primal's layout on an Explicit mesh."""
  mesh = make_mesh((WORLD,), ("tp",), getattr(jax.sharding.AxisType, axis_type))
  if layer == "ag":
    x, w = _operands(normal, "bfloat16")
    specs, out_spec = (P(None, "tp", None), P(None, "tp")), P(None, None, "tp")
    dot, reference = jax_overlap.Fp8AgDotGeneral(), ag_layer_reference
  else:
    x, w = _operands(normal, "bfloat16", k=WORLD * 16, n=32)
    specs, out_spec = (P(None, None, "tp"), P("tp", None)), P(None, "tp", None)
    dot, reference = jax_overlap.Fp8RsDotGeneral(), rs_layer_reference
  ct = normal((*x.shape[:2], w.shape[1]), "bfloat16")
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w, ct), (*specs, out_spec))]
  sharding = NamedSharding(mesh, out_spec)
  got = jax.jit(lambda x, w, ct: _vjp(lambda x, w: dot(x, w, DN, out_sharding=sharding), x, w, ct))(*args)
  _check(got, reference(x, w, ct, 1, WORLD), "bfloat16", (x.shape[2], w.shape[1], 2 * WORLD * 8), assert_close)
  if axis_type == "Explicit":
    for g, a in zip(got[1:], args[:2]):
      assert g.sharding.is_equivalent_to(a.sharding, a.ndim)


@pytest.mark.parametrize("layer", ["ag", "rs"])
def test_gradients_within_float8_error_of_the_unquantized(layer, normal, make_mesh):
  """The VJP is the derivative of the function it quantizes: close to float32's, within e5m2 and e4m3 rounding
  (relative 2-norm error 0.1; a missing scale or a wrong fold is off by far more)."""
  mesh = make_mesh((WORLD,), ("tp",))
  if layer == "ag":
    x, w = _operands(normal, "float32")
    specs, out_spec, dot = (P(None, "tp"), P(None, "tp")), P(None, None, "tp"), jax_overlap.Fp8AgDotGeneral
  else:
    x, w = _operands(normal, "float32", k=WORLD * 16, n=32)
    specs, out_spec, dot = (P(None, None, "tp"), P("tp", None)), P(None, "tp", None), jax_overlap.Fp8RsDotGeneral
  f = jax.shard_map(lambda x, w: dot(axis_name="tp")(x, w, DN), mesh=mesh, in_specs=specs, out_specs=out_spec)
  loss = lambda f: jax.jit(jax.value_and_grad(lambda x, w: jnp.mean(jnp.square(f(x, w))), argnums=(0, 1)))
  got = loss(f)(x, w)
  want = loss(lambda x, w: jax.lax.dot_general(x, w, DN, precision="highest"))(x, w)
  for name, g, r in zip(("loss", "dx", "dW"), jax.tree.leaves(got), jax.tree.leaves(want)):
    err = np.linalg.norm(np.asarray(g, np.float64) - r) / np.linalg.norm(r)
    assert err < 0.1, f"{name}: relative error {err:.3f}"


def test_multi_dim_kernels(normal, make_mesh, assert_close):
  """Kernels [E, 2, F] (a gated MLP's) and [H, D, E] (attention's output): quantized into K-major layouts."""
  mesh = make_mesh((WORLD,), ("tp",))
  x = normal((2, WORLD * 4, 32), "float32")
  w_up = normal((32, 2, WORLD * 8), "float32") / np.sqrt(32)
  w_out = normal((WORLD, 8, 32), "float32") / np.sqrt(32)

  def block(x, w_up, w_out):
    g = jax_overlap.Fp8AgDotGeneral(axis_name="tp")(x, w_up, (((2,), (0,)), ((), ())))  # [B, S, 2, F/T]
    h = g[..., 0, :].reshape(*g.shape[:2], 1, 8)  # [B, S, H/T, D]
    return jax_overlap.Fp8RsDotGeneral(axis_name="tp")(h, w_out, (((2, 3), (0, 1)), ((), ())))
  f = jax.shard_map(block, mesh=mesh, in_specs=(P(None, "tp"), P(None, None, "tp"), P("tp")),
                    out_specs=P(None, "tp"))

  def reference(x, w_up, w_out):
    g = jnp.einsum("bsk,kgf->bsgf", x, w_up)
    return jnp.einsum("bshd,hde->bse", g[..., 0, :].reshape(*g.shape[:2], WORLD, 8), w_out)
  got = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2)))(x, w_up, w_out)
  want = jax.grad(lambda *a: jnp.sum(jnp.sin(reference(*a))), argnums=(0, 1, 2))(x, w_up, w_out)
  for g, r in zip(got, want):
    assert np.linalg.norm(np.asarray(g) - r) / np.linalg.norm(r) < 0.1


# --- residuals and jax.checkpoint -----------------------------------------------------------

def _mlp(mesh):
  def mlp(x, w1, w2):
    h = jax_overlap.Fp8AgDotGeneral(axis_name="tp")(x, w1, DN)
    return jax_overlap.Fp8RsDotGeneral(axis_name="tp")(jax.nn.gelu(h), w2, DN)
  return jax.shard_map(mlp, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), P("tp", None)),
                       out_specs=P(None, "tp"))


def _residuals(f, *args):
  """The residuals' (dtype, shape), traced, not run: the vjp function is a pytree of them."""
  vjp = jax.eval_shape(lambda *a: jax.vjp(f, *a)[1], *args)
  return [(np.dtype(a.dtype).name, a.shape) for a in jax.tree.leaves(vjp)]


POLICIES = [
    ("no_checkpoint", None),
    ("dots_saveable", jax.checkpoint_policies.dots_saveable),
    ("dots_with_no_batch_dims_saveable", jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
    ("save_only_these_names", jax.checkpoint_policies.save_only_these_names(*remat.NAMES)),
]


@pytest.mark.parametrize("policy", [p for _, p in POLICIES], ids=[n for n, _ in POLICIES])
def test_residuals_are_float8(policy, normal, make_mesh):
  """What the backward pass keeps: the gathered float8 x with its scales and matmul_rs's float8 x, never a layer's
  bfloat16 input (x [B, S, 32] or the gathered x); seen from outside shard_map each rank's residual is stacked
  on the first dim. The bfloat16 [B, S, F/T] ones are gelu's, the MLP's own."""
  mesh = make_mesh((WORLD,), ("tp",))
  x, w1 = _operands(normal, "bfloat16", k=32, n=WORLD * 16)
  w2 = normal((WORLD * 16, 32), "bfloat16")
  f = _mlp(mesh)
  if policy is not None:
    f = jax.checkpoint(f, policy=policy)
  residuals = _residuals(f, x, w1, w2)
  assert (E4M3, (WORLD * 2, WORLD * 8, 32)) in residuals  # each rank's gathered x [B, S, K]
  assert ("float32", (WORLD * WORLD,)) in residuals  # and its shards' scales
  assert (E4M3, (WORLD * 2, WORLD * 8, 16)) in residuals  # matmul_rs's x, each rank's [B, S, F/T]
  activations = [r for r in residuals if r[0] == "bfloat16" and len(r[1]) == 3]
  assert all(r == ("bfloat16", (WORLD * 2, WORLD * 8, 16)) for r in activations), residuals


def test_nothing_saveable_recomputes_the_forward(normal, make_mesh):
  """nothing_saveable keeps the inputs alone and runs each layer's op again in the backward pass."""
  mesh = make_mesh((WORLD,), ("tp",))
  x, w1 = _operands(normal, "bfloat16", k=32, n=WORLD * 16)
  w2 = normal((WORLD * 16, 32), "bfloat16")
  f = jax.checkpoint(_mlp(mesh), policy=jax.checkpoint_policies.nothing_saveable)
  assert sorted(_residuals(f, x, w1, w2)) == sorted(("bfloat16", a.shape) for a in (x, w1, w2))
  saved = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(_mlp(mesh)(*a).astype(jnp.float32)), argnums=(0, 1, 2)))(
      x, w1, w2).jaxpr
  recomputed = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2)))(
      x, w1, w2).jaxpr
  # forward ag + rs's dual ag, forward rs + ag's dual rs; recomputing runs ag again for its gathered x (matmul_rs's
  # residual is its quantized input: no op to run again). Each layer's dW is a group of one's matmul_rs.
  for jaxpr, ag_calls in ((saved, 2), (recomputed, 3)):
    assert (count(jaxpr, "jax_overlap_ag_matmul", grouped=True), count(jaxpr, "jax_overlap_matmul_rs", grouped=True),
            count(jaxpr, "jax_overlap_matmul_rs", grouped=False)) == (ag_calls, 2, 2)


# --- Flax --------------------------------------------------------------------------------

def test_nnx_layers(make_mesh):
  """nnx.Linear / LinearGeneral with the fp8 layers as dot_general, on global arrays: the loss and gradients of
  the float32 model within float8's error."""
  nnx = pytest.importorskip("flax.nnx", reason="needs flax (pip install '.[examples]')")
  mesh = make_mesh((2, 4), ("dp", "tp"))

  class Mlp(nnx.Module):
    def __init__(self, ag, rs, rngs):
      self.up = nnx.LinearGeneral(32, (2, 64), dot_general=ag, rngs=rngs)
      self.down = nnx.Linear(64, 32, dot_general=rs, rngs=rngs)

    def __call__(self, x):
      g = self.up(x)
      return x + self.down(nnx.silu(g[..., 0, :]) * g[..., 1, :])

  model = Mlp(jax_overlap.Fp8AgDotGeneral(), jax_overlap.Fp8RsDotGeneral(), nnx.Rngs(0))
  reference = Mlp(jax.lax.dot_general, jax.lax.dot_general, nnx.Rngs(0))
  specs = {"up": {"kernel": P(None, None, "tp"), "bias": P(None, "tp")}, "down": {"kernel": P("tp"), "bias": P()}}
  for name, layer_specs in specs.items():
    for param, spec in layer_specs.items():
      p = getattr(getattr(model, name), param)
      p[...] = jax.device_put(p[...], NamedSharding(mesh, spec))
  x = jax.random.normal(jax.random.key(1), (4, 16, 32))
  loss = lambda m, x: jnp.mean(jnp.square(m(x)))
  value, grads = nnx.jit(nnx.value_and_grad(loss))(model, jax.device_put(x, NamedSharding(mesh, P("dp", "tp"))))
  want_value, want_grads = nnx.value_and_grad(loss)(reference, x)
  assert abs(float(value) - float(want_value)) < 0.02 * abs(float(want_value))
  for g, r in zip(jax.tree.leaves(nnx.state(grads)), jax.tree.leaves(nnx.state(want_grads))):
    assert np.linalg.norm(np.asarray(g) - r) / np.linalg.norm(r) < 0.1


# --- bad input ---------------------------------------------------------------------------

@pytest.mark.parametrize("cls", ["Fp8AgDotGeneral", "Fp8RsDotGeneral"])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float8_e4m3fn], ids=lambda d: np.dtype(d).name)
def test_layer_input_dtype(cls, dtype):
  with pytest.raises(TypeError, match=rf"{cls}: x must have dtype bfloat16, float16, float32 \(the layer quantizes "
                                      rf"it\), got {np.dtype(dtype).name}"):
    jax.eval_shape(lambda x, w: getattr(jax_overlap, cls)()(x, w, (((1,), (0,)), ((), ()))),
                   jax.ShapeDtypeStruct((8, 16), dtype), jax.ShapeDtypeStruct((16, 8), jnp.float32))


@pytest.mark.parametrize("cls", ["Fp8AgDotGeneral", "Fp8RsDotGeneral"])
def test_layer_family(cls):
  with pytest.raises(ValueError, match=rf"{cls}: family must be None \(the GPU's\), 'ocp' or 'fnuz', got 'e4m3'"):
    getattr(jax_overlap, cls)(family="e4m3")  # at construction


@pytest.mark.parametrize("cls", ["Fp8AgDotGeneral", "Fp8RsDotGeneral"])
def test_layer_fast_accumulation(cls):
  """The forward GEMM accumulates fast by default with tensor scales, not with block scales (which take none);
  asking for it with block scales, or passing a non-bool, is an error at construction."""
  layer = getattr(jax_overlap, cls)
  assert layer().forward_fast_accumulation() and not layer(fast_accumulation=False).forward_fast_accumulation()
  assert not layer(scaling="block").forward_fast_accumulation()
  with pytest.raises(ValueError, match=rf"{cls}: fast_accumulation=True with scaling='block': fast accumulation takes tensor scales"):
    layer(scaling="block", fast_accumulation=True)
  with pytest.raises(TypeError, match=rf"{cls}: fast_accumulation must be None, True or False, got 1"):
    layer(fast_accumulation=1)


@pytest.mark.parametrize("family,fmt", [("ocp", "float8_e4m3fn"), ("fnuz", "float8_e4m3fnuz")])
def test_layer_family_sets_the_formats(family, fmt, normal):
  x, w = normal((8, 16), "float32"), normal((16, 8), "float32")
  jaxpr = jax.make_jaxpr(lambda x, w: jax_overlap.Fp8AgDotGeneral(family=family)(x, w, (((1,), (0,)), ((), ()))))(
      x, w)
  assert fmt in str(jaxpr)


def test_rs_layer_columns_in_shard_map(make_mesh):
  mesh = make_mesh((WORLD,), ("tp",))
  f = jax.shard_map(lambda x, w: jax_overlap.Fp8RsDotGeneral(axis_name="tp", scatter_axis=-1)(x, w, DN), mesh=mesh,
                    in_specs=(P(None, None, "tp"), P("tp", None)), out_specs=P(None, None, "tp"))
  with pytest.raises(ValueError, match=r"Fp8RsDotGeneral: scatter_axis=-1 \(the output columns\) is not supported "
                                       r"inside shard_map"):
    jax.eval_shape(f, jax.ShapeDtypeStruct((2, 8, 16), jnp.float32), jax.ShapeDtypeStruct((16, 8), jnp.float32))
