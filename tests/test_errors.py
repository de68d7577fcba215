"""Bad input fails at trace time with a TypeError/ValueError that names the argument and what was expected.

jax.eval_shape traces without lowering or running, so an error raised under it
is a trace-time error.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap

OPS = ["ag_matmul", "matmul_rs"]


def spec(shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


def trace(op, *args, **kwargs):
  return jax.eval_shape(lambda *a: getattr(jax_overlap, op)(*a, **kwargs), *args)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.complex64, jnp.int8], ids=lambda d: np.dtype(d).name)
def test_unsupported_dtype(op, dtype):
  with pytest.raises(TypeError, match=rf"jax_overlap\.{op}: x must have dtype bfloat16, float16, float8_e4m3fn, "
                                      rf"float8_e5m2, float8_e4m3fnuz, float8_e5m2fnuz, float32 or float64 "
                                      rf"\(the XLA path only\), got {np.dtype(dtype).name}"):
    trace(op, spec((8, 16), dtype), spec((16, 8), dtype))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("which", ["w", "bias"])
def test_dtype_mismatch(op, which):
  w_dtype = jnp.bfloat16 if which == "w" else jnp.float32
  b_dtype = jnp.float16 if which == "bias" else jnp.float32
  with pytest.raises(TypeError, match=rf"{op}: x, w and bias must share one dtype, got x float32, "
                                      rf"w {np.dtype(w_dtype).name}, bias {np.dtype(b_dtype).name}"):
    trace(op, spec((8, 16)), spec((16, 8), w_dtype), spec((8,), b_dtype))


@pytest.mark.parametrize("op", OPS)
def test_x_not_an_array(op):
  with pytest.raises(TypeError, match=rf"{op}: x must be an array, got list"):
    getattr(jax_overlap, op)([[1.0, 2.0]], jnp.ones((2, 2)))


@pytest.mark.parametrize("op", OPS)
def test_x_rank_1(op):
  with pytest.raises(ValueError, match=rf"{op}: x must have rank >= 2 .*got shape \(16,\)"):
    trace(op, spec((16,)), spec((16, 8)))


@pytest.mark.parametrize("op", OPS)
def test_w_rank_1(op):
  with pytest.raises(ValueError, match=rf"{op}: w must have rank >= 2, got shape \(16,\)"):
    trace(op, spec((8, 16)), spec((16,)))


def test_matmul_rs_contracted_dims_mismatch():
  """w [*k, N] contracts x's trailing dims: they must match w's leading ones."""
  with pytest.raises(ValueError, match=r"matmul_rs: w's leading dims \(4, 8\) must equal x's trailing dims, "
                                       r"got x of shape \(2, 16, 8, 4\)"):
    trace("matmul_rs", spec((2, 16, 8, 4)), spec((4, 8, 24)))
  with pytest.raises(ValueError, match=r"matmul_rs: x must have rank >= 3 .*got shape \(8, 32\)"):
    trace("matmul_rs", spec((8, 32)), spec((4, 8, 24)))


def test_ag_matmul_bias_of_multi_dim_weight():
  with pytest.raises(ValueError, match=r"ag_matmul: bias must have shape \(4, 8\) to match w's columns, "
                                       r"got \(32,\)"):
    trace("ag_matmul", spec((8, 16)), spec((16, 4, 8)), spec((32,)))


@pytest.mark.parametrize("op", OPS)
def test_contraction_mismatch(op):
  with pytest.raises(ValueError, match=rf"{op}: w's first dim must equal x's last dim \([kK] = 16\), "
                                      rf"got w of shape \(15, 8\)"):
    trace(op, spec((8, 16)), spec((15, 8)))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bias_shape", [(7,), (1, 8), ()], ids=str)
def test_bias_shape(op, bias_shape):
  with pytest.raises(ValueError, match=rf"{op}: bias must have shape \(8,\) to match w's columns, "
                                      rf"got \({', '.join(map(str, bias_shape))},?\)"):
    trace(op, spec((8, 16)), spec((16, 8)), spec(bias_shape))


@pytest.mark.parametrize("op", OPS)
def test_unbound_axis_name(op):
  """axis_name outside shard_map: it names no bound axis."""
  with pytest.raises(ValueError, match=rf"{op}: axis_name 'tp' is not bound here"):
    trace(op, spec((8, 16)), spec((16, 8)), axis_name="tp")


@pytest.mark.parametrize("op", OPS)
def test_unknown_axis_name_inside_shard_map(op, make_mesh):
  mesh = make_mesh((4,), ("tp",))
  f = jax.shard_map(lambda x, w: getattr(jax_overlap, op)(x, w, axis_name="model"), mesh=mesh,
                    in_specs=(P(), P()), out_specs=P())
  with pytest.raises(ValueError, match=rf"{op}: axis_name 'model' is not bound here"):
    jax.eval_shape(f, spec((8, 16)), spec((16, 8)))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("axis_name", [3, ("tp", 4), ()], ids=str)
def test_axis_name_not_a_name(op, axis_name):
  with pytest.raises(TypeError, match=rf"{op}: axis_name must be a mesh axis name or a tuple of them"):
    trace(op, spec((8, 16)), spec((16, 8)), axis_name=axis_name)


def test_matmul_rs_rows_not_divisible(make_mesh):
  mesh = make_mesh((4,), ("tp",))
  f = jax.shard_map(lambda x, w: jax_overlap.matmul_rs(x, w, axis_name="tp"), mesh=mesh,
                    in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None))
  with pytest.raises(ValueError, match=r"matmul_rs: x's rows \(6\) must be divisible by the size of axis "
                                       r"'tp' \(4\)"):
    jax.eval_shape(f, spec((6, 16)), spec((16, 8)))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("algorithm", ["foo", "FUSED", None])
def test_unknown_algorithm(op, algorithm):
  with pytest.raises(ValueError, match=rf"{op}: algorithm must be one of \('auto', 'xla', 'fused', "
                                      rf"'pipelined'\), got {algorithm!r}"):
    trace(op, spec((8, 16)), spec((16, 8)), algorithm=algorithm)


@pytest.mark.parametrize("algorithm", ["fused", "pipelined"])
@pytest.mark.parametrize("mode", ["shard_map", "global"])
@pytest.mark.parametrize("op", OPS)
def test_gpu_algorithm_on_cpu(op, mode, algorithm, make_mesh):
  """The platform is known only at lowering, so a GPU algorithm on CPU fails there: when jit lowers, before running."""
  if mode == "shard_map":
    mesh = make_mesh((4,), ("tp",))
    x_spec, w_spec = (P("tp", None), P(None, "tp")) if op == "ag_matmul" else (P(None, "tp"), P("tp", None))
    f = jax.jit(jax.shard_map(lambda x, w: getattr(jax_overlap, op)(x, w, axis_name="tp", algorithm=algorithm),
                              mesh=mesh, in_specs=(x_spec, w_spec), out_specs=P(None, "tp")))
  else:
    f = jax.jit(lambda x, w: getattr(jax_overlap, op)(x, w, algorithm=algorithm))
  x, w = jnp.asarray(np.random.default_rng(1).standard_normal((8, 16)), jnp.bfloat16), \
      jnp.asarray(np.random.default_rng(2).standard_normal((16, 8)), jnp.bfloat16)
  # With the GPU extension built it fails at lowering for cpu; on a pure-Python install, already at trace time.
  with pytest.raises(ValueError, match=rf"(?s){op}: algorithm='{algorithm}' (runs on GPU|needs the native GPU "
                                      rf"extension).*'auto' or 'xla'"):
    f.lower(x, w)


def test_all_gather_bad_input(make_mesh):
  with pytest.raises(ValueError, match=r"all_gather: x must have rank >= 2, got \(8,\)"):
    jax.eval_shape(lambda x: jax_overlap.all_gather(x, axis_name="tp"), spec((8,)))
  with pytest.raises(ValueError, match=r"all_gather: axis_name 'tp' is not bound here"):
    jax.eval_shape(lambda x: jax_overlap.all_gather(x, axis_name="tp"), spec((8, 4)))


# --- gather_axis, scatter_axis, out_sharding ---------------------------------------

@pytest.mark.parametrize("value", [1.0, "rows", None, True], ids=repr)
def test_gather_axis_not_an_int(value):
  with pytest.raises(TypeError, match=r"ag_matmul: gather_axis must be an int in \[-3, -2\] or \[0, 1\], "
                                      rf"got {re.escape(repr(value))}"):
    trace("ag_matmul", spec((2, 8, 16)), spec((16, 8)), gather_axis=value)


@pytest.mark.parametrize("value", [-1, 2, -4, 3])
def test_gather_axis_out_of_range(value):
  """The last dim is the contraction: it cannot be gathered."""
  with pytest.raises(ValueError, match=r"ag_matmul: gather_axis must be an int in \[-3, -2\] or \[0, 1\] for "
                                       rf"this call's 3-dim x, got {value}"):
    trace("ag_matmul", spec((2, 8, 16)), spec((16, 8)), gather_axis=value)


@pytest.mark.parametrize("value", [-4, 3])
def test_scatter_axis_out_of_range(value):
  with pytest.raises(ValueError, match=r"matmul_rs: scatter_axis must be an int in \[-3, -1\] or \[0, 2\] for "
                                       rf"this call's 3-dim output, got {value}"):
    trace("matmul_rs", spec((2, 8, 16)), spec((16, 8)), scatter_axis=value)


def test_scatter_axis_not_an_int():
  with pytest.raises(TypeError, match=r"matmul_rs: scatter_axis must be an int in \[-2, -1\] or \[0, 1\], got 'N'"):
    trace("matmul_rs", spec((8, 16)), spec((16, 8)), scatter_axis="N")


def test_scatter_dim_not_divisible_in_shard_map(make_mesh):
  mesh = make_mesh((4,), ("tp",))
  f = jax.shard_map(lambda x, w: jax_overlap.matmul_rs(x, w, axis_name="tp", scatter_axis=-1), mesh=mesh,
                    in_specs=(P(None, "tp"), P("tp", None)), out_specs=P(None, "tp"))
  with pytest.raises(ValueError, match=r"matmul_rs: the output's dim -1 \(6\) must be divisible by the size of "
                                       r"axis 'tp' \(4\)"):
    jax.eval_shape(f, spec((8, 16)), spec((16, 6)))


@pytest.mark.parametrize("op", OPS)
def test_out_sharding_wrong_type(op):
  with pytest.raises(TypeError, match=rf"{op}: out_sharding must be a NamedSharding or a PartitionSpec, got tuple"):
    trace(op, spec((8, 16)), spec((16, 8)), out_sharding=("tp", None))


@pytest.mark.parametrize("op", OPS)
def test_out_sharding_too_many_entries(op, make_mesh):
  sharding = NamedSharding(make_mesh((4,), ("tp",)), P(None, "tp", None))
  with pytest.raises(ValueError, match=rf"{op}: out_sharding has 3 entries for a 2-dim output"):
    trace(op, spec((8, 16)), spec((16, 8)), out_sharding=sharding)


@pytest.mark.parametrize("op", OPS)
def test_out_sharding_spec_without_a_mesh(op):
  with pytest.raises(ValueError, match=rf"{op}: out_sharding={re.escape(repr(P('tp', None)))} is a PartitionSpec, "
                                      r"which needs a mesh: pass a NamedSharding, or set one with jax.set_mesh"):
    trace(op, spec((8, 16)), spec((16, 8)), out_sharding=P("tp", None))


@pytest.mark.parametrize("op", OPS)
def test_out_sharding_inside_shard_map(op, make_mesh):
  mesh = make_mesh((4,), ("tp",))
  sharding = NamedSharding(mesh, P("tp", None))
  f = jax.shard_map(lambda x, w: getattr(jax_overlap, op)(x, w, axis_name="tp", out_sharding=sharding), mesh=mesh,
                    in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None))
  with pytest.raises(ValueError, match=rf"{op}: out_sharding applies to global arrays \(axis_name=None\)"):
    jax.eval_shape(f, spec((16, 16)), spec((16, 8)))


# --- the dot_general adapters ------------------------------------------------------------

def test_ag_dot_general_wrong_contraction():
  dot = jax_overlap.AgDotGeneral()
  with pytest.raises(ValueError, match=r"AgDotGeneral: dimension_numbers must contract x's last dim with the "
                                       r"kernel's first with no batch dims, i\.e\. \(\(\(1,\), \(0,\)\), "
                                       r"\(\(\), \(\)\)\) for x of shape \(8, 16\) and kernel of shape "
                                       r"\(8, 16\), got \(\(\(0,\), \(0,\)\), \(\(\), \(\)\)\)"):
    jax.eval_shape(lambda x, w: dot(x, w, (((0,), (0,)), ((), ()))), spec((8, 16)), spec((8, 16)))


def test_rs_dot_general_batch_dims():
  dot = jax_overlap.RsDotGeneral()
  with pytest.raises(ValueError, match=r"RsDotGeneral: dimension_numbers must contract x's last 2 dims with the "
                                       r"kernel's first 2 with no batch dims, i\.e\. \(\(\(1, 2\), \(0, 1\)\), "
                                       r"\(\(\), \(\)\)\) .*got \(\(\(2,\), \(1,\)\), \(\(0,\), \(0,\)\)\)"):
    jax.eval_shape(lambda x, w: dot(x, w, (((2,), (1,)), ((0,), (0,)))), spec((2, 8, 16)), spec((2, 16, 8)))


@pytest.mark.parametrize("cls", ["AgDotGeneral", "RsDotGeneral"])
def test_dot_general_preferred_element_type(cls):
  dot = getattr(jax_overlap, cls)()
  with pytest.raises(ValueError, match=rf"{cls}: preferred_element_type must be None or the inputs' dtype "
                                      r"bfloat16, got float32"):
    jax.eval_shape(lambda x, w: dot(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32),
                   spec((8, 16), jnp.bfloat16), spec((16, 8), jnp.bfloat16))


def test_dot_general_options_reach_the_op():
  with pytest.raises(ValueError, match=r"ag_matmul: gather_axis must be an int in \[-2, -2\]"):
    jax.eval_shape(lambda x, w: jax_overlap.AgDotGeneral(gather_axis=-1)(x, w, (((1,), (0,)), ((), ()))),
                   spec((8, 16)), spec((16, 8)))


# --- transformations the custom VJPs cannot take (issue 24, item 10) --------------------------------------

def _sharded_call(op, mode, make_mesh, algorithm="auto"):
  """(f, x, w): op inside shard_map or on global arrays sharded for its fused layout, over 4 devices."""
  mesh = make_mesh((4,), ("tp",))
  x_spec, w_spec = (P("tp", None), P(None, "tp")) if op == "ag_matmul" else (P(None, "tp"), P("tp", None))
  rng = np.random.default_rng(0)
  x = jax.device_put(rng.standard_normal((8, 16)).astype(np.float32), NamedSharding(mesh, x_spec))
  w = jax.device_put(rng.standard_normal((16, 8)).astype(np.float32), NamedSharding(mesh, w_spec))
  if mode == "shard_map":
    out_spec = P(None, "tp") if op == "ag_matmul" else P("tp", None)
    f = jax.shard_map(lambda x, w: getattr(jax_overlap, op)(x, w, axis_name="tp", algorithm=algorithm), mesh=mesh,
                      in_specs=(x_spec, w_spec), out_specs=out_spec)
    return f, x, w
  return lambda x, w: getattr(jax_overlap, op)(x, w, algorithm=algorithm), x, w


FORWARD_MODE = {
    "jit_jvp": lambda f, x, w: jax.jit(lambda x, w: jax.jvp(f, (x, w), (x, w)))(x, w),
    "eager_jvp": lambda f, x, w: jax.jvp(f, (x, w), (x, w)),
    "jacfwd": lambda f, x, w: jax.jit(jax.jacfwd(lambda x: jnp.sum(f(x, w))))(x),
}
SECOND_ORDER = {
    "hessian": lambda f, x, w: jax.jit(jax.hessian(lambda x: jnp.sum(jnp.sin(f(x, w)))))(x),
    "grad_of_grad": lambda f, x, w: jax.jit(jax.grad(
        lambda x: jnp.sum(jax.grad(lambda x: jnp.sum(jnp.sin(f(x, w))))(x) ** 2)))(x),
}


@pytest.mark.parametrize("how", FORWARD_MODE)
@pytest.mark.parametrize("mode", ["shard_map", "global"])
@pytest.mark.parametrize("op", OPS)
def test_forward_mode_says_what_to_use(op, mode, how, make_mesh):
  """JAX said "can't apply forward-mode autodiff (jvp) to a custom_vjp function" (or, jvp of an eager shard_map,
  "unhashable type: 'Unhashable'")."""
  f, x, w = _sharded_call(op, mode, make_mesh)
  with pytest.raises(TypeError, match=rf"jax_overlap\.{op}: forward-mode differentiation \(jax\.jvp, jax\.jacfwd\) "
                                      rf"is not supported with algorithm='auto'.*pass algorithm='xla'"):
    FORWARD_MODE[how](f, x, w)


@pytest.mark.parametrize("how", SECOND_ORDER)
@pytest.mark.parametrize("mode", ["shard_map", "global"])
@pytest.mark.parametrize("op", OPS)
def test_second_derivatives_say_what_to_use(op, mode, how, make_mesh):
  """JAX said "Differentiation rule for 'jax_overlap_ag_matmul' (or 'custom_partitioning') not implemented"."""
  f, x, w = _sharded_call(op, mode, make_mesh)
  with pytest.raises(NotImplementedError, match=rf"jax_overlap\.{op}: a second derivative \(jax\.hessian, jax\.grad "
                                                rf"of jax\.grad\).*not supported with algorithm='auto'.*"
                                                rf"pass algorithm='xla'"):
    SECOND_ORDER[how](f, x, w)


@pytest.mark.parametrize("how", [*FORWARD_MODE, *SECOND_ORDER])
@pytest.mark.parametrize("mode", ["shard_map", "global"])
@pytest.mark.parametrize("op", OPS)
def test_xla_algorithm_takes_those_transformations(op, mode, how, make_mesh):
  """What the errors above advise works: forward mode and second derivatives of algorithm='xla', against the same
  transformations of jnp's product (float32, one device)."""
  f, x, w = _sharded_call(op, mode, make_mesh, algorithm="xla")
  plain = lambda x, w: jnp.dot(x, w, precision="highest")
  got, want = (FORWARD_MODE | SECOND_ORDER)[how](f, x, w), (FORWARD_MODE | SECOND_ORDER)[how](plain, np.asarray(x),
                                                                                             np.asarray(w))
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-5, atol=2e-4)


@pytest.mark.parametrize("op", OPS)
def test_export_of_a_global_call_says_what_to_use(op, make_mesh):
  """JAX said "serialization of host_callbacks is not yet implemented", after lowering, naming nothing of ours."""
  f, x, w = _sharded_call(op, "global", make_mesh)
  with pytest.raises(NotImplementedError, match=rf"jax_overlap\.{op}: jax\.export cannot serialize a call on global "
                                                rf"arrays over several devices with algorithm='auto'.*"
                                                rf"pass algorithm='xla'"):
    jax.export.export(jax.jit(f))(x, w)


@pytest.mark.parametrize("mode", ["shard_map", "global"])
@pytest.mark.parametrize("op", OPS)
def test_export_of_the_xla_algorithm(op, mode, make_mesh):
  """algorithm='xla' exports in either mode, and the exported call computes what the call does."""
  f, x, w = _sharded_call(op, mode, make_mesh, algorithm="xla")
  exported = jax.export.export(jax.jit(f))(x, w)
  assert exported.mlir_module_serialized
  np.testing.assert_array_equal(np.asarray(exported.call(x, w)), np.asarray(jax.jit(f)(x, w)))


def test_unbound_axis_name_lists_the_bound_axes(make_mesh):
  mesh = make_mesh((2, 4), ("dp", "tp"))
  f = jax.shard_map(lambda x, w: jax_overlap.ag_matmul(x, w, axis_name="model"), mesh=mesh, in_specs=(P(), P()),
                    out_specs=P(), axis_names={"tp"})
  with pytest.raises(ValueError, match=r"ag_matmul: axis_name 'model' is not bound here \(the axes bound here are "
                                       r"\('tp',\)\)"):
    jax.eval_shape(f, spec((8, 16)), spec((16, 8)))
  with pytest.raises(ValueError, match=r"matmul_rs: axis_name 'tp' is not bound here \(no axis is bound here\)"):
    trace("matmul_rs", spec((8, 16)), spec((16, 8)), axis_name="tp")


# --- an out_sharding the call cannot produce (issue 25) -------------------------------------------------------

@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("op", OPS)
def test_out_sharding_that_splits_a_dim_unevenly(op, axis_type, make_mesh):
  """Rows (6) not divisible by 'tp' (4): the plan used to drop the request with a DEBUG line (Auto mesh: the
  result came back replicated) or JAX refused the reshard without naming the call (Explicit)."""
  mesh = make_mesh((4,), ("tp",), getattr(jax.sharding.AxisType, axis_type))
  sharding = NamedSharding(mesh, P("tp", None))
  with pytest.raises(ValueError, match=rf"jax_overlap\.{op}: out_sharding={re.escape(str(P('tp', None)))} splits the "
                                       rf"output's dim 0 \(6\) over \('tp',\) \(4 parts\), which does not divide it"):
    trace(op, spec((6, 16)), spec((16, 8)), out_sharding=sharding)


def test_out_sharding_names_an_axis_the_mesh_lacks(make_mesh):
  sharding = NamedSharding(make_mesh((4,), ("tp",)), P(None, "tp"))
  with jax.set_mesh(make_mesh((4,), ("model",))):
    with pytest.raises(ValueError, match=rf"matmul_rs: out_sharding={re.escape(str(P(None, 'tp')))} names \['tp'\], "
                                         r"which the mesh \('model',\) does not have"):
      trace("matmul_rs", spec((8, 16)), spec((16, 8)), out_sharding=P(None, "tp"))
  trace("matmul_rs", spec((8, 16)), spec((16, 8)), out_sharding=sharding)


# --- float8 operands ---------------------------------------------------------------

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
SCALE = spec((), jnp.float32)


def fp8_trace(op, x_dtype=E4M3, w_dtype=E4M3, bias=None, **kwargs):
  args = [spec((8, 16), x_dtype), spec((16, 8), w_dtype)] + ([bias] if bias is not None else [])
  return jax.eval_shape(lambda *a: getattr(jax_overlap, op)(*a, **kwargs), *args)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("missing", ["x_scale", "w_scale"])
def test_fp8_missing_scale(op, missing):
  kwargs = {"x_scale": 1.0, "w_scale": 1.0}
  del kwargs[missing]
  operand = missing[0]
  with pytest.raises(TypeError, match=rf"{op}: {missing} is required with float8 operands \({operand} is "
                                      rf"float8_e4m3fn\): a float32 scalar, .*got None"):
    fp8_trace(op, **kwargs)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", [(4,), (2, 1)], ids=str)
def test_fp8_scale_shape(op, shape):
  """Scales are one float32 scalar per operand (each rank's own inside shard_map; any size-1 shape), or block scales
  for both: one of each is refused, saying what either form takes."""
  with pytest.raises(ValueError, match=rf"{op}: x_scale and w_scale must both be float32 scalars \(shape \(\), or "
                                       rf"any shape of size 1\), or both block scales \(x_scale .*\); got x_scale "
                                       rf"of shape None, w_scale of shape {re.escape(str(shape))}"):
    jax.eval_shape(lambda s: fp8_trace(op, x_scale=1.0, w_scale=s), spec(shape, jnp.float32))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float64, jnp.int32], ids=lambda d: np.dtype(d).name)
def test_fp8_scale_dtype(op, dtype):
  with pytest.raises(TypeError, match=rf"{op}: x_scale must be a float32 scalar, got dtype {np.dtype(dtype).name}"):
    fp8_trace(op, x_scale=np.zeros((), dtype), w_scale=1.0)


@pytest.mark.parametrize("op", OPS)
def test_fp8_scale_not_an_array(op):
  with pytest.raises(TypeError, match=rf"{op}: x_scale must be a float32 scalar, got str"):
    fp8_trace(op, x_scale="1", w_scale=1.0)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", ["x_scale", "w_scale"])
def test_scale_of_16_bit_operands(op, name):
  with pytest.raises(TypeError, match=rf"{op}: {name} applies to float8 operands only, got {name} with x and w of "
                                      rf"dtype bfloat16"):
    fp8_trace(op, jnp.bfloat16, jnp.bfloat16, **{name: 1.0})


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("x_dtype,w_dtype", [(E4M3, jnp.bfloat16), (jnp.float16, E5M2)], ids=["x", "w"])
def test_fp8_mixed_with_16_bit(op, x_dtype, w_dtype):
  with pytest.raises(TypeError, match=rf"{op}: x and w must both be float8 or neither .*got x "
                                      rf"{np.dtype(x_dtype).name}, w {np.dtype(w_dtype).name}"):
    fp8_trace(op, x_dtype, w_dtype, x_scale=1.0, w_scale=1.0)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("x_dtype,w_dtype", [(E5M2, E5M2), (jnp.float8_e5m2fnuz, jnp.float8_e5m2fnuz)],
                         ids=["ocp", "fnuz"])
def test_fp8_both_e5m2(op, x_dtype, w_dtype):
  with pytest.raises(TypeError, match=rf"{op}: x and w cannot both be e5m2 .*got x {np.dtype(x_dtype).name}"):
    fp8_trace(op, x_dtype, w_dtype, x_scale=1.0, w_scale=1.0)


@pytest.mark.parametrize("op", OPS)
def test_fp8_families_mixed(op):
  with pytest.raises(TypeError, match=rf"{op}: x and w must be float8 formats of one family, OCP .* or fnuz .*got "
                                      rf"x float8_e4m3fn, w float8_e5m2fnuz"):
    fp8_trace(op, E4M3, jnp.float8_e5m2fnuz, x_scale=1.0, w_scale=1.0)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("out_dtype", [jnp.float64, jnp.int8, E4M3], ids=lambda d: np.dtype(d).name)
def test_fp8_out_dtype(op, out_dtype):
  with pytest.raises(TypeError, match=rf"{op}: out_dtype must be one of \('bfloat16', 'float16', 'float32'\) .*"
                                      rf"got {np.dtype(out_dtype).name}"):
    fp8_trace(op, x_scale=1.0, w_scale=1.0, out_dtype=out_dtype)


@pytest.mark.parametrize("op", OPS)
def test_out_dtype_not_a_dtype(op):
  with pytest.raises(TypeError, match=rf"{op}: out_dtype must be a dtype or None, got 'bf16'"):
    fp8_trace(op, x_scale=1.0, w_scale=1.0, out_dtype="bf16")


@pytest.mark.parametrize("op", OPS)
def test_out_dtype_of_16_bit_operands(op):
  """Without float8 operands the result is in x's dtype: out_dtype may only say so."""
  fp8_trace(op, jnp.bfloat16, jnp.bfloat16, out_dtype=jnp.bfloat16)
  with pytest.raises(TypeError, match=rf"{op}: out_dtype must be None or x's dtype bfloat16 for bfloat16 operands "
                                      rf".*got float32"):
    fp8_trace(op, jnp.bfloat16, jnp.bfloat16, out_dtype=jnp.float32)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bias_dtype", [jnp.bfloat16, E4M3], ids=lambda d: np.dtype(d).name)
def test_fp8_bias_dtype(op, bias_dtype):
  """The bias is in out_dtype or float32 (here out_dtype float16)."""
  fp8_trace(op, bias=spec((8,), jnp.float32), x_scale=1.0, w_scale=1.0, out_dtype=jnp.float16)
  with pytest.raises(TypeError, match=rf"{op}: bias must have out_dtype float16 or float32 with float8 operands, "
                                      rf"got {np.dtype(bias_dtype).name}"):
    fp8_trace(op, bias=spec((8,), bias_dtype), x_scale=1.0, w_scale=1.0, out_dtype=jnp.float16)


@pytest.mark.parametrize("op", OPS)
def test_w_kmajor_not_a_bool(op):
  with pytest.raises(TypeError, match=rf"{op}: w_kmajor must be a bool, got 'yes'"):
    trace(op, spec((8, 16)), spec((16, 8)), w_kmajor="yes")


@pytest.mark.parametrize("op", OPS)
def test_w_kmajor_shapes(op):
  """w_kmajor=True: w's contraction is its last dim."""
  with pytest.raises(ValueError, match=rf"{op}: w's last dim must equal x's last dim \([kK] = 16, w_kmajor=True\), "
                                       rf"got w of shape \(16, 8\)"):
    trace(op, spec((8, 16)), spec((16, 8)), w_kmajor=True)


# --- mistakes caught where they are made -------------------------------------------------------------------------

LAYERS = ["AgDotGeneral", "RsDotGeneral", "Fp8AgDotGeneral", "Fp8RsDotGeneral"]


@pytest.mark.parametrize("layer", LAYERS)
def test_layer_fields_are_checked_at_construction(layer):
  cls = getattr(jax_overlap, layer)
  allowed = r"\('auto', 'xla', 'pipelined'\)" if layer.startswith("Fp8") else r"\('auto', 'xla', 'fused', 'pipelined'\)"
  with pytest.raises(ValueError, match=rf"^jax_overlap\.{layer}: algorithm must be one of {allowed}, got 'fast'$"):
    cls(algorithm="fast")
  with pytest.raises(TypeError, match=rf"^jax_overlap\.{layer}: axis_name must be None .* got 3$"):
    cls(axis_name=3)
  dim = "gather_axis" if "Ag" in layer else "scatter_axis"
  with pytest.raises(TypeError, match=rf"^jax_overlap\.{layer}: {dim} must be an int.*, got 'rows'$"):
    cls(**{dim: "rows"})


@pytest.mark.parametrize("layer", ["Fp8AgDotGeneral", "Fp8RsDotGeneral"])
def test_fp8_layer_family_and_scaling_are_checked_at_construction(layer):
  cls = getattr(jax_overlap, layer)
  with pytest.raises(ValueError, match=rf"^jax_overlap\.{layer}: family must be None \(the GPU's\), 'ocp' or "
                                       r"'fnuz', got 'ocp2'$"):
    cls(family="ocp2")
  with pytest.raises(ValueError, match=rf"^jax_overlap\.{layer}: scaling must be one of \('tensor', 'block'\), "
                                       r"got 'rowwise'$"):
    cls(scaling="rowwise")


@pytest.mark.parametrize("layer", LAYERS)
def test_the_class_passed_for_an_instance_says_to_instantiate_it(layer):
  """A layer library given the class as dot_general calls it with the dot's operands."""
  cls = getattr(jax_overlap, layer)
  x, w = jnp.ones((4, 8)), jnp.ones((8, 4))
  with pytest.raises(TypeError, match=rf"jax_overlap\.{layer} is a class and was called as a dot_general: pass an "
                                      rf"instance, dot_general=jax_overlap\.{layer}\(\)"):
    cls(x, w, (((1,), (0,)), ((), ())), precision=None)
  flax_linen = pytest.importorskip("flax.linen", reason="flax is not installed (pip install flax)")
  with pytest.raises(TypeError, match=rf"pass an instance, dot_general=jax_overlap\.{layer}\(\)"):
    flax_linen.Dense(4, dot_general=cls).init(jax.random.key(0), x)
  assert cls() == cls() and hash(cls()) == hash(cls())  # an instance: frozen, hashable


@pytest.mark.parametrize("op", OPS)
def test_shape_errors_inside_shard_map_say_the_shapes_are_local(op, make_mesh):
  mesh = make_mesh((4,), ("tp",))
  f = jax.shard_map(lambda x, w: getattr(jax_overlap, op)(x, w, axis_name="tp"), mesh=mesh,
                    in_specs=(P("tp"), P(None, "tp")), out_specs=P("tp"))
  with pytest.raises(ValueError, match=r"w's first dim must equal x's last dim \(.*\), got w of shape \(6, 2\) "
                                       r"\(inside jax\.shard_map the shapes are each rank's local blocks"):
    jax.eval_shape(f, spec((16, 8)), spec((6, 8)))


@pytest.mark.parametrize("name,value,expected", [
    ("JAX_OVERLAP_ON_TIMEOUT", "explode", "expected one of abort, raise"),
    ("JAX_OVERLAP_WATCHDOG_SECONDS", "-5", "expected a positive number of seconds"),
    ("JAX_OVERLAP_WORKSPACE_BYTES", "lots", "is not a number"),
    ("JAX_OVERLAP_DISABLE", "maybe", "is not a switch"),
    ("JAX_OVERLAP_PIPELINE_STAGES", "1,x", "expected stage sizes"),
    ("JAX_OVERLAP_GEMM_SM_MARGIN", "-2", "expected a whole number of SMs"),
    ("JAX_OVERLAP_ARCH_TRAITS", "gfx", "expected one of nvidia, amd"),
])
def test_a_bad_setting_is_an_error_on_every_backend(monkeypatch, name, value, expected):
  from jax_overlap.runtime import settings
  monkeypatch.setenv(name, value)
  with pytest.raises(ValueError, match=rf"^jax_overlap: {name}={value!r}.*{expected}"):
    settings.check_all()


@pytest.mark.parametrize("name,value,expected", [
    ("JAX_OVERLAP_MAXTEXT_ALGORITHM", "fastest", "expected one of auto, xla, fused, pipelined"),
    ("JAX_OVERLAP_MAXTEXT_FP8", "delayed", "expected one of tensor, block"),
    ("JAX_OVERLAP_MAXTEXT_FP8_CAST", "kernel", "expected one of auto, kernels, xla"),
])
def test_a_bad_maxtext_setting_is_an_error_where_the_integration_reads_it(monkeypatch, name, value, expected):
  from jax_overlap.maxtext import settings
  monkeypatch.setenv(name, value)
  with pytest.raises(ValueError, match=rf"^jax_overlap: {name}={value!r}.*{expected}"):
    settings.check_all()


def test_a_misspelled_setting_is_a_warning_that_names_the_setting(monkeypatch):
  from jax_overlap.runtime import settings
  monkeypatch.setenv("JAX_OVERLAP_DISABLED", "1")
  monkeypatch.setenv("JAX_OVERLAP_MAXTEXT_FP", "tensor")
  monkeypatch.setenv("JAX_OVERLAP_PLATFORM", "none")  # the build's: no warning
  with pytest.warns(UserWarning) as caught:
    settings.check_all()
  assert [str(w.message) for w in caught] == [
      f"jax_overlap: the environment variable {typo} is no setting of jax_overlap and is ignored; did you mean "
      f"{meant}?" for typo, meant in (("JAX_OVERLAP_DISABLED", "JAX_OVERLAP_DISABLE"),
                                      ("JAX_OVERLAP_MAXTEXT_FP", "JAX_OVERLAP_MAXTEXT_FP8"))]


def test_every_variable_the_package_reads_is_a_known_name():
  """runtime/settings.NAMES is the one list of names (the misspelling warning's): every JAX_OVERLAP_* the sources
  name is in it."""
  import pathlib
  import re
  from jax_overlap.runtime import settings
  root = pathlib.Path(__file__).resolve().parents[1]  # the repository's sources, whichever copy of the package runs
  sources = [*root.glob("jax_overlap/**/*.py"), *root.glob("tools/*.py"), *root.glob("csrc/**/*.c[cu]"),
             *root.glob("csrc/**/*.h"), root / "pyproject.toml"]
  named = {m for path in sources for m in re.findall(r'"(JAX_OVERLAP_[A-Z0-9_]+)"', path.read_text())}
  assert named and named <= settings.NAMES, sorted(named - settings.NAMES)


def test_a_bad_setting_fails_the_import():
  """The settings are checked when jax_overlap is imported, on CPU too: JAX_OVERLAP_ON_TIMEOUT=explode is not
  ignored until a GPU call."""
  import os
  import subprocess
  import sys
  env = {**os.environ, "JAX_OVERLAP_ON_TIMEOUT": "explode"}
  done = subprocess.run([sys.executable, "-P", "-c", "import jax_overlap"], env=env, capture_output=True, text=True)
  assert done.returncode != 0
  assert "ValueError: jax_overlap: JAX_OVERLAP_ON_TIMEOUT='explode'; expected one of abort, raise" in done.stderr


def test_a_misspelled_setting_is_said_once_at_import():
  import os
  import subprocess
  import sys
  env = {**os.environ, "JAX_OVERLAP_DISABLED": "1"}
  done = subprocess.run([sys.executable, "-P", "-c", "import jax_overlap, jax_overlap.runtime.settings"], env=env,
                        capture_output=True, text=True)
  assert done.returncode == 0, done.stderr
  assert done.stderr.count("JAX_OVERLAP_DISABLED is no setting of jax_overlap and is ignored; did you mean "
                           "JAX_OVERLAP_DISABLE?") == 1, done.stderr
