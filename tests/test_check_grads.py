"""Gradients checked the way JAX's own tests check them: jax.test_util.check_grads against finite differences.

The custom VJPs (algorithm="auto", which on CPU lowers to the XLA path) in reverse mode, first order, in
float32 and float64; algorithm="xla", plain JAX ops, in both modes to second order. Both ops, inside shard_map
and on global arrays, and the dot_general layers. The ops are bilinear, so central differences are exact up to
rounding at any step: a step of 0.5 keeps float32's rounding out of the comparison.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from jax.test_util import check_grads

import jax_overlap

WORLD = 4
DTYPES = [jnp.float32, jnp.float64]
# x [..., m, K] @ w [K, n] + bias [n]: the op's operand specs and its output spec, inside shard_map.
LAYOUTS = {
    "ag_matmul": ((2, WORLD * 3, 8), (8, WORLD * 2), (P(None, "tp", None), P(None, "tp"), P("tp")),
                  P(None, None, "tp")),
    "matmul_rs": ((2, WORLD * 3, WORLD * 2), (WORLD * 2, 5), (P(None, None, "tp"), P("tp", None), P()),
                  P(None, "tp", None)),
}


def _name(d):
  return np.dtype(d).name


@contextlib.contextmanager
def x64(enabled: bool = True):
  """jax_enable_x64 for the process while the block runs, not jax.enable_x64's scope: a global-array call is
  partitioned while XLA compiles it, on a thread that does not see a scoped setting."""
  previous = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", enabled)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", previous)


def _operands(op, dtype, normal):
  x_shape, w_shape, _, _ = LAYOUTS[op]
  return normal(x_shape, dtype), normal(w_shape, dtype), normal(w_shape[-1:], dtype)


def _function(op, mode, mesh, call):
  """call(x, w, bias, axis_name) as a function of global arrays, in shard_map or on arrays sharded the same way."""
  _, _, specs, out_spec = LAYOUTS[op]
  if mode == "shard_map":
    return jax.jit(jax.shard_map(lambda x, w, b: call(x, w, b, "tp"), mesh=mesh, in_specs=specs,
                                 out_specs=out_spec))
  shardings = tuple(NamedSharding(mesh, s) for s in specs)
  return jax.jit(lambda x, w, b: call(x, w, b, None), in_shardings=shardings)


def _op(op, algorithm):
  return lambda x, w, b, axis_name: getattr(jax_overlap, op)(x, w, b, axis_name=axis_name, algorithm=algorithm)


def _layer(op):
  """The dot_general layer of op, with the bias added after it as the Flax layers do."""
  cls = jax_overlap.AgDotGeneral if op == "ag_matmul" else jax_overlap.RsDotGeneral

  def call(x, w, b, axis_name):
    return cls(axis_name=axis_name)(x, w, (((x.ndim - 1,), (0,)), ((), ()))) + b
  return call


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("mode", ["shard_map", "global"])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_custom_vjp(op, mode, dtype, normal, make_mesh):
  with x64(dtype == jnp.float64):
    f = _function(op, mode, make_mesh((WORLD,), ("tp",)), _op(op, "auto"))
    check_grads(f, _operands(op, dtype, normal), order=1, modes=["rev"], eps=0.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("mode", ["shard_map", "global"])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_layers(op, mode, dtype, normal, make_mesh):
  with x64(dtype == jnp.float64):
    f = _function(op, mode, make_mesh((WORLD,), ("tp",)), _layer(op))
    check_grads(f, _operands(op, dtype, normal), order=1, modes=["rev"], eps=0.5)


@pytest.mark.parametrize("mode", ["shard_map", "global"])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_xla_algorithm_takes_every_derivative(op, mode, normal, make_mesh):
  """algorithm="xla" is plain JAX ops: forward and reverse mode, second order, on a nonlinear loss."""
  with x64():
    f = _function(op, mode, make_mesh((WORLD,), ("tp",)), _op(op, "xla"))
    check_grads(lambda *a: jnp.sin(f(*a)), _operands(op, jnp.float64, normal), order=2, modes=["fwd", "rev"])
