"""Flax models on jax_overlap through one argument per layer (AgDotGeneral / RsDotGeneral as dot_general):
forward and gradients against the same model with lax.dot_general, on Auto and Explicit dp x tp meshes.

The block: multi-head attention (QKV kernels [E, H, D] sharded on the heads, output kernel [H, D, E]), then a
gated MLP (kernel [E, 2, F] sharded on F, then [F, E]); the activations are sequence-sharded on 'tp' between
the layers and batch-sharded on 'dp'.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap
from test_remat import count

flax = pytest.importorskip("flax", reason="the flax layer tests need flax (pip install '.[examples]')")
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

B, S, E, H, F = 4, 8, 16, 4, 32
X_SPEC = P("dp", "tp", None)
# (layer, param) -> spec; key and value share the query's.
SPECS = {("query", "kernel"): P(None, "tp", None), ("query", "bias"): P("tp", None),
         ("out", "kernel"): P("tp", None, None), ("out", "bias"): P(),
         ("up", "kernel"): P(None, None, "tp"), ("up", "bias"): P(None, "tp"),
         ("down", "kernel"): P("tp", None), ("down", "bias"): P()}


def _spec(path, _):
  names = [str(p.key) for p in path if hasattr(p, "key")]
  layer = names[-2] if names[-2] not in ("key", "value") else "query"
  return SPECS[(layer, names[-1])]


def _dots(lib: bool, **kw):
  """(qkv/column-parallel, output/row-parallel) dot_generals."""
  if not lib:
    return None, None
  return jax_overlap.AgDotGeneral(**kw), jax_overlap.RsDotGeneral(**kw)


class LinenBlock(nn.Module):
  lib: bool

  @nn.compact
  def __call__(self, x):
    ag, rs = _dots(self.lib)
    x = x + nn.MultiHeadDotProductAttention(num_heads=H, qkv_dot_general=ag, out_dot_general=rs)(x)
    g = nn.DenseGeneral((2, F), dot_general=ag, name="up")(x)
    return x + nn.Dense(E, dot_general=rs, name="down")(nn.silu(g[..., 0, :]) * g[..., 1, :])


class NnxBlock(nnx.Module):
  def __init__(self, lib: bool, rngs):
    ag, rs = _dots(lib)
    kw = {} if not lib else dict(qkv_dot_general=ag, out_dot_general=rs)
    self.attn = nnx.MultiHeadAttention(num_heads=H, in_features=E, decode=False, rngs=rngs, **kw)
    self.up = nnx.LinearGeneral(E, (2, F), dot_general=ag or jax.lax.dot_general, rngs=rngs)
    self.down = nnx.Linear(F, E, dot_general=rs or jax.lax.dot_general, rngs=rngs)

  def __call__(self, x, out_sharding=None):
    x = x + self.attn(x)
    g = self.up(x)
    return x + self.down(nnx.silu(g[..., 0, :]) * g[..., 1, :], out_sharding=out_sharding)


def _mesh(make_mesh, axis_type):
  return make_mesh((2, 4), ("dp", "tp"), getattr(jax.sharding.AxisType, axis_type))


def _compare(got, want, assert_close):
  """Every leaf of got against want (float32 models, float64 comparison), each at the scale of its values.

  A leaf whose value cancels to zero (the key bias: softmax ignores a shift shared by a query's logits) keeps
  the rounding error of its terms, so no scale is taken below a hundredth of the largest leaf's.
  """
  flat_got, flat_want = jax.tree.leaves(got), [np.asarray(r, np.float64) for r in jax.tree.leaves(want)]
  assert len(flat_got) == len(flat_want)
  rms = [float(np.sqrt(np.mean(r ** 2))) for r in flat_want]
  for g, r, scale in zip(flat_got, flat_want, rms):
    assert_close(g, r, np.float32, 64, scale=max(scale, 1e-2 * max(rms)))


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_linen_block(axis_type, make_mesh, assert_close):
  mesh = _mesh(make_mesh, axis_type)
  x = jax.random.normal(jax.random.key(0), (B, S, E))
  params = LinenBlock(lib=False).init(jax.random.key(1), x)
  sharded = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params,
                         jax.tree_util.tree_map_with_path(_spec, params))
  loss = lambda lib: jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(jnp.sin(LinenBlock(lib=lib).apply(p, x)))))
  got = loss(True)(sharded, jax.device_put(x, NamedSharding(mesh, X_SPEC)))
  want = loss(False)(params, x)
  _compare(got, want, assert_close)
  for g, p in zip(jax.tree.leaves(got[1]), jax.tree.leaves(sharded)):  # gradients keep the parameters' layout
    assert g.sharding.is_equivalent_to(p.sharding, p.ndim)
  forward = jax.make_jaxpr(LinenBlock(lib=True).apply)(params, x).jaxpr
  # query, key, value and up; out and down
  assert (count(forward, "jax_overlap_ag_matmul"), count(forward, "jax_overlap_matmul_rs")) == (4, 2)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_nnx_block(axis_type, make_mesh, assert_close):
  """Compiled under jax.set_mesh: on an Explicit mesh the partitioned bodies used to carry the mesh's types into
  their collectives' reducers, which XLA's CPU backend rejects ("Unsupported reduction computation", jax >= 0.11)."""
  mesh = _mesh(make_mesh, axis_type)
  x = jax.random.normal(jax.random.key(0), (B, S, E))
  reference, model = NnxBlock(False, nnx.Rngs(0)), NnxBlock(True, nnx.Rngs(0))
  graph, state = nnx.split(model)
  state = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), state,
                       jax.tree_util.tree_map_with_path(_spec, state))
  model = nnx.merge(graph, state)
  out_spec = X_SPEC if axis_type == "Explicit" else None  # Explicit-mode code names its output layouts

  with jax.set_mesh(mesh):
    loss = lambda m, x: jnp.sum(jnp.sin(m(x, out_sharding=out_spec)))
    got_value, got_grads = nnx.jit(nnx.value_and_grad(loss))(model, jax.device_put(x, NamedSharding(mesh, X_SPEC)))
  want_value, want_grads = nnx.jit(nnx.value_and_grad(lambda m, x: jnp.sum(jnp.sin(m(x)))))(reference, x)
  _compare((got_value, nnx.state(got_grads)), (want_value, nnx.state(want_grads)), assert_close)
  for g, p in zip(jax.tree.leaves(nnx.state(got_grads)), jax.tree.leaves(state)):
    assert g.sharding.is_equivalent_to(p.sharding, p.ndim)


def test_linen_dense_in_shard_map(make_mesh, assert_close):
  """Inside shard_map the layers are the ops themselves: Dense gathers the sequence, then reduce-scatters it."""
  mesh = make_mesh((4,), ("tp",))
  ag, rs = _dots(True, axis_name="tp")

  class Mlp(nn.Module):
    lib: bool
    ffn: int = F  # this rank's columns inside shard_map

    @nn.compact
    def __call__(self, x):
      h = nn.gelu(nn.Dense(self.ffn, dot_general=ag if self.lib else None, name="up")(x))
      return nn.Dense(E, dot_general=rs if self.lib else None, name="down")(h)

  x = jax.random.normal(jax.random.key(0), (B, S, E))
  params = Mlp(False).init(jax.random.key(1), x)
  specs = {"params": {"up": {"kernel": P(None, "tp"), "bias": P("tp")},
                      "down": {"kernel": P("tp", None), "bias": P()}}}
  local = jax.shard_map(lambda p, x: Mlp(True, F // 4).apply(p, x), mesh=mesh, in_specs=(specs, P(None, "tp", None)),
                        out_specs=P(None, "tp", None))
  loss = lambda f: jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(jnp.sin(f(p, x)))))
  got, want = loss(local)(params, x), loss(Mlp(False).apply)(params, x)
  _compare(got, want, assert_close)
