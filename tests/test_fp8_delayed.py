"""Fp8DelayedAgDotGeneral and Fp8DelayedRsDotGeneral (jax_overlap/layers/fp8_delayed.py): Flax's delayed-scaling
fp8 dot on the ops.

The state: the update rule bit for bit that of flax.linen.fp8_ops.update_fp8_meta, and after several training
steps on the same inputs the six variables bit for bit those of Flax's own op (Fp8DirectDotGeneralOp for the OCP
formats; for fnuz NANOOFp8DotGeneralOp, whose rule is the same), as the '_overwrite_with_gradient' collection
returns them. The values: y, dx and dW against a float64 reference of the same quantized computation, written here
in NumPy (ml_dtypes rounds to the float8 formats) with the scales Flax's rule gives, on random data and a state
whose scales saturate some of x; inside shard_map (the amax of the whole operand: the same state as on one device)
and on sharded global arrays. Bad fields are errors at construction.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import fp8_ops
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_overlap
from jax_overlap.ops import fp8_scales
from jax_overlap.layers.fp8_delayed import Fp8DelayedAgDotGeneral, Fp8DelayedRsDotGeneral
from jax_overlap.quantization import recipes
import tolerance

OWG = fp8_ops.OVERWRITE_WITH_GRADIENT
FAMILIES = {"ocp": ("float8_e4m3fn", "float8_e5m2"), "fnuz": ("float8_e4m3fnuz", "float8_e5m2fnuz")}
FLAX_OPS = {"ocp": nn.Fp8DirectDotGeneralOp, "fnuz": nn.NANOOFp8DotGeneralOp}
# (layer, x shape, kernel shape, dimension numbers): the column-parallel layer contracts x's last dim, the
# row-parallel one its last two (heads, head_dim), as attention's output projection does.
CASES = {
    "ag": (Fp8DelayedAgDotGeneral, (2, 16, 64), (64, 48), (((2,), (0,)), ((), ()))),
    "rs": (Fp8DelayedRsDotGeneral, (2, 16, 4, 16), (4, 16, 40), (((2, 3), (0, 1)), ((), ()))),
}
NAMES = ("input_scale", "input_amax_history", "kernel_scale", "kernel_amax_history", "output_grad_scale",
         "output_grad_amax_history")


def layer(parallel, family, **fields):
  cls = CASES[parallel][0]
  e4m3, e5m2 = FAMILIES[family]
  return cls(e4m3_dtype=jnp.dtype(e4m3), e5m2_dtype=jnp.dtype(e5m2), amax_history_length=16, **fields)


def draw(rng, shape, dtype, scale=1.0):
  return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def flax_scale(scale, history, fmt):
  """The scale Flax's rule gives a step with this state (its new scale: x does not enter it)."""
  return fp8_ops.update_fp8_meta(jnp.zeros((), jnp.float32), jnp.dtype(fmt), scale, history)[0]


def grads(module, state, x, w, dy, dims):
  """(y, dx, dW, the new state: the '_overwrite_with_gradient' cotangents)."""
  y, vjp = jax.vjp(lambda s, x, w: module.apply({OWG: s}, x, w, dims), state, x, w)
  ds, dx, dw = vjp(dy)
  return y, dx, dw, ds


def bits(a):
  return np.asarray(a).view(np.uint8)


def assert_state_equal(got, want, what=""):
  for name in NAMES:
    np.testing.assert_array_equal(bits(got[name]), bits(want[name]), err_msg=f"{what} {name}")


# --- the update rule ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"])
def test_update_rule_is_flaxs(fmt, rng):
  """step_scales (XLA's form, alone and with a second operand) and recorded against fp8_ops.update_fp8_meta on an
  operand with that amax: histories with amaxes, all zeros (the scale kept), an infinite one (kept), a NaN (kept);
  amaxes of zero, NaN and infinity recorded as they are. The zeros step_scales gives are zeros."""
  dtype = jnp.dtype(fmt)
  histories = [rng.uniform(0, 50, 8), np.zeros(8), np.array([3.0, np.inf, 0, 0, 0, 0, 0, 1.0]),
               np.array([3.0, 1.0, np.nan, 0, 0, 0, 0, 2.0])]
  other = (jnp.float32(0.7), jnp.asarray(rng.uniform(0, 9, 8), jnp.float32), "float8_e5m2")

  @jax.jit
  def steps(scale, history):
    alone = fp8_scales.step_scales([scale.reshape(())], [history], [dtype], algorithm="xla")
    paired = fp8_scales.step_scales([scale.reshape(()), other[0]], [history, other[1]], [dtype, other[2]],
                                    algorithm="xla")
    return alone, paired
  for history in histories:
    history = jnp.asarray(history, jnp.float32)
    scale = jnp.asarray([rng.uniform(0.01, 2)], jnp.float32)
    for amax in (0.0, 0.37, 812.5, np.nan, np.inf):
      x = jnp.asarray([-amax, amax / 2, 0.0], jnp.float32)
      want_scale, want_history = jax.jit(fp8_ops.update_fp8_meta, static_argnums=1)(x, dtype, scale, history)
      ((step,), (zero,)), ((step2, other_step), zeros) = steps(scale, history)
      got_scale, got_history = jax.jit(recipes.recorded)(jnp.max(jnp.abs(x)), step, scale, history)
      np.testing.assert_array_equal(bits(got_scale), bits(want_scale))
      np.testing.assert_array_equal(bits(got_history), bits(want_history))
      for s in (step, step2):
        np.testing.assert_array_equal(bits(s.reshape(1)), bits(want_scale))
      np.testing.assert_array_equal(bits(other_step.reshape(1)),
                                    bits(flax_scale(other[0].reshape(1), other[1], other[2])))
      assert [float(z) for z in (zero, *zeros)] == [0.0] * 3
  one = jnp.asarray([5.0], jnp.float32)  # amax_history_length=1: the history is the step's amax alone
  want_scale, want_history = jax.jit(fp8_ops.update_fp8_meta, static_argnums=1)(jnp.float32(2.5), dtype,
                                                                                 jnp.ones(1), one)
  (step,), _ = fp8_scales.step_scales([jnp.float32(1)], [one], [dtype], algorithm="xla")
  for got, want in zip(recipes.recorded(jnp.float32(2.5), step, jnp.ones(1), one), (want_scale, want_history)):
    np.testing.assert_array_equal(bits(got), bits(want))


# --- the state against Flax's op ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("parallel", CASES)
def test_variables_and_state_after_steps_are_flaxs(parallel, family, dtype, rng):
  """The same variables (collection, names, shapes, initial values) as Flax's op, and after four steps on the same
  inputs the same state, bit for bit: the amaxes of x, the kernel and the cotangent, and the scales from them."""
  _, x_shape, w_shape, dims = CASES[parallel]
  ours = layer(parallel, family)
  flax_op = FLAX_OPS[family](amax_history_length=16)
  x0, w0 = draw(rng, x_shape, dtype), draw(rng, w_shape, dtype)
  state = ours.init(jax.random.key(0), x0, w0, dims)[OWG]
  flax_state = flax_op.init(jax.random.key(0), x0, w0, dims)[OWG]
  assert jax.tree.map(lambda a: (a.shape, a.dtype), state) == jax.tree.map(lambda a: (a.shape, a.dtype), flax_state)
  assert_state_equal(state, flax_state, "init")
  step = jax.jit(grads, static_argnums=(0, 5))
  for i in range(4):
    # inputs of growing magnitude: the scales from the history lag the amaxes, and x saturates
    x, w = draw(rng, x_shape, dtype, 2.0 ** i), draw(rng, w_shape, dtype, 0.1 * 3.0 ** i)
    y = jax.eval_shape(lambda: ours.apply({OWG: state}, x, w, dims))
    dy = draw(rng, y.shape, dtype, 10.0 ** -i)
    state = step(ours, state, x, w, dy, dims)[3]
    flax_state = step(flax_op, flax_state, x, w, dy, dims)[3]
    assert_state_equal(state, flax_state, f"step {i}")


# --- values against float64 ----------------------------------------------------------------------------------------

def _quantized(a, fmt, scale):
  """a cast as the layer casts: float32 times the float32 reciprocal of the scale, saturated, rounded."""
  limit = np.float32(jnp.finfo(fmt).max)
  q = np.clip(np.asarray(a, np.float32) * (np.float32(1) / np.float32(scale)), -limit, limit)
  return np.asarray(q.astype(jnp.dtype(fmt)).astype(np.float32), np.float64) * np.float64(scale)


def _state(rng, amaxes):
  """A state whose histories hold amaxes around `amaxes` (x, kernel, cotangent) and whose scales are arbitrary."""
  state = {}
  for prefix, amax in zip(("input", "kernel", "output_grad"), amaxes):
    state[f"{prefix}_amax_history"] = jnp.asarray(rng.uniform(0.2, 1.0, 16) * amax, jnp.float32)
    state[f"{prefix}_scale"] = jnp.asarray(rng.uniform(0.5, 2.0, 1), jnp.float32)
  return state


def _reference(parallel, family, state, x, w, dy):
  """(y, dx, dW) in float64 of the layer's quantized computation: Flax's step scales, the layer's casts."""
  e4m3, e5m2 = FAMILIES[family]

  def scale(prefix, fmt):
    return np.float32(flax_scale(state[f"{prefix}_scale"], state[f"{prefix}_amax_history"], fmt)[0])
  xq = _quantized(x, e4m3, scale("input", e4m3))
  wq = _quantized(w, e4m3, scale("kernel", e4m3))
  dyq = _quantized(dy, e5m2, scale("output_grad", e5m2))
  contract = w.ndim - 1 if parallel == "rs" else 1
  rows = int(np.prod(x.shape[:x.ndim - contract]))
  x2, dy2 = xq.reshape(rows, -1), dyq.reshape(rows, -1)
  w2 = wq.reshape(-1, w.shape[-1]) if parallel == "rs" else wq.reshape(w.shape[0], -1)
  y = (x2 @ w2).reshape(dy.shape)
  dx = (dy2 @ w2.T).reshape(x.shape)
  dw = (x2.T @ dy2).reshape(w.shape)
  return y, dx, dw


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("parallel", CASES)
def test_values_and_gradients_against_float64(parallel, family, dtype, rng):
  """y, dx, dW: the products of the cast operands within the result dtype's rounding of the float64 products. The
  histories' amaxes sit below x's, so the largest values of x saturate."""
  _, x_shape, w_shape, dims = CASES[parallel]
  module = layer(parallel, family)
  x, w = draw(rng, x_shape, dtype), draw(rng, w_shape, dtype, 0.2)
  state = _state(rng, (1.5, 0.5, 1.0))
  y_shape = jax.eval_shape(lambda: module.apply({OWG: state}, x, w, dims)).shape
  dy = draw(rng, y_shape, dtype)
  y, dx, dw, _ = jax.jit(grads, static_argnums=(0, 5))(module, state, x, w, dy, dims)
  want = _reference(parallel, family, state, np.asarray(x, np.float32), np.asarray(w, np.float32),
                    np.asarray(dy, np.float32))
  x_scale = flax_scale(state["input_scale"], state["input_amax_history"], FAMILIES[family][0])
  assert float(jnp.max(jnp.abs(x.astype(jnp.float32)))) / float(x_scale[0]) > float(jnp.finfo(FAMILIES[family][0]).max), \
      "no value of x saturates: the test lost its point"
  rows = int(np.prod(x_shape[:2]))
  for got, ref, k, what in ((y, want[0], int(np.prod(w_shape)) // int(np.prod(y_shape[2:])), "y"),
                            (dx, want[1], int(np.prod(y_shape[2:])), "dx"), (dw, want[2], rows, "dW")):
    assert got.dtype == jnp.dtype(dtype) and got.shape == ref.shape, what
    tolerance.assert_close(got, ref, dtype, k, scale=tolerance.rms(ref) / np.sqrt(k), what=what)


# --- shard_map and global arrays ---------------------------------------------------------------------------------

SPECS = {"ag": (P(None, "tp", None), P(None, "tp"), P(None, None, "tp")),  # x rows, kernel columns, y columns
         "rs": (P(None, None, "tp", None), P("tp", None, None), P(None, "tp", None))}  # x heads, kernel heads, y rows


@pytest.mark.parametrize("parallel", CASES)
def test_inside_shard_map_the_state_is_the_whole_operands(parallel, rng, make_mesh):
  """Inside shard_map over 4 ranks: every rank records the amax of the whole x, kernel and cotangent, so the new
  state equals the one-device layer's bit for bit (replicated, not summed over the ranks); values and gradients
  within rounding of it."""
  _, x_shape, w_shape, dims = CASES[parallel]
  mesh = make_mesh((4,), ("tp",))
  x, w = draw(rng, x_shape, "float32"), draw(rng, w_shape, "float32", 0.2)
  state = _state(rng, (1.5, 0.5, 1.0))
  one = layer(parallel, "ocp")
  sharded = layer(parallel, "ocp", axis_name="tp")
  y_shape = jax.eval_shape(lambda: one.apply({OWG: state}, x, w, dims)).shape
  dy = draw(rng, y_shape, "float32")
  x_spec, w_spec, y_spec = SPECS[parallel]
  apply = jax.shard_map(lambda s, x, w: sharded.apply({OWG: s}, x, w, dims), mesh=mesh,
                        in_specs=(P(), x_spec, w_spec), out_specs=y_spec)

  def run(f):
    y, vjp = jax.vjp(f, state, x, w)
    return (y, *vjp(dy))
  y, ds, dx, dw = jax.jit(lambda: run(apply))()
  y1, ds1, dx1, dw1 = jax.jit(lambda: run(lambda s, x, w: one.apply({OWG: s}, x, w, dims)))()
  assert_state_equal(ds, ds1, "shard_map")
  for got, want in ((y, y1), (dx, dx1), (dw, dw1)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * tolerance.rms(want))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=lambda t: t.name)
@pytest.mark.parametrize("parallel", CASES)
def test_on_sharded_global_arrays(parallel, axis_type, rng, make_mesh):
  """axis_name=None on global arrays sharded over 8 devices (data 2 x tensor 4, x's rows or contraction and the
  kernel on "tp"; the mesh's axes Auto or Explicit): the values, gradients and state of the unsharded call."""
  _, x_shape, w_shape, dims = CASES[parallel]
  mesh = make_mesh((2, 4), ("dp", "tp"), axis_type)
  x, w = draw(rng, x_shape, "float32"), draw(rng, w_shape, "float32", 0.2)
  state = _state(rng, (1.5, 0.5, 1.0))
  module = layer(parallel, "ocp")
  x_spec, w_spec, _ = SPECS[parallel]
  xs = jax.device_put(x, NamedSharding(mesh, P("dp", *x_spec[1:])))
  ws = jax.device_put(w, NamedSharding(mesh, w_spec))
  y_shape = jax.eval_shape(lambda: module.apply({OWG: state}, x, w, dims)).shape
  dy = draw(rng, y_shape, "float32")
  step = jax.jit(grads, static_argnums=(0, 5))
  with jax.set_mesh(mesh):
    got = step(module, state, xs, ws, dy, dims)
  want = step(module, state, x, w, dy, dims)
  assert_state_equal(got[3], want[3], "global arrays")
  for a, b in zip(got[:3], want[:3]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * tolerance.rms(b))


# --- the public names and bad fields ---------------------------------------------------------------------------------

def test_public_names_import_flax_on_first_use():
  import subprocess
  import sys
  code = ("import sys, jax_overlap; assert 'flax' not in sys.modules, 'import jax_overlap imported flax'; "
          "assert jax_overlap.Fp8DelayedRsDotGeneral.__module__ == 'jax_overlap.layers.fp8_delayed'")
  done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True)
  assert done.returncode == 0, done.stderr
  assert jax_overlap.Fp8DelayedAgDotGeneral is Fp8DelayedAgDotGeneral


@pytest.mark.parametrize("fields,error,match", [
    ({"e4m3_dtype": jnp.float8_e4m3fn, "e5m2_dtype": jnp.float8_e5m2fnuz}, ValueError, "e4m3_dtype and e5m2_dtype must be one family's pair"),
    ({"e4m3_dtype": jnp.bfloat16}, ValueError, "e4m3_dtype and e5m2_dtype must be one family's pair"),
    ({"algorithm": "fused"}, ValueError, "algorithm must be one of"),
    ({"axis_name": 3}, TypeError, "axis_name must be None"),
    ({"amax_history_length": 0}, ValueError, "amax_history_length must be a positive int"),
    ({"gather_axis": "rows"}, TypeError, "gather_axis must be an int"),
    ({"fast_accumulation": None}, TypeError, "fast_accumulation must be True or False, got None"),
])
def test_bad_fields_are_errors_at_construction(fields, error, match):
  with pytest.raises(error, match=f"jax_overlap.Fp8DelayedAgDotGeneral: {match}"):
    Fp8DelayedAgDotGeneral(**fields)


def test_bad_calls_name_what_to_change(rng):
  dims = (((1,), (0,)), ((), ()))
  with pytest.raises(ValueError, match="scatter_axis=-1 .* not supported inside shard_map"):
    Fp8DelayedRsDotGeneral(axis_name="tp", scatter_axis=-1)
  module = Fp8DelayedAgDotGeneral()
  x8 = jnp.zeros((8, 16), jnp.float8_e4m3fn)
  with pytest.raises(TypeError, match="kernel must have dtype bfloat16, float16, float32"):
    module.init(jax.random.key(0), jnp.zeros((8, 16)), x8, dims)
  with pytest.raises(ValueError, match="dimension_numbers must contract x's last dim with the kernel's first"):
    module.init(jax.random.key(0), jnp.zeros((8, 16)), jnp.zeros((8, 16)), (((0,), (0,)), ((), ())))
