"""Global-array mode (axis_name=None) under jit: values for many input shardings, and the compiled collectives.

On CPU the partitioned body is the reference decomposition, so the fused
shardings must compile to exactly the collective of the shard_map form (one
all-gather of x for ag_matmul, one reduce-scatter of the product for
matmul_rs) and nothing that reshards the result.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap
from jax_overlap._sharding import spec_of

TP = 4


def reference(x, w, bias):
  return np.einsum("...mk,kn->...mn", x.astype(np.float64), w.astype(np.float64)) + bias.astype(np.float64)


def reduce_scatter(*block, dim: int = -2):
  """The compiled collective of the XLA path's reduce-scatter onto `block` (this rank's block of the output):
  an all-to-all of the rounded partials, summed locally (ops/reference.py); XLA's CPU backend sends one buffer per
  peer, `block` with a unit dim for the group before the scattered dim."""
  shape = list(block)
  shape.insert(len(shape) + dim, 1)
  return ("all-to-all", tuple(shape))


def all_reduce(shape, group: int):
  """The compiled collectives of the XLA path's all-reduce of an output of `shape` over `group` ranks: a
  reduce-scatter of the flattened output (padded to a multiple of the group), then an all-gather of the sums."""
  chunk = -(-int(np.prod(shape)) // group)
  return [("all-gather", (group * chunk,)), ("all-to-all", (1, chunk))]


def same_layout(sharding, spec) -> bool:
  """sharding lays its array out as spec says (trailing unsharded dims written or not)."""
  ndim = max(len(sharding.spec), len(spec))
  return spec_of(sharding, ndim) == spec_of(spec, ndim)


def _put(mesh, arrays_and_specs):
  return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in arrays_and_specs]


def _jit(op, mesh=None, out_spec=None):
  out = None if out_spec is None else NamedSharding(mesh, out_spec)
  return jax.jit(lambda x, w, b: op(x, w, b), out_shardings=out)


# (name, x shape, x spec, w spec, bias spec) on a ('dp', 'tp') = (2, 4) mesh; w is [16, 24].
AG_SHARDINGS = [
    ("fused", (16, 16), P("tp", None), P(None, "tp"), P("tp")),
    ("fused_dp_batch", (4, 8, 16), P("dp", "tp", None), P(None, "tp"), P("tp")),
    ("replicated", (4, 8, 16), P(), P(), P()),
    ("rows_on_dp", (4, 8, 16), P(None, "dp", None), P(None, "tp"), P()),
    ("rows_only", (16, 16), P("tp", None), P(), P()),
    ("k_sharded", (4, 8, 16), P(None, None, "tp"), P("tp", None), P()),
    ("w_cols_on_dp", (16, 16), P("tp", None), P(None, "dp"), P("dp")),
    ("batch_and_rows_same_axis", (4, 8, 16), P("tp", None, None), P(None, "tp"), P("tp")),
]
# w is [16, 24] (K = 16).
RS_SHARDINGS = [
    ("fused", (16, 16), P(None, "tp"), P("tp", None), P()),
    ("fused_dp_batch", (4, 8, 16), P("dp", None, "tp"), P("tp", None), P()),
    ("replicated", (4, 8, 16), P(), P(), P()),
    ("rows_sharded", (4, 8, 16), P(None, "tp", None), P(None, "tp"), P("tp")),
    ("k_on_different_axes", (16, 16), P(None, "tp"), P("dp", None), P()),
    ("rows_not_divisible", (2, 6, 16), P(None, None, "tp"), P("tp", None), P()),
    ("batch_on_dp_only", (4, 8, 16), P("dp", None, None), P(), P()),
]


ANY_SHARDINGS = [("ag_matmul", *c) for c in AG_SHARDINGS] + [("matmul_rs", *c) for c in RS_SHARDINGS]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op,name,x_shape,x_spec,w_spec,b_spec", ANY_SHARDINGS,
                         ids=[f"{c[0]}-{c[1]}" for c in ANY_SHARDINGS])
def test_any_sharding(op, name, x_shape, x_spec, w_spec, b_spec, dtype, normal, make_mesh, assert_close):
  mesh = make_mesh((2, TP), ("dp", "tp"))
  x, w, bias = normal(x_shape, dtype), normal((16, 24), dtype), normal((24,), dtype)
  args = _put(mesh, [(x, x_spec), (w, w_spec), (bias, b_spec)])
  out = _jit(getattr(jax_overlap, op))(*args)
  assert out.dtype == dtype
  assert_close(out, reference(x, w, bias), dtype, 16, what=name)


def test_ag_matmul_return_gathered_global(normal, make_mesh, assert_close):
  mesh = make_mesh((TP,), ("tp",))
  x, w, bias = normal((16, 16), jnp.float32), normal((16, 24), jnp.float32), normal((24,), jnp.float32)
  args = _put(mesh, [(x, P("tp", None)), (w, P(None, "tp")), (bias, P("tp"))])
  y, gathered = jax.jit(lambda x, w, b: jax_overlap.ag_matmul(x, w, b, return_gathered=True))(*args)
  assert_close(y, reference(x, w, bias), jnp.float32, 16)
  np.testing.assert_array_equal(np.asarray(gathered), x)


def test_eager_global_call(normal, assert_close):
  """Outside jit, on plain single-device arrays, both ops are the local product."""
  x, w, bias = normal((6, 16), jnp.float32), normal((16, 10), jnp.float32), normal((10,), jnp.float32)
  assert_close(jax_overlap.ag_matmul(x, w, bias), reference(x, w, bias), jnp.float32, 16)
  assert_close(jax_overlap.matmul_rs(x, w, bias), reference(x, w, bias), jnp.float32, 16)


# --- the compiled collectives ---------------------------------------------------


def test_ag_matmul_fused_sharding_hlo(normal, make_mesh, compiled_collectives, assert_close):
  """x rows + w columns on 'tp': exactly one all-gather, of x's global size, and no reshard of y."""
  mesh = make_mesh((TP,), ("tp",))
  x, w, bias = normal((32, 16), jnp.float32), normal((16, 24), jnp.float32), normal((24,), jnp.float32)
  args = _put(mesh, [(x, P("tp", None)), (w, P(None, "tp")), (bias, P("tp"))])
  f = _jit(jax_overlap.ag_matmul, mesh, P(None, "tp"))
  y = f(*args)
  assert_close(y, reference(x, w, bias), jnp.float32, 16)
  assert y.sharding.spec == P(None, "tp")
  assert compiled_collectives(f, *args) == [("all-gather", (32, 16))]


def test_ag_matmul_output_column_sharded_without_out_shardings(normal, make_mesh, compiled_collectives):
  mesh = make_mesh((TP,), ("tp",))
  x, w, bias = normal((32, 16), jnp.float32), normal((16, 24), jnp.float32), normal((24,), jnp.float32)
  args = _put(mesh, [(x, P("tp", None)), (w, P(None, "tp")), (bias, P("tp"))])
  f = _jit(jax_overlap.ag_matmul)
  assert f(*args).sharding.spec == P(None, "tp")
  assert compiled_collectives(f, *args) == [("all-gather", (32, 16))]


def test_ag_matmul_fused_sharding_with_dp_hlo(normal, make_mesh, compiled_collectives, assert_close):
  """A batch dim on 'dp' passes through: one all-gather over 'tp' of this dp slice's x."""
  mesh = make_mesh((2, TP), ("dp", "tp"))
  x, w, bias = normal((4, 8, 16), jnp.bfloat16), normal((16, 24), jnp.bfloat16), normal((24,), jnp.bfloat16)
  args = _put(mesh, [(x, P("dp", "tp", None)), (w, P(None, "tp")), (bias, P("tp"))])
  f = _jit(jax_overlap.ag_matmul, mesh, P("dp", None, "tp"))
  assert_close(f(*args), reference(x, w, bias), jnp.bfloat16, 16)
  assert compiled_collectives(f, *args) == [("all-gather", (2, 8, 16))]


def test_matmul_rs_fused_sharding_hlo(normal, make_mesh, compiled_collectives, assert_close):
  """x's K + w's K on 'tp', out_shardings rows: exactly one reduce-scatter into the local rows."""
  mesh = make_mesh((TP,), ("tp",))
  x, w, bias = normal((32, 16), jnp.float32), normal((16, 24), jnp.float32), normal((24,), jnp.float32)
  args = _put(mesh, [(x, P(None, "tp")), (w, P("tp", None)), (bias, P())])
  f = _jit(jax_overlap.matmul_rs, mesh, P("tp", None))
  z = f(*args)
  assert_close(z, reference(x, w, bias), jnp.float32, 16)
  assert compiled_collectives(f, *args) == [reduce_scatter(8, 24)]


def test_matmul_rs_fused_sharding_with_dp_hlo(normal, make_mesh, compiled_collectives, assert_close):
  mesh = make_mesh((2, TP), ("dp", "tp"))
  x, w, bias = normal((4, 8, 16), jnp.bfloat16), normal((16, 24), jnp.bfloat16), normal((24,), jnp.bfloat16)
  args = _put(mesh, [(x, P("dp", None, "tp")), (w, P("tp", None)), (bias, P())])
  f = _jit(jax_overlap.matmul_rs, mesh, P("dp", "tp", None))
  assert_close(f(*args), reference(x, w, bias), jnp.bfloat16, 16)
  assert compiled_collectives(f, *args) == [reduce_scatter(2, 2, 24)]


def test_matmul_rs_without_an_output_sharding_all_reduces(normal, make_mesh, compiled_collectives, assert_close):
  """Nothing asks for the reduced axis on an output dim (Auto mesh): one all-reduce, as XLA's own dot does."""
  mesh = make_mesh((TP,), ("tp",))
  x, w, bias = normal((32, 16), jnp.float32), normal((16, 24), jnp.float32), normal((24,), jnp.float32)
  args = _put(mesh, [(x, P(None, "tp")), (w, P("tp", None)), (bias, P())])
  f = _jit(jax_overlap.matmul_rs)
  assert_close(f(*args), reference(x, w, bias), jnp.float32, 16)
  assert sorted(compiled_collectives(f, *args)) == all_reduce((32, 24), TP)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("out_spec,want", [
    (P("tp", None), [reduce_scatter(8, 24)]),
    (P(None, "tp"), [reduce_scatter(32, 6, dim=-1)]),  # the columns: the XLA path's reduce-scatter
], ids=["rows", "columns"])
def test_matmul_rs_out_sharding(out_spec, want, axis_type, normal, make_mesh, compiled_collectives, assert_close):
  """out_sharding picks the dim the reduction scatters onto: one reduce-scatter, nothing after it."""
  mesh = make_mesh((TP,), ("tp",), getattr(jax.sharding.AxisType, axis_type))
  x, w, bias = normal((32, 16), jnp.float32), normal((16, 24), jnp.float32), normal((24,), jnp.float32)
  args = _put(mesh, [(x, P(None, "tp")), (w, P("tp", None)), (bias, P())])
  f = jax.jit(lambda x, w, b: jax_overlap.matmul_rs(x, w, b, out_sharding=NamedSharding(mesh, out_spec)))
  z = f(*args)
  assert_close(z, reference(x, w, bias), jnp.float32, 16)
  assert same_layout(z.sharding, out_spec)
  assert compiled_collectives(f, *args) == want


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_ag_matmul_out_sharding(axis_type, normal, make_mesh, compiled_collectives, assert_close):
  """The fused layout asked for by name: one all-gather; another layout: the result resharded to it."""
  mesh = make_mesh((TP,), ("tp",), getattr(jax.sharding.AxisType, axis_type))
  x, w = normal((32, 16), jnp.float32), normal((16, 24), jnp.float32)
  args = _put(mesh, [(x, P("tp", None)), (w, P(None, "tp"))])
  for out_spec in (P(None, "tp"), P("tp", None)):
    f = jax.jit(lambda x, w: jax_overlap.ag_matmul(x, w, out_sharding=NamedSharding(mesh, out_spec)))
    y = f(*args)
    assert_close(y, reference(x, w, 0 * w[0]), jnp.float32, 16)
    assert same_layout(y.sharding, out_spec)
    if out_spec == P(None, "tp"):
      assert compiled_collectives(f, *args) == [("all-gather", (32, 16))]


def test_rows_on_another_axis_stay_sharded(normal, make_mesh, compiled_collectives, assert_close):
  """The Flax NNX guide's MultiDotReluDot: rows on 'data', the weights on 'model'. x @ w1 is local, and
  h @ w2 all-reduces over 'model' with the rows still on 'data', as the reference program does: the same bytes
  (this data slice's [4, 16] product), as a reduce-scatter and an all-gather (the XLA path's all-reduce)."""
  mesh = make_mesh((2, TP), ("data", "model"))
  x, w1, w2 = normal((8, 16), jnp.float32), normal((16, 32), jnp.float32), normal((32, 16), jnp.float32)
  args = _put(mesh, [(x, P("data", None)), (w1, P(None, "model")), (w2, P("model", None))])
  out = NamedSharding(mesh, P("data", None))
  ours = jax.jit(lambda x, w1, w2: jax_overlap.matmul_rs(jax.nn.relu(jax_overlap.ag_matmul(x, w1)), w2),
                 out_shardings=out)
  plain = jax.jit(lambda x, w1, w2: jax.nn.relu(x @ w1) @ w2, out_shardings=out)
  want = np.maximum(x.astype(np.float64) @ w1, 0) @ w2
  np.testing.assert_allclose(np.asarray(ours(*args)), want, rtol=1e-4, atol=1e-4)
  assert compiled_collectives(plain, *args) == [("all-reduce", (4, 16))]
  assert sorted(compiled_collectives(ours, *args)) == all_reduce((4, 16), TP)


def test_matmul_rs_keeps_rows_on_another_axis(normal, make_mesh, compiled_collectives, assert_close):
  """Rows on 'dp' and K on 'tp': the reduce-scatter splits this dp slice's rows, nothing regathers them."""
  mesh = make_mesh((2, TP), ("dp", "tp"))
  x, w = normal((16, 16), jnp.float32), normal((16, 24), jnp.float32)
  args = _put(mesh, [(x, P("dp", "tp")), (w, P("tp", None))])
  f = jax.jit(lambda x, w: jax_overlap.matmul_rs(x, w, out_sharding=NamedSharding(mesh, P(("dp", "tp"), None))))
  assert_close(f(*args), reference(x, w, 0 * w[0]), jnp.float32, 16)
  assert compiled_collectives(f, *args) == [reduce_scatter(2, 24)]


# --- weights with several output (ag_matmul) or contracted (matmul_rs) dims --------------------------


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_multi_dim_weights_hlo(axis_type, normal, make_mesh, compiled_collectives, assert_close):
  """A gated kernel [E, 2, F] sharded on F, a heads kernel [H, D, E] on H: one all-gather, one reduce-scatter,
  no reshape of a sharded weight (which would gather it)."""
  mesh = make_mesh((2, TP), ("dp", "tp"), getattr(jax.sharding.AxisType, axis_type))
  x, gate, proj = normal((4, 8, 16), jnp.bfloat16), normal((16, 2, 16), jnp.bfloat16), normal((4, 4, 16), jnp.bfloat16)
  bias = normal((2, 16), jnp.bfloat16)
  args = _put(mesh, [(x, P("dp", "tp", None)), (gate, P(None, None, "tp")), (bias, P(None, "tp")),
                     (proj, P("tp", None, None))])

  def layers(x, gate, bias, proj):
    g = jax_overlap.ag_matmul(x, gate, bias)  # [4, 8, 2, 16]
    h = (g[..., 0, :] * g[..., 1, :]).reshape(4, 8, 4, 4)
    return g, jax_overlap.matmul_rs(h, proj, out_sharding=NamedSharding(mesh, P("dp", "tp", None)))

  f = jax.jit(layers)
  g, out = f(*args)
  x64, gate64, bias64, proj64 = (np.asarray(a, np.float64) for a in (x, gate, bias, proj))
  assert_close(g, np.einsum("bse,etf->bstf", x64, gate64) + bias64, jnp.bfloat16, 16)
  h = np.asarray(g, np.float64)
  h = (h[..., 0, :] * h[..., 1, :]).reshape(4, 8, 4, 4)
  assert_close(out, np.einsum("bshd,hde->bse", h, proj64), jnp.bfloat16, 16, scale=4)
  assert same_layout(g.sharding, P("dp", None, None, "tp"))
  assert sorted(compiled_collectives(f, *args)) == [("all-gather", (2, 8, 16)), reduce_scatter(2, 2, 16)]


def test_gather_axis_global(normal, make_mesh, compiled_collectives, assert_close):
  """gather_axis=0 gathers the batch dim's sharding (the rows are not sharded)."""
  mesh = make_mesh((TP,), ("tp",))
  x, w = normal((8, 3, 16), jnp.float32), normal((16, 24), jnp.float32)
  args = _put(mesh, [(x, P("tp", None, None)), (w, P(None, "tp"))])
  f = jax.jit(lambda x, w: jax_overlap.ag_matmul(x, w, gather_axis=0))
  y = f(*args)
  assert_close(y, reference(x, w, 0 * w[0]), jnp.float32, 16)
  assert same_layout(y.sharding, P(None, None, "tp"))
  # The body folds the batch and the rows into one row dim (ag_matmul.on_shards), which is what it gathers.
  assert compiled_collectives(f, *args) == [("all-gather", (24, 16))]


# --- uneven shards (issue 15, item 4) ---------------------------------------------------------------
# device_put refuses uneven shardings, but a constraint inside jit makes them, and XLA pads the shards with
# values that are not zero once an elementwise op ran on them (cos here): no product or gather may see them.

def _uneven(mesh, a, spec):
  return jnp.cos(lax.with_sharding_constraint(a, NamedSharding(mesh, spec)))


@pytest.mark.parametrize("op,x_shape,w_shape,x_spec,w_spec", [
    ("matmul_rs", (8, 10), (10, 6), P(None, "tp"), P("tp", None)),  # K = 10 on 4 devices
    ("ag_matmul", (10, 16), (16, 8), P("tp", None), P(None, "tp")),  # M = 10: failed to compile (INTERNAL)
    ("ag_matmul", (8, 16), (16, 10), P("tp", None), P(None, "tp")),  # N = 10
], ids=["rs_k10", "ag_m10", "ag_n10"])
def test_uneven_shards(op, x_shape, w_shape, x_spec, w_spec, normal, make_mesh, assert_close):
  mesh = make_mesh((TP,), ("tp",))
  x, w = normal(x_shape, jnp.float32), normal(w_shape, jnp.float32)
  fn = getattr(jax_overlap, op)
  out = jax.jit(lambda x, w: fn(_uneven(mesh, x, x_spec), _uneven(mesh, w, w_spec)))(x, w)
  assert_close(out, np.cos(x.astype(np.float64)) @ np.cos(w.astype(np.float64)), jnp.float32, x_shape[-1])


def test_two_layer_chain_hlo(normal, make_mesh, compiled_collectives):
  """ag_matmul's column-sharded y feeds matmul_rs's fused sharding directly: one AG, one RS, nothing else."""
  mesh = make_mesh((TP,), ("tp",))
  x, w1, w2 = normal((32, 16), jnp.float32), normal((16, 32), jnp.float32), normal((32, 16), jnp.float32)
  args = _put(mesh, [(x, P("tp", None)), (w1, P(None, "tp")), (w2, P("tp", None))])
  f = jax.jit(lambda x, w1, w2: jax_overlap.matmul_rs(jax_overlap.ag_matmul(x, w1), w2),
              out_shardings=NamedSharding(mesh, P("tp", None)))
  np.testing.assert_allclose(np.asarray(f(*args)), (x.astype(np.float64) @ w1) @ w2, rtol=1e-4, atol=1e-3)
  assert compiled_collectives(f, *args) == [("all-gather", (32, 16)), reduce_scatter(8, 16)]


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_explicit_mesh_axes(op, normal, make_mesh, compiled_collectives, assert_close):
  """jax.make_mesh's default Explicit axes: the outputs are typed with the partitioned layout, so no reshard."""
  mesh = make_mesh((TP,), ("tp",), jax.sharding.AxisType.Explicit)
  x, w = normal((32, 16), jnp.float32), normal((16, 24), jnp.float32)
  if op == "ag_matmul":
    specs, want_spec, want = (P("tp", None), P(None, "tp")), P(None, "tp"), [("all-gather", (32, 16))]
  else:
    specs, want_spec, want = (P(None, "tp"), P("tp", None)), P("tp", None), [reduce_scatter(8, 24)]
  args = _put(mesh, zip((x, w), specs))
  f = jax.jit(getattr(jax_overlap, op))
  y = f(*args)
  np.testing.assert_allclose(np.asarray(y), x.astype(np.float64) @ w, rtol=1e-4, atol=1e-4)
  assert compiled_collectives(f, *args) == want
  assert y.sharding.spec == want_spec
