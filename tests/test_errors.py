"""Bad input fails at trace time with a TypeError/ValueError that names the argument and what was expected.

jax.eval_shape traces without lowering or running, so an error raised under it
is a trace-time error.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap

OPS = ["ag_matmul", "matmul_rs"]


def spec(shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


def trace(op, *args, **kwargs):
  return jax.eval_shape(lambda *a: getattr(jax_overlap, op)(*a, **kwargs), *args)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float64, jnp.int8], ids=lambda d: np.dtype(d).name)
def test_unsupported_dtype(op, dtype):
  with jax.enable_x64(dtype == jnp.float64):
    with pytest.raises(TypeError, match=rf"jax_overlap\.{op}: x must have dtype bfloat16, float16 or float32, "
                                        rf"got {np.dtype(dtype).name}"):
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
def test_w_rank_3(op):
  with pytest.raises(ValueError, match=rf"{op}: w must have rank 2 .*got shape \(2, 16, 8\)"):
    trace(op, spec((8, 16)), spec((2, 16, 8)))


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
