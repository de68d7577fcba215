"""Forward values inside jax.shard_map (axis_name given), against float64 NumPy on the same inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_overlap

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]
WORLDS = [1, 2, 4, 8]
LEADS = [(), (3,), (2, 3)]


def _name(v):
  return np.dtype(v).name if isinstance(v, type) else "x".join(map(str, v)) or "none"


def ag_fn(mesh, nlead, with_bias, return_gathered=False, axis="tp", **kwargs):
  """jit(shard_map(ag_matmul)) on global arrays x [..., T*m, K], w [K, T*n], bias [T*n]."""
  lead = (None,) * nlead
  x_spec = P(*lead, axis, None)
  in_specs = (x_spec, P(None, axis)) + ((P(axis),) if with_bias else ())
  y_spec = P(*lead, None, axis)

  def body(x, w, *bias):
    return jax_overlap.ag_matmul(x, w, bias[0] if bias else None, axis_name=axis,
                                 return_gathered=return_gathered, **kwargs)

  out_specs = (y_spec, x_spec) if return_gathered else y_spec
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def rs_fn(mesh, nlead, with_bias, axis="tp", **kwargs):
  """jit(shard_map(matmul_rs)) on global arrays x [..., M, T*k], w [T*k, N], bias [N] (replicated)."""
  lead = (None,) * nlead
  in_specs = (P(*lead, None, axis), P(axis, None)) + ((P(),) if with_bias else ())

  def body(x, w, *bias):
    return jax_overlap.matmul_rs(x, w, bias[0] if bias else None, axis_name=axis, **kwargs)

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P(*lead, axis, None)))


def reference(x, w, bias=None):
  y = np.einsum("...mk,kn->...mn", x.astype(np.float64), w.astype(np.float64))
  return y if bias is None else y + bias.astype(np.float64)


def _operands(normal, dtype, x_shape, w_shape, with_bias):
  x, w = normal(x_shape, dtype), normal(w_shape, dtype)
  bias = normal((w_shape[1],), dtype) if with_bias else None
  return x, w, bias


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("lead", LEADS, ids=_name)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_ag_matmul_basic(dtype, world, lead, with_bias, normal, make_mesh, assert_close):
  m, k, n = 4, 24, 8
  x, w, bias = _operands(normal, dtype, (*lead, world * m, k), (k, world * n), with_bias)
  f = ag_fn(make_mesh((world,), ("tp",)), len(lead), with_bias)
  y = f(x, w, *(() if bias is None else (bias,)))
  assert y.dtype == dtype and y.shape == (*lead, world * m, world * n)
  assert_close(y, reference(x, w, bias), dtype, k)


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("lead", LEADS, ids=_name)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_matmul_rs_basic(dtype, world, lead, with_bias, normal, make_mesh, assert_close):
  rows, k, n = 2 * world, 8, 16
  x, w, bias = _operands(normal, dtype, (*lead, rows, world * k), (world * k, n), with_bias)
  f = rs_fn(make_mesh((world,), ("tp",)), len(lead), with_bias)
  z = f(x, w, *(() if bias is None else (bias,)))
  assert z.dtype == dtype and z.shape == (*lead, rows, n)
  assert_close(z, reference(x, w, bias), dtype, world * k)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_ag_matmul_return_gathered(dtype, world, normal, make_mesh, assert_close):
  lead, m, k, n = (2,), 3, 16, 8
  x, w, bias = _operands(normal, dtype, (*lead, world * m, k), (k, world * n), True)
  f = ag_fn(make_mesh((world,), ("tp",)), len(lead), True, return_gathered=True)
  y, gathered = f(x, w, bias)
  assert_close(y, reference(x, w, bias), dtype, k)
  # Every rank holds the whole gathered x; the out_spec stacks the T copies along the rows.
  assert gathered.dtype == dtype and gathered.shape == (*lead, world * world * m, k)
  copies = np.asarray(gathered).reshape(*lead, world, world * m, k)
  for r in range(world):
    np.testing.assert_array_equal(copies[:, r], x, err_msg=f"rank {r}'s gathered x")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=_name)
def test_odd_shapes(dtype, world, normal, make_mesh, assert_close):
  """Odd and prime sizes take the reference path (the fused kernels want multiples of 8)."""
  m, k, n = 3, 17, 5
  mesh = make_mesh((world,), ("tp",))
  x, w, bias = _operands(normal, dtype, (world * m, k), (k, world * n), True)
  assert_close(ag_fn(mesh, 0, True)(x, w, bias), reference(x, w, bias), dtype, k)
  x, w, bias = _operands(normal, dtype, (world * m, world * k), (world * k, n), True)
  assert_close(rs_fn(mesh, 0, True)(x, w, bias), reference(x, w, bias), dtype, world * k)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_exact_integers(dtype, rng, make_mesh):
  """Small integers: every product and sum is exact in every dtype, so the answer is known exactly."""
  world, m, k, n = 4, 2, 16, 8
  mesh = make_mesh((world,), ("tp",))
  ints = lambda shape: rng.integers(-3, 4, shape).astype(np.dtype(dtype))
  x, w, bias = ints((world * m, k)), ints((k, world * n)), ints((world * n,))
  np.testing.assert_array_equal(np.asarray(ag_fn(mesh, 0, True)(x, w, bias), np.float64), reference(x, w, bias))
  x, w, bias = ints((world * m, world * k)), ints((world * k, n)), ints((n,))
  np.testing.assert_array_equal(np.asarray(rs_fn(mesh, 0, True)(x, w, bias), np.float64), reference(x, w, bias))


@pytest.mark.parametrize("algorithm", ["auto", "xla"])
def test_algorithms_agree(algorithm, normal, make_mesh, assert_close):
  mesh = make_mesh((4,), ("tp",))
  x, w, bias = _operands(normal, jnp.bfloat16, (16, 32), (32, 16), True)
  assert_close(ag_fn(mesh, 0, True, algorithm=algorithm)(x, w, bias), reference(x, w, bias), jnp.bfloat16, 32)
  assert_close(rs_fn(mesh, 0, True, algorithm=algorithm)(x, w, bias), reference(x, w, bias), jnp.bfloat16, 32)


def test_group_of_two_mesh_axes(normal, make_mesh, assert_close):
  """axis_name may be a tuple: the group is the product of the axes (here 2 x 4 = 8 ranks)."""
  dtype, axes = jnp.float32, ("dp", "tp")
  mesh = make_mesh((2, 4), axes)
  x, w, bias = _operands(normal, dtype, (8 * 2, 16), (16, 8 * 3), True)
  assert_close(ag_fn(mesh, 0, True, axis=axes)(x, w, bias), reference(x, w, bias), dtype, 16)
  x, w, bias = _operands(normal, dtype, (8 * 2, 8 * 4), (8 * 4, 8), True)
  assert_close(rs_fn(mesh, 0, True, axis=axes)(x, w, bias), reference(x, w, bias), dtype, 32)


def test_data_parallel_batch_passes_through(normal, make_mesh, assert_close):
  """A batch dim sharded on 'dp' next to the 'tp' group: each dp slice is an independent product."""
  dtype = jnp.float32
  mesh = make_mesh((2, 4), ("dp", "tp"))
  x, w, bias = _operands(normal, dtype, (4, 8, 16), (16, 12), True)
  ag = jax.jit(jax.shard_map(lambda x, w, b: jax_overlap.ag_matmul(x, w, b, axis_name="tp"), mesh=mesh,
                             in_specs=(P("dp", "tp", None), P(None, "tp"), P("tp")),
                             out_specs=P("dp", None, "tp")))
  assert_close(ag(x, w, bias), reference(x, w, bias), dtype, 16)
  x, w, bias = _operands(normal, dtype, (4, 8, 16), (16, 12), True)
  rs = jax.jit(jax.shard_map(lambda x, w, b: jax_overlap.matmul_rs(x, w, b, axis_name="tp"), mesh=mesh,
                             in_specs=(P("dp", None, "tp"), P("tp", None), P()),
                             out_specs=P("dp", "tp", None)))
  assert_close(rs(x, w, bias), reference(x, w, bias), dtype, 16)


@pytest.mark.parametrize("world", [2, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_all_gather_equals_lax(dtype, world, normal, make_mesh):
  mesh = make_mesh((world,), ("tp",))
  x = normal((2, world * 3, 8), dtype)
  spec = P(None, "tp", None)

  def gather(fn):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec))(x)

  ours = gather(lambda v: jax_overlap.all_gather(v, axis_name="tp"))
  theirs = gather(lambda v: lax.all_gather(v, "tp", axis=1, tiled=True))
  assert ours.dtype == dtype
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


@pytest.mark.parametrize("op,x_shape,w_shape", [
    ("ag_matmul", (0, 16), (16, 8)),  # no rows
    ("ag_matmul", (2, 0), (0, 8)),  # K = 0: the product is zero, y is the bias
    ("matmul_rs", (8, 0), (0, 8)),
    ("matmul_rs", (0, 16), (16, 8)),
], ids=["ag_no_rows", "ag_no_k", "rs_no_k", "rs_no_rows"])
def test_empty_operands(op, x_shape, w_shape, normal, make_mesh):
  """Empty dims never reach a collective (XLA rejects empty all-gathers); the result is the bias."""
  world = 4
  mesh = make_mesh((world,), ("tp",))
  x, w, bias = normal(x_shape, np.float32), normal(w_shape, np.float32), normal((w_shape[1],), np.float32)
  in_specs = (P("tp", None), P(), P()) if op == "ag_matmul" else (P(None, "tp"), P("tp", None), P())
  if op == "ag_matmul":
    x = np.concatenate([x] * world)  # each rank's shard is x
  else:
    x, w = np.concatenate([x] * world, axis=1), np.concatenate([w] * world)
  f = jax.jit(jax.shard_map(lambda x, w, b: getattr(jax_overlap, op)(x, w, b, axis_name="tp"), mesh=mesh,
                            in_specs=in_specs, out_specs=P("tp", None)))
  y = np.asarray(f(x, w, bias))
  rows = world * x_shape[0] if op == "ag_matmul" else x_shape[0] // world
  assert y.shape == (world * rows, w_shape[1])
  np.testing.assert_array_equal(y, np.broadcast_to(bias, y.shape))


@pytest.mark.parametrize("mode", ["shard_map", "global"])
def test_ag_matmul_no_columns_still_gathers(mode, normal, make_mesh):
  """n = 0 leaves y empty, but return_gathered's gathered x is still every rank's rows."""
  world = 4
  mesh = make_mesh((world,), ("tp",))
  x, w = normal((world * 3, 16), np.float32), normal((16, 0), np.float32)
  if mode == "shard_map":
    f = jax.jit(jax.shard_map(lambda x, w: jax_overlap.ag_matmul(x, w, axis_name="tp", return_gathered=True),
                              mesh=mesh, in_specs=(P("tp", None), P()), out_specs=(P("tp", None), P("tp", None))))
    copies = world
  else:
    f, copies = jax.jit(lambda x, w: jax_overlap.ag_matmul(x, w, return_gathered=True)), 1
  y, gathered = f(x, w)
  assert y.shape == (copies * world * 3, 0)
  np.testing.assert_array_equal(np.asarray(gathered), np.concatenate([x] * copies))
