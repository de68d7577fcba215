"""Inside shard_map: weights with several output or contracted dims, the gather and scatter axes, and the
XLA path's rounding, against float64 NumPy on the same inputs (values and gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_overlap

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]
WORLD = 4


def _name(d):
  return np.dtype(d).name


def _f64(*arrays):
  return tuple(np.asarray(a, np.float64) for a in arrays)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_ag_matmul_heads_kernel(dtype, normal, make_mesh, assert_close):
  """w [E, heads, head_dim] with the heads sharded: y [B, S, heads, head_dim], bias [heads, head_dim]."""
  mesh = make_mesh((WORLD,), ("tp",))
  x, w, bias = normal((2, WORLD * 3, 16), dtype), normal((16, WORLD, 5), dtype), normal((WORLD, 5), dtype)
  f = jax.jit(jax.shard_map(lambda x, w, b: jax_overlap.ag_matmul(x, w, b, axis_name="tp"), mesh=mesh,
                            in_specs=(P(None, "tp", None), P(None, "tp", None), P("tp", None)),
                            out_specs=P(None, None, "tp", None)))
  y = f(x, w, bias)
  assert y.dtype == dtype and y.shape == (2, WORLD * 3, WORLD, 5)
  x64, w64, b64 = _f64(x, w, bias)
  assert_close(y, np.einsum("bse,ehd->bshd", x64, w64) + b64, dtype, 16)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_matmul_rs_heads_kernel(dtype, normal, make_mesh, assert_close):
  """w [heads, head_dim, E] contracts x's last two dims [B, S, heads, head_dim]."""
  mesh = make_mesh((WORLD,), ("tp",))
  x, w, bias = normal((2, WORLD * 2, WORLD, 6), dtype), normal((WORLD, 6, 16), dtype), normal((16,), dtype)
  f = jax.jit(jax.shard_map(lambda x, w, b: jax_overlap.matmul_rs(x, w, b, axis_name="tp"), mesh=mesh,
                            in_specs=(P(None, None, "tp", None), P("tp", None, None), P()),
                            out_specs=P(None, "tp", None)))
  z = f(x, w, bias)
  assert z.dtype == dtype and z.shape == (2, WORLD * 2, 16)
  x64, w64, b64 = _f64(x, w, bias)
  assert_close(z, np.einsum("bshd,hde->bse", x64, w64) + b64, dtype, WORLD * 6)


def _gated_mlp(ag, rs):
  def mlp(x, w_in, b_in, w_out):
    g = ag(x, w_in, b_in)  # [B, S, 2, F]
    return rs(jax.nn.silu(g[..., 0, :]) * g[..., 1, :], w_out)
  return mlp


def test_gated_mlp_grads(normal, make_mesh, assert_close):
  """w_in [E, 2, F] sharded on F, w_out [F, E]: values and gradients against JAX's own on one device."""
  mesh = make_mesh((WORLD,), ("tp",))
  x, w_in = normal((2, WORLD * 2, 16), np.float32), normal((16, 2, WORLD * 4), np.float32) * 0.25
  b_in, w_out = normal((2, WORLD * 4), np.float32), normal((WORLD * 4, 16), np.float32) * 0.25
  specs = (P(None, "tp", None), P(None, None, "tp"), P(None, "tp"), P("tp", None))
  ours = jax.shard_map(_gated_mlp(lambda x, w, b: jax_overlap.ag_matmul(x, w, b, axis_name="tp"),
                                  lambda h, w: jax_overlap.matmul_rs(h, w, axis_name="tp")),
                       mesh=mesh, in_specs=specs, out_specs=P(None, "tp", None))
  plain = _gated_mlp(lambda x, w, b: jnp.einsum("bse,etf->bstf", x, w, precision="highest") + b,
                     lambda h, w: jnp.dot(h, w, precision="highest"))
  loss = lambda f: jax.jit(jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2, 3)))
  (got, got_grads), (want, want_grads) = loss(ours)(x, w_in, b_in, w_out), loss(plain)(x, w_in, b_in, w_out)
  assert_close(got, float(want), np.float32, 2 * WORLD * 2 * 16, what="loss")
  for name, g, r in zip(("dx", "dw_in", "db_in", "dw_out"), got_grads, want_grads):
    assert_close(g, np.asarray(r, np.float64), np.float32, 64, what=name)


@pytest.mark.parametrize("gather_axis", [0, -3, 1])
def test_gather_axis(gather_axis, normal, make_mesh, assert_close):
  """x [B, S, K] gathered along B (0 or -3) or S (1): the fused kernels' rows after a fold (ag_matmul.on_shards)."""
  mesh = make_mesh((WORLD,), ("tp",))
  x, w, bias = normal((WORLD * 2, 3, 16), np.float32), normal((16, WORLD * 2), np.float32), normal((WORLD * 2,),
                                                                                                    np.float32)
  x_spec = P("tp", None, None) if gather_axis in (0, -3) else P(None, "tp", None)
  if gather_axis == 1:
    x = normal((2, WORLD * 3, 16), np.float32)
  f = jax.shard_map(lambda x, w, b: jax_overlap.ag_matmul(x, w, b, axis_name="tp", gather_axis=gather_axis,
                                                          return_gathered=True),
                    mesh=mesh, in_specs=(x_spec, P(None, "tp"), P("tp")), out_specs=(P(None, None, "tp"), x_spec))
  y, gathered = jax.jit(f)(x, w, bias)
  x64, w64, b64 = _f64(x, w, bias)
  assert_close(y, x64 @ w64 + b64, np.float32, 16)
  # Every rank holds all of x; the out_spec stacks the copies along the gathered dim.
  copy = np.asarray(gathered)[:, : x.shape[1]] if gather_axis == 1 else np.asarray(gathered)[: x.shape[0]]
  np.testing.assert_array_equal(copy, x)
  grads = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a)[0])), argnums=(0, 1, 2)))(x, w, bias)
  dy = np.cos(x64 @ w64 + b64)
  for name, g, r in zip(("dx", "dw", "db"), grads, (dy @ w64.T, np.einsum("bsk,bsn->kn", x64, dy), dy.sum((0, 1)))):
    assert_close(g, r, np.float32, 32, what=name)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=_name)
@pytest.mark.parametrize("scatter_axis,out_spec", [(0, P("tp", None, None)), (-1, P(None, None, "tp")),
                                                   (-2, P(None, "tp", None))], ids=["batch", "columns", "rows"])
def test_scatter_axis(scatter_axis, out_spec, dtype, normal, make_mesh, assert_close):
  """matmul_rs scatters any output dim; the columns (-1) take the XLA path, with this rank's block of the bias."""
  mesh = make_mesh((WORLD,), ("tp",))
  x, w, bias = normal((WORLD, WORLD * 2, WORLD * 4), dtype), normal((WORLD * 4, WORLD * 2), dtype), \
      normal((WORLD * 2,), dtype)
  f = jax.shard_map(lambda x, w, b: jax_overlap.matmul_rs(x, w, b, axis_name="tp", scatter_axis=scatter_axis),
                    mesh=mesh, in_specs=(P(None, None, "tp"), P("tp", None), P()), out_specs=out_spec)
  x64, w64, b64 = _f64(x, w, bias)
  assert_close(jax.jit(f)(x, w, bias), x64 @ w64 + b64, dtype, WORLD * 4)
  grads = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a).astype(jnp.float32))), argnums=(0, 1, 2)))(x, w, bias)
  dz = np.cos(np.asarray(jax.jit(f)(x, w, bias), np.float64))
  want = (dz @ w64.T, np.einsum("bmk,bmn->kn", x64, dz), dz.sum((0, 1)))
  for name, g, r in zip(("dx", "dw", "db"), grads, want):
    assert_close(g, r, dtype, 2 * WORLD * WORLD, what=name)


def _ulps_off(got, exact, dtype):
  """|got - exact| in units of dtype's spacing at exact (bf16: 8 significant bits)."""
  bits = jnp.finfo(dtype).nmant
  spacing = np.exp2(np.floor(np.log2(np.maximum(np.abs(exact), float(jnp.finfo(dtype).tiny)))) - bits)
  return np.abs(np.asarray(got, np.float64) - exact) / spacing


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_bias_added_before_rounding(op, normal, make_mesh):
  """The XLA path rounds x @ w + bias once, like the fused kernels: within half a bf16 ulp of the exact value.
  Rounding the product first and then the sum (the old reference) is off by up to a whole ulp. (matmul_rs over
  a group rounds each rank's partial product before the reduction, as the fused kernel does: its local
  product, with no group, is checked here.)"""
  dtype = jnp.bfloat16
  x, w, bias = normal((WORLD * 64, 16), dtype), normal((16, WORLD * 16), dtype), normal((WORLD * 16,), dtype)
  if op == "ag_matmul":
    f = jax.shard_map(lambda x, w, b: jax_overlap.ag_matmul(x, w, b, axis_name="tp", algorithm="xla"),
                      mesh=make_mesh((WORLD,), ("tp",)), in_specs=(P("tp", None), P(None, "tp"), P("tp")),
                      out_specs=P(None, "tp"))
  else:
    f = lambda x, w, b: jax_overlap.matmul_rs(x, w, b, algorithm="xla")
  x64, w64, b64 = _f64(x, w, bias)
  off = _ulps_off(jax.jit(f)(x, w, bias), x64 @ w64 + b64, dtype)
  assert off.max() <= 0.5 + 1e-3, f"{op}: {np.mean(off > 0.5):.1%} of the elements are off by more than half an ulp"
