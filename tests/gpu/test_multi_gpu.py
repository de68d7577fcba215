"""One process driving every local GPU (2 or more): the fused and pipelined ops across real peer links.

One SPMD executable serves all local GPUs, so per-call state must bind per
device (a shared binding made every GPU act as the same rank: regression).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_overlap as jo
from gpu_util import random
from tolerance import assert_close, rms

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not jo.gpu_available() or len(jax.devices()) < 2,
                                 reason="needs 2 or more GPUs visible to this process")]


def _mesh():
  return Mesh(np.array(jax.devices()[:8]), ("tp",))


def test_all_gather_exact():
  mesh = _mesh()
  t = mesh.shape["tp"]
  x = jnp.asarray(np.random.default_rng(0).standard_normal((t * 64, 256)), jnp.float32)
  f = jax.jit(jax.shard_map(lambda x: jo.all_gather(x, axis_name="tp")[None], mesh=mesh, in_specs=P("tp"),
                            out_specs=P("tp")))
  np.testing.assert_array_equal(np.asarray(f(x)), np.broadcast_to(np.asarray(x), (t, *x.shape)))


ALGORITHMS = ["fused", "pipelined"]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_ag_matmul_and_matmul_rs(dtype, algorithm):
  mesh = _mesh()
  t = mesh.shape["tp"]
  rng = np.random.default_rng(1)
  x, w = random(rng, (2, t * 200, 1024), dtype), random(rng, (1024, t * 384), dtype, 1 / 32)
  ag = jax.jit(jax.shard_map(lambda x, w: jo.ag_matmul(x, w, axis_name="tp", algorithm=algorithm), mesh=mesh,
                             in_specs=(P(None, "tp"), P(None, "tp")), out_specs=P(None, None, "tp")))
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  assert_close(ag(x, w), want, dtype, 1024, 1 / 32)
  h, w2 = random(rng, (2, t * 96, t * 256), dtype), random(rng, (t * 256, 512), dtype, 1 / 32)
  rs = jax.jit(jax.shard_map(lambda h, w: jo.matmul_rs(h, w, axis_name="tp", algorithm=algorithm), mesh=mesh,
                             in_specs=(P(None, None, "tp"), P("tp", None)), out_specs=P(None, "tp")))
  z1, z2 = rs(h, w2), rs(h, w2)
  assert_close(z1, np.asarray(h, np.float64) @ np.asarray(w2, np.float64), dtype, t * 256, 1 / 32)
  np.testing.assert_array_equal(np.asarray(z1).view(np.uint16), np.asarray(z2).view(np.uint16))


def _meshes_2d():
  n = min(len(jax.devices()), 8)
  shapes = sorted({(n // 2, 2), (2, n // 2)}) if n >= 2 else []
  return [Mesh(np.array(jax.devices()[:n]).reshape(s), ("dp", "tp")) for s in shapes]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("mesh", _meshes_2d(), ids=lambda m: f"dp{m.shape['dp']}xtp{m.shape['tp']}")
def test_tp_mlp_grads_on_dp_tp_mesh(mesh, algorithm):
  """A dp x tp mesh: groups along tp only, batch split over dp; grads vs the XLA path's."""
  dp, tp = mesh.shape["dp"], mesh.shape["tp"]
  rng = np.random.default_rng(2)
  x = random(rng, (dp * 2, tp * 128, 512), jnp.bfloat16)
  w1, w2 = random(rng, (512, tp * 256), jnp.bfloat16, 1 / 22), random(rng, (tp * 256, 512), jnp.bfloat16, 1 / 16)

  def loss(algorithm):
    def body(x, w1, w2):
      h = jax.nn.gelu(jo.ag_matmul(x, w1, axis_name="tp", algorithm=algorithm))
      y = jo.matmul_rs(h, w2, axis_name="tp", algorithm=algorithm)
      return jax.lax.psum(jnp.sum(y.astype(jnp.float32) ** 2), ("dp", "tp"))[None]
    f = jax.shard_map(body, mesh=mesh, in_specs=(P("dp", "tp"), P(None, "tp"), P("tp", None)), out_specs=P(None))
    return jax.jit(jax.value_and_grad(lambda *a: f(*a)[0], argnums=(0, 1, 2)))

  (l_f, g_f), (l_x, g_x) = loss(algorithm)(x, w1, w2), loss("xla")(x, w1, w2)
  assert abs(float(l_f) - float(l_x)) < 2e-2 * abs(float(l_x))
  for name, a, b in zip(("dx", "dw1", "dw2"), g_f, g_x):  # three rounded stages, as in test_mlp
    assert_close(a, b, jnp.bfloat16, 1, 3 * rms(b), name)
