"""One process of a two-process jax.distributed job on CPU whose collectives really run (gloo).

  python tests/gloo_worker.py --rank R --port P --out FILE     (tests/test_multiprocess_cpu.py starts both)

Each process has 4 CPU devices; the mesh is (dp 2, tp 4) with dp across the
processes and tp inside each, so tp's collectives stay in a process and dp's
(the gradients' sums over the data axis) cross them. Every case computes on the
XLA path (a CPU has no GPU algorithm), checks this process's shards of the
result against a float64 NumPy reference of the whole computation, and records
the largest error relative to the reference's largest value.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _TESTS)

import jax_overlap as jo  # noqa: E402

B, S, D, F = 4, 64, 32, 128  # batch (dp), sequence (tp), model and ffn dims


def _inputs():
  rng = np.random.default_rng(0)  # the same on both processes
  return (rng.standard_normal((B, S, D)), rng.standard_normal((D, F)) / np.sqrt(D),
          rng.standard_normal((F, D)) / np.sqrt(F), rng.standard_normal((B, S, D)))


def _reference(x, w1, w2, dz):
  """z = gelu(x @ w1) @ w2 and the gradients of sum(z * dz) in float64."""
  h = x @ w1
  g = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))  # jax.nn.gelu's tanh form
  z = g @ w2
  dg = dz @ w2.T
  t = np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3))
  dh = dg * (0.5 * (1 + t) + 0.5 * h * (1 - t ** 2) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * h ** 2))
  return z, np.einsum("bsd,bsf->df", x, dh), np.einsum("bsf,bsd->fd", g, dz), dh @ w1.T


def _error(got, want) -> float:
  """The largest error of this process's shards of `got` against `want`, relative to want's largest value."""
  worst = 0.0
  for shard in got.addressable_shards:
    worst = max(worst, float(np.max(np.abs(np.asarray(shard.data, np.float64) - want[shard.index]))))
  return worst / float(np.max(np.abs(want)))


def _put(mesh, a, spec):
  """The global array of `a` laid out by `spec`, from this process's shards (every process holds all of `a`)."""
  sharding = NamedSharding(mesh, spec)
  return jax.make_array_from_callback(a.shape, sharding, lambda index: np.asarray(a[index], np.float32))


def run(rank: int, port: int) -> dict:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
  devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id))).reshape(2, 4)
  mesh = jax.sharding.Mesh(devices, ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  x, w1, w2, dz = _inputs()
  want = _reference(x, w1, w2, dz)
  args = (_put(mesh, x, P("dp", "tp", None)), _put(mesh, w1, P(None, "tp")), _put(mesh, w2, P("tp", None)),
          _put(mesh, dz, P("dp", "tp", None)))
  results = {}

  def shard_map_mlp(x, w1, w2):
    h = jax.nn.gelu(jo.ag_matmul(x, w1, axis_name="tp"))
    return jo.matmul_rs(h, w2, axis_name="tp")

  def global_mlp(x, w1, w2):
    h = jax.nn.gelu(jo.ag_matmul(x, w1))
    return jo.matmul_rs(h, w2, out_sharding=NamedSharding(mesh, P("dp", "tp", None)))

  def layer_mlp(x, w1, w2):  # the Flax-style layers: dot_generals on global arrays
    dn = (((2,), (0,)), ((), ()))
    h = jax.nn.gelu(jo.AgDotGeneral()(x, w1, dn))
    z = jo.RsDotGeneral()(h, w2, dn)
    return jax.lax.with_sharding_constraint(z, NamedSharding(mesh, P("dp", "tp", None)))

  mlps = {"shard_map": jax.shard_map(shard_map_mlp, mesh=mesh, in_specs=(P("dp", "tp"), P(None, "tp"), P("tp")),
                                     out_specs=P("dp", "tp")),
          "global": global_mlp, "layers": layer_mlp}
  for name, mlp in mlps.items():
    def loss(x, w1, w2, dz):
      return jnp.sum(mlp(x, w1, w2) * dz)
    z = jax.jit(mlp)(*args[:3])
    dx, dw1, dw2 = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    results[name] = {"z": _error(z, want[0]), "dw1": _error(dw1, want[1]), "dw2": _error(dw2, want[2]),
                     "dx": _error(dx, want[3]), "processes": sorted({d.process_index for d in z.sharding.device_set})}
  jax.distributed.shutdown()
  return results


if __name__ == "__main__":
  parser = argparse.ArgumentParser()
  parser.add_argument("--rank", type=int, required=True)
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--out", required=True)
  cli = parser.parse_args()
  with open(cli.out, "w") as f:
    json.dump(run(cli.rank, cli.port), f)
