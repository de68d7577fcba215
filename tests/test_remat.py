"""jax.checkpoint policies: the ops' results behave like dot outputs and carry checkpoint names (remat.py).

The count that matters is how many times the backward pass runs each op: with
the results saved, ag_matmul runs twice (its forward, and matmul_rs's backward)
and matmul_rs twice (its forward, and ag_matmul's backward); recomputing
ag_matmul's forward makes three. Counted in the gradient's jaxpr, through every
sub-jaxpr (custom partitioning bodies included).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap
from jax_overlap import remat

POLICIES = jax.checkpoint_policies
WORLD = 4


def count(jaxpr, name: str, grouped=None) -> int:
  """Equations of primitive `name` in jaxpr and every jaxpr inside its equations' params; grouped True (False):
  only those over a group of ranks (a group of one's, axis_name None)."""
  n = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == name:
      n += grouped is None or grouped == (eqn.params["axis_name"] is not None)
    n += sum(count(sub, name, grouped) for sub in jex_core.jaxprs_in_params(eqn.params))
  return n


def _mlp(axis_name):
  def mlp(x, w1, w2):
    return jax_overlap.matmul_rs(jax.nn.gelu(jax_overlap.ag_matmul(x, w1, axis_name=axis_name)), w2,
                                 axis_name=axis_name)
  return mlp


def _grad(mode, policy, mesh):
  if mode == "global":
    f = _mlp(None)
  else:
    f = jax.shard_map(_mlp("tp"), mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), P("tp")),
                      out_specs=P(None, "tp"))
  if policy is not None:
    f = jax.checkpoint(f, policy=policy)
  return jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2))


CASES = [
    ("no_checkpoint", None, 2),
    ("nothing_saveable", POLICIES.nothing_saveable, 3),
    ("dots_saveable", POLICIES.dots_saveable, 2),
    ("dots_with_no_batch_dims_saveable", POLICIES.dots_with_no_batch_dims_saveable, 2),
    ("checkpoint_dots", POLICIES.checkpoint_dots, 2),
    ("save_only_these_names", POLICIES.save_only_these_names(*remat.NAMES), 2),
    # y alone: the backward still needs ag_matmul's gathered x, so it runs the op again
    ("save_only_y", POLICIES.save_only_these_names(remat.AG_OUTPUT, remat.RS_OUTPUT), 3),
    ("offload_names", POLICIES.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=remat.NAMES, offload_src="device",
        offload_dst="pinned_host"), 2),
    ("offload_dots", POLICIES.offload_dot_with_no_batch_dims("device", "pinned_host"), 2),
]


@pytest.mark.parametrize("mode", ["global", "shard_map"])
@pytest.mark.parametrize("name,policy,ag_runs", CASES, ids=[c[0] for c in CASES])
def test_backward_recomputes_only_what_the_policy_drops(name, policy, ag_runs, mode, make_mesh):
  mesh = make_mesh((WORLD,), ("tp",))
  args = (jnp.ones((2, 8, 16)), jnp.ones((16, 32)), jnp.ones((32, 16)))
  jaxpr = jax.make_jaxpr(_grad(mode, policy, mesh))(*args).jaxpr
  assert count(jaxpr, "jax_overlap_ag_matmul") == ag_runs
  assert count(jaxpr, "jax_overlap_matmul_rs") == 2  # its output is the checkpointed function's: never rerun
  offloads = count(jaxpr, "device_put")
  assert (offloads > 0) == name.startswith("offload"), offloads


@pytest.mark.parametrize("policy", ["dots_saveable", "nothing_saveable"])
def test_values_under_checkpoint(policy, normal, make_mesh, assert_close):
  """Saving or recomputing changes nothing in the gradients (global arrays, fused shardings)."""
  mesh = make_mesh((WORLD,), ("tp",))
  x, w1, w2 = normal((2, 8, 16), np.float32), normal((16, 32), np.float32), normal((32, 16), np.float32)
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in ((x, P(None, "tp")), (w1, P(None, "tp")),
                                                                  (w2, P("tp", None)))]
  got = jax.jit(_grad("global", getattr(POLICIES, policy), mesh))(*args)
  want = jax.jit(_grad("global", None, mesh))(*args)
  for name, g, r in zip(("dx", "dw1", "dw2"), got, want):
    assert_close(g, np.asarray(r, np.float64), np.float32, 64, what=name)


def test_names_are_in_the_jaxpr():
  x, w = jnp.ones((8, 16)), jnp.ones((16, 8))
  text = str(jax.make_jaxpr(lambda x, w: jax_overlap.ag_matmul(x, w, return_gathered=True))(x, w))
  assert "jax_overlap_tag[name=jax_overlap.ag_matmul]" in text
  assert "jax_overlap_tag[name=jax_overlap.ag_matmul.gathered]" in text
  text = str(jax.make_jaxpr(lambda x, w: jax_overlap.matmul_rs(x, w))(x, w))
  assert "jax_overlap_tag[name=jax_overlap.matmul_rs]" in text
