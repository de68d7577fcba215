"""jax.vmap: a batched x alone folds into x's leading dims; a batched w means a weight per element. Every test runs
on a mesh of Auto axes and on one of Explicit axes (the README promises vmap on both)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap

WORLD = 4
BATCH = 3


@pytest.fixture(params=["Auto", "Explicit"])
def mesh_on(request, make_mesh):
  """mesh_on(shape, names): a mesh of this test's axis type."""
  return lambda shape, names: make_mesh(shape, names, getattr(jax.sharding.AxisType, request.param))


def _shard_mapped(fn, mesh, in_specs, out_specs):
  """jit of shard_map(fn), its arguments placed as in_specs say (on a mesh of Explicit axes shard_map takes only
  arrays of those layouts)."""
  f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
  specs = in_specs if isinstance(in_specs, tuple) else (in_specs,)
  return lambda *args: f(*(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)))


def _ag(mesh, in_axes, x_spec, w_spec, out_spec):
  fn = jax.vmap(lambda x, w, b: jax_overlap.ag_matmul(x, w, b, axis_name="tp"), in_axes=in_axes)
  return _shard_mapped(fn, mesh, (x_spec, w_spec, P("tp")), out_spec)


def _rs(mesh, in_axes, x_spec, w_spec, out_spec):
  fn = jax.vmap(lambda x, w, b: jax_overlap.matmul_rs(x, w, b, axis_name="tp"), in_axes=in_axes)
  return _shard_mapped(fn, mesh, (x_spec, w_spec, P()), out_spec)


def _ref(x, w, bias, w_batched=False):
  eq = "bmk,bkn->bmn" if w_batched else "bmk,kn->bmn"
  return np.einsum(eq, x.astype(np.float64), w.astype(np.float64)) + bias.astype(np.float64)


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_vmap_x_only(op, normal, mesh_on, assert_close):
  mesh, dt = mesh_on((WORLD,), ("tp",)), jnp.float32
  if op == "ag_matmul":
    x, w, b = normal((BATCH, WORLD * 2, 16), dt), normal((16, WORLD * 8), dt), normal((WORLD * 8,), dt)
    f = _ag(mesh, (0, None, None), P(None, "tp", None), P(None, "tp"), P(None, None, "tp"))
  else:
    x, w, b = normal((BATCH, WORLD * 2, WORLD * 8), dt), normal((WORLD * 8, 16), dt), normal((16,), dt)
    f = _rs(mesh, (0, None, None), P(None, None, "tp"), P("tp", None), P(None, "tp", None))
  assert_close(f(x, w, b), _ref(x, w, b), dt, 32)


def test_vmap_x_on_a_middle_axis(normal, mesh_on, assert_close):
  """in_axes=1 on x [m, B, K]: the batch axis is moved to the front before folding."""
  mesh, dt = mesh_on((WORLD,), ("tp",)), jnp.float32
  x, w, b = normal((WORLD * 2, BATCH, 16), dt), normal((16, WORLD * 8), dt), normal((WORLD * 8,), dt)
  f = _ag(mesh, (1, None, None), P("tp", None, None), P(None, "tp"), P(None, None, "tp"))
  assert_close(f(x, w, b), _ref(np.moveaxis(x, 1, 0), w, b), dt, 16)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_vmap_x_and_w(op, dtype, normal, mesh_on, assert_close):
  """A different weight per batch element: the reference decomposition, vmapped."""
  mesh = mesh_on((WORLD,), ("tp",))
  if op == "ag_matmul":
    x, w = normal((BATCH, WORLD * 2, 16), dtype), normal((BATCH, 16, WORLD * 8), dtype)
    b = normal((WORLD * 8,), dtype)
    f = _ag(mesh, (0, 0, None), P(None, "tp", None), P(None, None, "tp"), P(None, None, "tp"))
    k = 16
  else:
    x, w = normal((BATCH, WORLD * 2, WORLD * 8), dtype), normal((BATCH, WORLD * 8, 16), dtype)
    b = normal((16,), dtype)
    f = _rs(mesh, (0, 0, None), P(None, None, "tp"), P(None, "tp", None), P(None, "tp", None))
    k = WORLD * 8
  assert_close(f(x, w, b), _ref(x, w, b, w_batched=True), dtype, k)


def test_vmap_bias_only(normal, mesh_on, assert_close):
  mesh, dt = mesh_on((WORLD,), ("tp",)), jnp.float32
  x, w, b = normal((WORLD * 2, 16), dt), normal((16, WORLD * 8), dt), normal((BATCH, WORLD * 8), dt)
  fn = jax.vmap(lambda x, w, b: jax_overlap.ag_matmul(x, w, b, axis_name="tp"), in_axes=(None, None, 0))
  f = _shard_mapped(fn, mesh, (P("tp", None), P(None, "tp"), P(None, "tp")), P(None, None, "tp"))
  want = x.astype(np.float64) @ w.astype(np.float64) + b.astype(np.float64)[:, None, :]
  assert_close(f(x, w, b), want, dt, 16)


def test_vmap_all_gather(normal, mesh_on):
  mesh = mesh_on((WORLD,), ("tp",))
  x = normal((BATCH, WORLD * 2, 8), jnp.float32)
  f = _shard_mapped(jax.vmap(lambda v: jax_overlap.all_gather(v, axis_name="tp")), mesh, P(None, "tp", None),
                    P(None, "tp", None))
  np.testing.assert_array_equal(np.asarray(f(x)).reshape(BATCH, WORLD, WORLD * 2, 8)[:, 0], x)


# The ops' own layouts: ag_matmul's x rows and w columns on one axis, matmul_rs's x K and w rows (with a batched w,
# its element dims laid out so).
GLOBAL_SPECS = {"ag_matmul": (P(None, "tp", None), P(None, "tp")), "matmul_rs": (P(None, None, "tp"), P("tp", None))}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("batched", ["x", "x_and_w", "w"])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_vmap_global(op, batched, dtype, normal, mesh_on, assert_close):
  """On an Explicit mesh a batched weight used to fail with JAX's ShardingTypeError (issue 52, item 3): the reference
  product its batching takes had no legal result type for these layouts."""
  mesh = mesh_on((WORLD,), ("tp",))
  x_spec, w_spec = GLOBAL_SPECS[op]
  x, b = normal((BATCH, 16, 32), dtype), normal((24,), dtype)
  w = normal((BATCH, 32, 24) if batched != "x" else (32, 24), dtype)
  if batched == "w":
    x, x_spec = x[0], P(*x_spec[1:])
  x = jax.device_put(x, NamedSharding(mesh, x_spec))
  w = jax.device_put(w, NamedSharding(mesh, P(None, *w_spec) if batched != "x" else w_spec))
  fn = jax.vmap(getattr(jax_overlap, op), in_axes=(0 if batched != "w" else None, 0 if batched != "x" else None,
                                                   None))
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  want = np.einsum(f"{'b' if batched != 'w' else ''}mk,{'b' if batched != 'x' else ''}kn->bmn", x64, w64) + b.astype(
      np.float64)
  assert_close(jax.jit(fn)(x, w, b), want, dtype, 32)


def test_per_example_grads_in_shard_map(normal, mesh_on, assert_close):
  """vmap(grad): one weight gradient per batch element, inside shard_map."""
  mesh = mesh_on((WORLD,), ("tp",))
  x, w = normal((BATCH, WORLD * 2, 16), jnp.float32), normal((16, WORLD * 8), jnp.float32)
  ct = normal((WORLD * 2, WORLD * 8), jnp.float32)

  def per_example(ag):
    def body(x, w, ct):
      loss = lambda xi, w: jnp.sum(ag(xi, w) * ct)
      return jax.vmap(jax.grad(loss, argnums=1), in_axes=(0, None))(x, w)
    return _shard_mapped(body, mesh, (P(None, "tp", None), P(None, "tp"), P(None, "tp")), P(None, None, "tp"))(x, w, ct)

  got = per_example(lambda xi, w: jax_overlap.ag_matmul(xi, w, axis_name="tp"))
  want = np.einsum("bmk,mn->bkn", x.astype(np.float64), ct.astype(np.float64))
  assert_close(got, want, jnp.float32, WORLD * 2)


def test_grad_of_vmap_global(normal, mesh_on, assert_close):
  mesh = mesh_on((WORLD,), ("tp",))
  x, w, ct = normal((BATCH, 16, 32), jnp.float32), normal((32, 24), jnp.float32), normal((BATCH, 16, 24), jnp.float32)
  args = (jax.device_put(x, NamedSharding(mesh, P(None, "tp", None))),
          jax.device_put(w, NamedSharding(mesh, P(None, "tp"))))
  loss = lambda x, w: jnp.sum(jax.vmap(jax_overlap.ag_matmul, in_axes=(0, None))(x, w) * ct)
  dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(*args)
  x64, w64, ct64 = (a.astype(np.float64) for a in (x, w, ct))
  assert_close(dx, ct64 @ w64.T, jnp.float32, 24, what="dx")
  assert_close(dw, np.einsum("bmk,bmn->kn", x64, ct64), jnp.float32, BATCH * 16, what="dw")


def _nested(fn, depth: int, in_axes):
  for _ in range(depth):
    fn = jax.vmap(fn, in_axes=in_axes)
  return fn


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_nested_vmap_global(op, depth, with_bias, normal, mesh_on, assert_close):
  """vmap of vmap on global arrays (issue 24, item 7): each level's batching rule calls the op again, so the
  next level's rule batches it too (it used to bind custom_partitioning, which has no batching rule)."""
  mesh, dt = mesh_on((WORLD,), ("tp",)), jnp.float32
  batch = (2, 3, 2)[:depth]
  x, w, b = normal((*batch, WORLD * 2, 16), dt), normal((16, WORLD * 6), dt), normal((WORLD * 6,), dt)
  x_spec, w_spec = (P(*[None] * depth, "tp", None), P(None, "tp")) if op == "ag_matmul" else \
      (P(*[None] * depth, None, "tp"), P("tp", None))
  args = [jax.device_put(x, NamedSharding(mesh, x_spec)), jax.device_put(w, NamedSharding(mesh, w_spec))]
  fn = getattr(jax_overlap, op)
  if with_bias:
    f = _nested(lambda x, w, b: fn(x, w, b), depth, (0, None, None))
    args.append(b)
  else:
    f = _nested(lambda x, w: fn(x, w), depth, (0, None))
  want = np.einsum("...mk,kn->...mn", x.astype(np.float64), w.astype(np.float64)) + (b if with_bias else 0)
  assert_close(jax.jit(f)(*args), want, dt, 16)


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_nested_vmap_global_batched_weights(op, normal, mesh_on, assert_close):
  """The inner level batches x and w (the reference product), the outer x only."""
  mesh, dt = mesh_on((WORLD,), ("tp",)), jnp.float32
  x, w = normal((2, BATCH, WORLD * 2, 16), dt), normal((BATCH, 16, WORLD * 2), dt)
  inner = jax.vmap(getattr(jax_overlap, op), in_axes=(0, 0))
  got = jax.jit(jax.vmap(inner, in_axes=(0, None)))(jax.device_put(x, NamedSharding(mesh, P(None, None, "tp"))), w)
  assert_close(got, np.einsum("abmk,bkn->abmn", x.astype(np.float64), w.astype(np.float64)), dt, 16)


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_nested_vmap_in_shard_map(op, normal, mesh_on, assert_close):
  mesh, dt = mesh_on((WORLD,), ("tp",)), jnp.float32
  if op == "ag_matmul":
    x, w, b = normal((2, BATCH, WORLD * 2, 16), dt), normal((16, WORLD * 8), dt), normal((WORLD * 8,), dt)
    specs, out = (P(None, None, "tp", None), P(None, "tp"), P("tp")), P(None, None, None, "tp")
  else:
    x, w, b = normal((2, BATCH, WORLD * 2, WORLD * 8), dt), normal((WORLD * 8, 16), dt), normal((16,), dt)
    specs, out = (P(None, None, None, "tp"), P("tp", None), P()), P(None, None, "tp", None)
  body = _nested(lambda x, w, b: getattr(jax_overlap, op)(x, w, b, axis_name="tp"), 2, (0, None, None))
  f = _shard_mapped(body, mesh, specs, out)
  want = np.einsum("...mk,kn->...mn", x.astype(np.float64), w.astype(np.float64)) + b
  assert_close(f(x, w, b), want, dt, x.shape[-1])
