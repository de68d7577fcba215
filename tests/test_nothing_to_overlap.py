"""A layer whose shardings give its op nothing to gather or scatter (the roles swapped: AgDotGeneral on a kernel
sharded on its contraction, RsDotGeneral on one sharded on its output) says so once at INFO, and stays right."""

import logging

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap
from jax_overlap.integration import partitioning

SWAPPED = [("AgDotGeneral", P(None, "tp"), P("tp", None), "none of w's output dims is sharded"),
           ("RsDotGeneral", P("tp", None), P(None, "tp"), "the contraction is not sharded")]


@pytest.mark.parametrize("layer, x_spec, w_spec, why", SWAPPED, ids=[s[0] for s in SWAPPED])
def test_swapped_roles_are_said_once_at_info(layer, x_spec, w_spec, why, make_mesh, normal, caplog):
  partitioning._nothing_to_overlap.cache_clear()  # said once per process: earlier tests may have said it
  mesh = make_mesh((4,), ("tp",))
  dot = getattr(jax_overlap, layer)()
  x, w = normal((16, 32), "float32"), normal((32, 24), "float32")
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), (x_spec, w_spec))]
  dn = (((1,), (0,)), ((), ()))
  with caplog.at_level(logging.INFO, logger="jax_overlap"):
    for scale in (1.0, 2.0):  # two programs: the second is not said again
      y = jax.jit(lambda x, w: dot(x * scale, w, dn))(*args)
      np.testing.assert_allclose(y, (x * scale) @ w, rtol=1e-5, atol=1e-4)
  said = [r for r in caplog.records if r.levelno == logging.INFO and "nothing to gather or scatter" in r.message]
  assert len(said) == 1 and why in said[0].message, caplog.text


def test_a_mesh_of_one_device_is_not_said(make_mesh, normal, caplog):
  mesh = make_mesh((1,), ("tp",))
  x, w = normal((16, 32), "float32"), normal((32, 24), "float32")
  args = [jax.device_put(a, NamedSharding(mesh, P())) for a in (x, w)]
  with caplog.at_level(logging.INFO, logger="jax_overlap"):
    jax.jit(lambda x, w: jax_overlap.ag_matmul(x, w))(*args).block_until_ready()
  assert "nothing to gather" not in caplog.text
