"""A two-layer tensor-parallel MLP (ag_matmul -> gelu -> matmul_rs), forward and backward under jit,
against the same MLP in plain jnp on one device.

Layout (sequence parallel between the layers, as in Megatron-style TP):
  x  [B, S, H]  rows (S) sharded on 'tp'
  w1 [H, F]     columns sharded;  b1 [F] sharded
  w2 [F, H]     rows sharded;     b2 [H] replicated
  out [B, S, H] rows sharded again
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap
from test_global import reduce_scatter
from tolerance import rms

TP = 4
B, S, H, F = 2, 16, 32, 64
SPECS = (P(None, "tp", None), P(None, "tp"), P("tp"), P("tp", None), P())
OUT_SPEC = P(None, "tp", None)


def mlp_tp(x, w1, b1, w2, b2, axis_name=None):
  h = jax.nn.gelu(jax_overlap.ag_matmul(x, w1, b1, axis_name=axis_name))
  return jax_overlap.matmul_rs(h, w2, b2, axis_name=axis_name)


def mlp_reference(x, w1, b1, w2, b2):
  return jax.nn.gelu(x @ w1 + b1) @ w2 + b2


def _params(rng, dtype):
  """x unit normal, weights scaled by 1/sqrt(fan_in): every activation and gradient is of order 1."""
  draw = lambda shape, scale=1.0: (rng.standard_normal(shape) * scale).astype(np.dtype(dtype))
  return (draw((B, S, H)), draw((H, F), 1 / math.sqrt(H)), draw((F,)), draw((F, H), 1 / math.sqrt(F)),
          draw((H,)))


def _reference_grads(params, ct):
  """Loss and gradients of the plain MLP in float32 on one device, from the same (rounded) inputs."""
  params32 = [jnp.asarray(p, jnp.float32) for p in params]
  loss = lambda *p: jnp.sum(mlp_reference(*p) * ct)
  with jax.default_device(jax.devices()[0]):
    out = jax.jit(mlp_reference)(*params32)
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(5))))(*params32)
  return out, grads


def _check(got_out, got_grads, params, ct, dtype, assert_close):
  want_out, want_grads = _reference_grads(params, ct)
  names = ("out", "dx", "dw1", "db1", "dw2", "db2")
  for name, got, want, like in zip(names, (got_out, *got_grads), (want_out, *want_grads), (None, *params)):
    if like is not None:
      assert got.shape == like.shape and got.dtype == like.dtype, name
    want = np.asarray(want, np.float64)
    # Order-1 values, so the tolerance's scale is the expected RMS (see tolerance.tolerances), times the
    # three rounded stages on every path (matmul, gelu, matmul) whose errors add up.
    assert_close(got, want, dtype, 1, scale=3 * rms(want), what=name)


DTYPES = [jnp.bfloat16, jnp.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_mlp_shard_map(dtype, rng, make_mesh, assert_close):
  mesh = make_mesh((TP,), ("tp",))
  params, ct = _params(rng, dtype), rng.standard_normal((B, S, H)).astype(np.float32)
  fwd = jax.shard_map(lambda *p: mlp_tp(*p, axis_name="tp"), mesh=mesh, in_specs=SPECS, out_specs=OUT_SPEC)
  loss = lambda *p: jnp.sum(fwd(*p).astype(jnp.float32) * ct)
  out = jax.jit(fwd)(*params)
  grads = jax.jit(jax.grad(loss, argnums=tuple(range(5))))(*params)
  _check(out, grads, params, ct, dtype, assert_close)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_mlp_jit_global(dtype, rng, make_mesh, assert_close, compiled_collectives):
  mesh = make_mesh((TP,), ("tp",))
  shardings = tuple(NamedSharding(mesh, s) for s in SPECS)
  params = [jax.device_put(p, s) for p, s in zip(_params(rng, dtype), shardings)]
  ct = jax.device_put(rng.standard_normal((B, S, H)).astype(np.float32), NamedSharding(mesh, OUT_SPEC))
  fwd = jax.jit(mlp_tp, out_shardings=NamedSharding(mesh, OUT_SPEC))
  loss = lambda *p: jnp.sum(mlp_tp(*p[:5]).astype(jnp.float32) * p[5])
  grad = jax.jit(jax.grad(loss, argnums=tuple(range(5))), out_shardings=shardings)
  out, grads = fwd(*params), grad(*params, ct)
  assert out.sharding.spec == OUT_SPEC
  _check(out, grads, [np.asarray(p) for p in params], np.asarray(ct), dtype, assert_close)
  # Forward: one all-gather of x, one reduce-scatter. Gradients: the forward's all-gather of x (its result
  # feeds dw1), the all-gather of d(out) in matmul_rs's VJP, the reduce-scatter of dx in ag_matmul's VJP,
  # and an all-reduce for db2 (d(out) is row-sharded, b2 replicated). The loss is linear in the output,
  # so the forward's reduce-scatter is dead there.
  assert sorted(compiled_collectives(fwd, *params)) == [("all-gather", (B, S, H)), reduce_scatter(B, S // TP, H)]
  assert sorted(compiled_collectives(grad, *params, ct)) == [
      ("all-gather", (B, S, H)), ("all-gather", (B, S, H)), ("all-reduce", (H,)), reduce_scatter(B, S // TP, H)]
