"""Reverse-mode gradients: the custom VJPs against JAX's own gradient of the reference decomposition.

The loss is <op(x, w, bias), ct> for a random cotangent ct, so every gradient
is a plain product of the inputs and ct.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap
from test_global import AG_SHARDINGS, RS_SHARDINGS, reduce_scatter, same_layout

WORLD = 4
LEAD = (2,)


def ref_ag(x, w, bias, axis_name):
  """all_gather + dot, written with lax directly (not jax_overlap.reference)."""
  gathered = lax.all_gather(x, axis_name, axis=x.ndim - 2, tiled=True)
  y = jnp.dot(gathered, w, preferred_element_type=jnp.float32).astype(x.dtype)
  return y if bias is None else y + bias


def ref_rs(x, w, bias, axis_name):
  partial = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
  z = lax.psum_scatter(partial, axis_name, scatter_dimension=x.ndim - 2, tiled=True)
  return z if bias is None else z + bias


def _setup(op, weights, bias_kind, dtype, normal):
  """Global operands, in_specs and out_spec for shard_map; k is the longest reduction in any gradient."""
  lead = (None,) * len(LEAD)
  m, k, n = 3, 16, 8
  if op == "ag":
    x = normal((*LEAD, WORLD * m, k), dtype)
    x_spec = P(*lead, "tp", None)
    if weights == "sharded":
      w, w_spec, cols = normal((k, WORLD * n), dtype), P(None, "tp"), n
      out_spec = P(*lead, None, "tp")
    else:  # replicated: every rank computes the whole y; the out_spec stacks the T copies along the rows
      w, w_spec, cols = normal((k, n), dtype), P(), n
      out_spec = P(*lead, "tp", None)
    bias = {None: None, "sharded": (normal((WORLD * n,), dtype), P("tp")),
            "replicated": (normal((cols,), dtype), P())}[bias_kind]
    longest = max(k, WORLD * n, WORLD * np.prod(LEAD) * WORLD * m)
  else:
    x = normal((*LEAD, WORLD * m, WORLD * k), dtype)
    x_spec = P(*lead, None, "tp")
    if weights == "sharded":
      w, w_spec = normal((WORLD * k, n), dtype), P("tp", None)
    else:  # the same [k, n] weight multiplies every rank's K block
      w, w_spec = normal((k, n), dtype), P()
    out_spec = P(*lead, "tp", None)
    bias = None if bias_kind is None else (normal((n,), dtype), P())
    longest = max(WORLD * k, n, WORLD * np.prod(LEAD) * WORLD * m)
  args = [x, w] + ([] if bias is None else [bias[0]])
  in_specs = (x_spec, w_spec) + (() if bias is None else (bias[1],))
  return args, in_specs, out_spec, int(longest)


def _grad_fn(fn, mesh, in_specs, out_spec, ct, check_vma):
  def loss(*args):
    out = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=check_vma)(*args)
    return jnp.sum(out.astype(jnp.float32) * ct)
  return jax.jit(jax.grad(loss, argnums=tuple(range(len(in_specs)))))


GRAD_CASES = [
    ("ag", "sharded", None), ("ag", "sharded", "sharded"), ("ag", "sharded", "replicated"),
    ("ag", "replicated", "replicated"),
    ("rs", "sharded", None), ("rs", "sharded", "replicated"), ("rs", "replicated", "replicated"),
]


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no_vma"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op,weights,bias_kind", GRAD_CASES,
                         ids=[f"{o}-w_{w}-bias_{b}" for o, w, b in GRAD_CASES])
def test_shard_map_grads(op, weights, bias_kind, dtype, check_vma, normal, make_mesh, assert_close):
  mesh = make_mesh((WORLD,), ("tp",))
  args, in_specs, out_spec, longest = _setup(op, weights, bias_kind, dtype, normal)
  ours_op, ref_op = (jax_overlap.ag_matmul, ref_ag) if op == "ag" else (jax_overlap.matmul_rs, ref_rs)

  def ours(x, w, *b):
    return ours_op(x, w, b[0] if b else None, axis_name="tp")

  def ref(x, w, *b):
    return ref_op(x, w, b[0] if b else None, "tp")

  out_shape = jax.eval_shape(jax.shard_map(ref, mesh=mesh, in_specs=in_specs, out_specs=out_spec), *args).shape
  ct = normal(out_shape, np.float32)
  got = _grad_fn(ours, mesh, in_specs, out_spec, ct, check_vma)(*args)
  want = _grad_fn(ref, mesh, in_specs, out_spec, ct, check_vma)(*args)
  for name, g, r, a in zip(("dx", "dw", "dbias"), got, want, args):
    assert g.shape == a.shape and g.dtype == a.dtype, name
    assert_close(g, np.asarray(r, np.float64), dtype, longest, what=name)


@pytest.mark.parametrize("world", [1, 2, 8])
def test_shard_map_grads_world_sizes(world, normal, make_mesh, assert_close):
  """The ag_matmul -> matmul_rs duality at other group sizes (float32, both biases)."""
  mesh = make_mesh((world,), ("tp",))
  x, w1, b1 = normal((world * 2, 16), np.float32), normal((16, world * 8), np.float32), normal((world * 8,), np.float32)
  w2, b2 = normal((world * 8, 16), np.float32), normal((16,), np.float32)
  specs = (P("tp", None), P(None, "tp"), P("tp"), P("tp", None), P())
  ct = normal((world * 2, 16), np.float32)

  def grads(ag, rs):
    def body(x, w1, b1, w2, b2):
      return rs(ag(x, w1, b1), w2, b2)
    return _grad_fn(body, mesh, specs, P("tp", None), ct, True)(x, w1, b1, w2, b2)

  got = grads(lambda x, w, b: jax_overlap.ag_matmul(x, w, b, axis_name="tp"),
              lambda x, w, b: jax_overlap.matmul_rs(x, w, b, axis_name="tp"))
  want = grads(lambda x, w, b: ref_ag(x, w, b, "tp"), lambda x, w, b: ref_rs(x, w, b, "tp"))
  for name, g, r in zip(("x", "w1", "b1", "w2", "b2"), got, want):
    assert_close(g, np.asarray(r, np.float64), np.float32, 8 * world * 16, what=name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: np.dtype(d).name)
def test_shard_map_grads_return_gathered(dtype, normal, make_mesh, assert_close):
  """Both outputs carry a cotangent: the gathered x's flows back through the all-gather's transpose."""
  mesh = make_mesh((WORLD,), ("tp",))
  x, w, bias = normal((WORLD * 3, 16), dtype), normal((16, WORLD * 8), dtype), normal((WORLD * 8,), dtype)
  specs, outs = (P("tp", None), P(None, "tp"), P("tp")), (P(None, "tp"), P("tp", None))
  ct_y, ct_g = normal((WORLD * 3, WORLD * 8), np.float32), normal((WORLD * WORLD * 3, 16), np.float32)

  def grads(fn):
    def loss(*args):
      y, g = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=outs)(*args)
      return jnp.sum(y.astype(jnp.float32) * ct_y) + jnp.sum(g.astype(jnp.float32) * ct_g)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, bias)

  got = grads(lambda x, w, b: jax_overlap.ag_matmul(x, w, b, axis_name="tp", return_gathered=True))
  want = grads(lambda x, w, b: (ref_ag(x, w, b, "tp"), lax.all_gather(x, "tp", axis=0, tiled=True)))
  for name, g, r in zip(("dx", "dw", "dbias"), got, want):
    assert_close(g, np.asarray(r, np.float64), dtype, WORLD * WORLD * 8, what=name)


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no_vma"])
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_shard_map_grads_data_and_tensor_parallel(op, check_vma, normal, make_mesh, assert_close):
  """Data parallel on the batch dim next to the 'tp' group: dw and dbias sum over 'dp' as well."""
  mesh = make_mesh((2, WORLD), ("dp", "tp"))
  x, w, bias = normal((4, 8, 16), np.float32), normal((16, 12), np.float32), normal((12,), np.float32)
  if op == "ag":
    specs, out_spec = (P("dp", "tp", None), P(None, "tp"), P("tp")), P("dp", None, "tp")
    ours = lambda x, w, b: jax_overlap.ag_matmul(x, w, b, axis_name="tp")
    ref = lambda x, w, b: ref_ag(x, w, b, "tp")
  else:
    specs, out_spec = (P("dp", None, "tp"), P("tp", None), P()), P("dp", "tp", None)
    ours = lambda x, w, b: jax_overlap.matmul_rs(x, w, b, axis_name="tp")
    ref = lambda x, w, b: ref_rs(x, w, b, "tp")
  ct = normal((4, 8, 12), np.float32)
  got = _grad_fn(ours, mesh, specs, out_spec, ct, check_vma)(x, w, bias)
  want = _grad_fn(ref, mesh, specs, out_spec, ct, check_vma)(x, w, bias)
  for name, g, r in zip(("dx", "dw", "dbias"), got, want):
    assert_close(g, np.asarray(r, np.float64), np.float32, 32, what=name)


# --- global mode -----------------------------------------------------------------

GLOBAL_CASES = [
    ("ag", "fused", P("tp", None), P(None, "tp"), P("tp")),
    ("ag", "replicated", P(), P(), P()),
    ("ag", "k_sharded", P(None, "tp"), P("tp", None), P()),
    ("rs", "fused", P(None, "tp"), P("tp", None), P()),
    ("rs", "replicated", P(), P(), P()),
    ("rs", "rows_sharded", P("tp", None), P(None, "tp"), P("tp")),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op,name,x_spec,w_spec,b_spec", GLOBAL_CASES, ids=[f"{c[0]}-{c[1]}" for c in GLOBAL_CASES])
def test_global_grads(op, name, x_spec, w_spec, b_spec, dtype, normal, make_mesh, assert_close):
  """jit(grad) with sharded global arrays, against the float64 gradients of <x @ w + bias, ct>."""
  mesh = make_mesh((WORLD,), ("tp",))
  x, w, bias, ct = normal((16, 32), dtype), normal((32, 24), dtype), normal((24,), dtype), normal((16, 24), np.float32)
  fn = jax_overlap.ag_matmul if op == "ag" else jax_overlap.matmul_rs
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in ((x, x_spec), (w, w_spec), (bias, b_spec))]
  loss = lambda x, w, b: jnp.sum(fn(x, w, b).astype(jnp.float32) * ct)
  dx, dw, db = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
  x64, w64, ct64 = (a.astype(np.float64) for a in (x, w, ct))
  assert_close(dx, ct64 @ w64.T, dtype, 24, what="dx")
  assert_close(dw, x64.T @ ct64, dtype, 16, what="dw")
  assert_close(db, ct64.sum(0), dtype, 16, what="dbias")


def test_global_grads_return_gathered(normal, make_mesh, assert_close):
  mesh = make_mesh((WORLD,), ("tp",))
  x, w, ct_y, ct_g = (normal(s, np.float32) for s in ((16, 32), (32, 24), (16, 24), (16, 32)))
  args = [jax.device_put(x, NamedSharding(mesh, P("tp", None))), jax.device_put(w, NamedSharding(mesh, P(None, "tp")))]

  def loss(x, w):
    y, g = jax_overlap.ag_matmul(x, w, return_gathered=True)
    return jnp.sum(y * ct_y) + jnp.sum(g * ct_g)

  dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(*args)
  assert_close(dx, ct_y.astype(np.float64) @ w.T + ct_g, np.float32, 24)
  assert_close(dw, x.astype(np.float64).T @ ct_y, np.float32, 16)


def _fused_grad_setup(op, normal, make_mesh):
  """The fused shardings, with the cotangent sharded like the output (as it is when it comes from a next layer)."""
  mesh = make_mesh((WORLD,), ("tp",))
  x, w, bias = normal((32, 16), np.float32), normal((16, 24), np.float32), normal((24,), np.float32)
  if op == "ag":
    fn, specs, ct = jax_overlap.ag_matmul, (P("tp", None), P(None, "tp"), P("tp")), P(None, "tp")
  else:
    fn, specs, ct = jax_overlap.matmul_rs, (P(None, "tp"), P("tp", None), P()), P("tp", None)
  args = [jax.device_put(a, NamedSharding(mesh, s))
          for a, s in zip((x, w, bias, normal((32, 24), np.float32)), specs + (ct,))]
  loss = lambda x, w, b, ct: jnp.sum(fn(x, w, b) * ct)
  return mesh, args, specs, jax.grad(loss, argnums=(0, 1, 2))


@pytest.mark.parametrize("op,expected", [
    # forward all-gather of x; dx = reduce-scatter of dy @ w^T; dw and dbias are local
    ("ag", [("all-gather", (32, 16)), reduce_scatter(8, 16)]),
    # the backward's all-gather of dz (dx and dw use it); dbias sums dz's row shards. The forward's
    # reduce-scatter is dead code here: the loss is linear, so only gradients are live.
    ("rs", [("all-gather", (32, 24)), ("all-reduce", (24,))]),
])
def test_global_grads_fused_sharding_hlo(op, expected, normal, make_mesh, compiled_collectives):
  """With the gradients' shardings pinned to the inputs', the backward is the dual op and nothing more."""
  mesh, args, specs, grad = _fused_grad_setup(op, normal, make_mesh)
  f = jax.jit(grad, out_shardings=tuple(NamedSharding(mesh, s) for s in specs))
  assert sorted(compiled_collectives(f, *args)) == sorted(expected)


def test_global_ag_grad_keeps_x_sharding(normal, make_mesh, compiled_collectives):
  """Without out_shardings dx still comes back in x's layout (a sharding group with x, on every supported JAX): the
  backward reduce-scatters it."""
  mesh, args, specs, grad = _fused_grad_setup("ag", normal, make_mesh)
  f = jax.jit(grad)
  assert f(*args)[0].sharding.spec == P("tp", None)
  assert sorted(compiled_collectives(f, *args)) == [("all-gather", (32, 16)), reduce_scatter(8, 16)]


# Every layout the forward accepts (test_global.py), on a dp x tp mesh of either axis type (issue 15, item 5:
# Explicit meshes failed with ShardingTypeError: the weight gradient's dot_general had no out_sharding, and
# the cotangents came back in the plan's layout instead of the primal's).

LAYOUTS = [("ag", *c) for c in AG_SHARDINGS] + [("rs", *c) for c in RS_SHARDINGS]


@pytest.mark.parametrize("context", ["none", "set_mesh"])
@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
@pytest.mark.parametrize("op,name,x_shape,x_spec,w_spec,b_spec", LAYOUTS, ids=[f"{c[0]}-{c[1]}" for c in LAYOUTS])
def test_global_grads_dp_tp(op, name, x_shape, x_spec, w_spec, b_spec, axis_type, context, normal, make_mesh,
                            assert_close, capfd):
  """Also compiled under jax.set_mesh (issue 24, item 13): on an Explicit mesh the partitioned bodies were traced
  with the mesh's types, so a collective's reducer held sharding annotations, which XLA's CPU backend rejects
  ("Unsupported reduction computation", jax >= 0.11); compiled, no sharding annotation is left anywhere. And
  XLA reshards no result of a call by replicating it (no_involuntary_rematerialization)."""
  mesh = make_mesh((2, WORLD), ("dp", "tp"), getattr(jax.sharding.AxisType, axis_type))
  x, w, bias = normal(x_shape, np.float32), normal((16, 24), np.float32), normal((24,), np.float32)
  fn = jax_overlap.ag_matmul if op == "ag" else jax_overlap.matmul_rs
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in ((x, x_spec), (w, w_spec), (bias, b_spec))]
  f = jax.jit(jax.grad(lambda x, w, b: jnp.sum(jnp.sin(fn(x, w, b))), argnums=(0, 1, 2)))
  if context == "set_mesh":
    with jax.set_mesh(mesh):
      compiled = f.lower(*args).compile()
    assert 'custom_call_target="Sharding"' not in compiled.as_text()
    grads = compiled(*args)
  else:
    grads = f(*args)
  x64, w64, b64 = (a.astype(np.float64) for a in (x, w, bias))
  dy = np.cos(np.einsum("...k,kn->...n", x64, w64) + b64)
  want = (dy @ w64.T, x64.reshape(-1, 16).T @ dy.reshape(-1, 24), dy.reshape(-1, 24).sum(0))
  for what, g, r, a in zip(("dx", "dw", "dbias"), grads, want, args):
    assert_close(g, r, np.float32, int(np.prod(x_shape[:-1])), what=what)
    if axis_type == "Explicit":
      assert same_layout(g.sharding, a.sharding.spec), what
  no_involuntary_rematerialization(capfd)


# XLA's SPMD partitioner, when it cannot reshard a value from the sharding one op gives it to the one its user
# needs, replicates it on every device and slices it again, and says so on stderr (C++ logging, not Python's):
# the values stay right, the time and memory are lost. A call's results must come in the shardings its Shardy rule
# promised (issue 39, item 6: the gathered result of matmul_rs's backward, an ag_matmul, did not).
INVOLUNTARY = "Involuntary full rematerialization"


def no_involuntary_rematerialization(capfd):
  err = capfd.readouterr().err
  assert INVOLUNTARY not in err, err[err.index(INVOLUNTARY) - 200:][:1200]


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
@pytest.mark.parametrize("op,name,x_shape,x_spec,w_spec,b_spec", LAYOUTS, ids=[f"{c[0]}-{c[1]}" for c in LAYOUTS])
def test_gradients_on_a_2x2_mesh_reshard_nothing_by_replication(op, name, x_shape, x_spec, w_spec, b_spec,
                                                                axis_type, normal, make_mesh, capfd):
  """The layouts of test_global_grads_dp_tp on dp 2 x tp 2, compiled (their values are checked on 2 x 4)."""
  mesh = make_mesh((2, 2), ("dp", "tp"), getattr(jax.sharding.AxisType, axis_type))
  x, w, bias = normal(x_shape, np.float32), normal((16, 24), np.float32), normal((24,), np.float32)
  fn = jax_overlap.ag_matmul if op == "ag" else jax_overlap.matmul_rs
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in ((x, x_spec), (w, w_spec), (bias, b_spec))]
  capfd.readouterr()
  jax.jit(jax.grad(lambda x, w, b: jnp.sum(jnp.sin(fn(x, w, b))), argnums=(0, 1, 2))).lower(*args).compile()
  no_involuntary_rematerialization(capfd)


def test_global_ag_grad_uneven_columns(normal, make_mesh, assert_close):
  """Issue 15, item 4: N = 10 on 4 devices; the backward matmul_rs contracted the padded columns (7% off)."""
  mesh = make_mesh((WORLD,), ("tp",))
  uneven = lambda a, spec: jnp.cos(lax.with_sharding_constraint(a, NamedSharding(mesh, spec)))
  x, w, ct = normal((8, 16), np.float32), normal((16, 10), np.float32), normal((8, 10), np.float32)

  def loss(x, w):
    y = jax_overlap.ag_matmul(uneven(x, P("tp", None)), uneven(w, P(None, "tp")))
    return jnp.sum(y * uneven(ct, P(None, "tp")))

  dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
  x64, w64, ct64 = (a.astype(np.float64) for a in (x, w, ct))
  ct64 = np.cos(ct64)
  assert_close(dx, -np.sin(x64) * (ct64 @ np.cos(w64).T), np.float32, 10, what="dx")
  assert_close(dw, -np.sin(w64) * (np.cos(x64).T @ ct64), np.float32, 8, what="dw")


def test_grads_partially_manual_shard_map(normal, make_mesh, assert_close):
  """shard_map manual over 'tp' only (axis_names), with 'dp' left to the partitioner for a sharded batch."""
  mesh = make_mesh((2, WORLD), ("dp", "tp"))
  x = jax.device_put(normal((4, 8, 16), np.float32), NamedSharding(mesh, P("dp", "tp", None)))
  w, bias, ct = normal((16, 12), np.float32), normal((12,), np.float32), normal((4, 8, 12), np.float32)

  def grads(fn):
    f = jax.shard_map(fn, mesh=mesh, in_specs=(P(None, "tp", None), P(None, "tp"), P("tp")),
                      out_specs=P(None, None, "tp"), axis_names={"tp"})
    return jax.jit(jax.grad(lambda x, w, b: jnp.sum(f(x, w, b) * ct), argnums=(0, 1, 2)))(x, w, bias)

  got = grads(lambda x, w, b: jax_overlap.ag_matmul(x, w, b, axis_name="tp"))
  want = grads(lambda x, w, b: ref_ag(x, w, b, "tp"))
  for name, g, r in zip(("dx", "dw", "dbias"), got, want):
    assert_close(g, np.asarray(r, np.float64), np.float32, 32, what=name)


def test_grads_through_scan_over_layers(normal, make_mesh, assert_close):
  """A stack of ag_matmul -> relu -> matmul_rs layers under lax.scan, weights stacked along a leading axis."""
  mesh = make_mesh((WORLD,), ("tp",))
  x, ws = normal((16, 16), np.float32), normal((3, 16, 16), np.float32) * 0.25

  def grads(ag, rs):
    def body(x, ws):
      layer = lambda h, w: (rs(jax.nn.relu(ag(h, w)), w.T), None)
      return lax.scan(layer, x, ws)[0]
    f = jax.shard_map(body, mesh=mesh, in_specs=(P("tp", None), P(None, None, "tp")), out_specs=P("tp", None))
    return jax.jit(jax.grad(lambda x, ws: jnp.sum(jnp.sin(f(x, ws))), argnums=(0, 1)))(x, ws)

  got = grads(lambda h, w: jax_overlap.ag_matmul(h, w, axis_name="tp"),
              lambda h, w: jax_overlap.matmul_rs(h, w, axis_name="tp"))
  want = grads(lambda h, w: ref_ag(h, w, None, "tp"), lambda h, w: ref_rs(h, w, None, "tp"))
  for name, g, r in zip(("dx", "dws"), got, want):
    assert_close(g, np.asarray(r, np.float64), np.float32, 64, what=name)
