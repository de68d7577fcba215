"""What every scenario's worker shares: its mesh, the result record, and helpers to shard and check."""

from __future__ import annotations

import json

import numpy as np

WATCHDOG_SECONDS = 20.0
DEATH_WATCHDOG_SECONDS = 3.0
_GELU_C = (2 / np.pi) ** 0.5


def gelu(x):
  """jax.nn.gelu (tanh approximation) in float64."""
  return 0.5 * x * (1 + np.tanh(_GELU_C * (x + 0.044715 * x ** 3)))


def gelu_grad(x):
  c = _GELU_C
  t = np.tanh(c * (x + 0.044715 * x ** 3))
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)


def recorded_error(jo) -> str | None:
  """The error this process's GPUs recorded (check_errors' PeerTimeoutError), or None."""
  try:
    jo.check_errors()
    return None
  except jo.PeerTimeoutError as e:
    return str(e)


def all_nan(a) -> bool:
  return bool(np.all(np.isnan(np.asarray(a).astype(np.float32))))


class Ctx:
  """One worker: rank `rank` of `world` processes, one device each, on the mesh ("tp",)."""

  def __init__(self, rank: int, world: int, scenario: str, out_path: str):
    import jax
    from jax.sharding import Mesh

    self.rank, self.world, self.out_path = rank, world, out_path
    self.res = {"rank": rank, "world": world, "scenario": scenario, "checks": {}, "ok": True}
    self.mesh = Mesh(np.array(jax.devices()), ("tp",))
    self.dev = jax.local_devices()[0]
    self.rng = np.random.default_rng(1234)  # same data on every rank

  def check(self, name: str, ok, detail: str = "") -> None:
    self.res["checks"][name] = {"ok": bool(ok), "detail": detail}
    self.res["ok"] &= bool(ok)
    with open(self.out_path, "w") as fh:  # after every check: a later crash keeps what passed
      json.dump(self.res, fh)

  def shard(self, full, spec):
    """Global array from the full host array: this process contributes its shard."""
    import jax
    from jax.sharding import NamedSharding

    sharding = NamedSharding(self.mesh, spec)
    index = sharding.addressable_devices_indices_map(full.shape)[self.dev]
    return jax.make_array_from_single_device_arrays(full.shape, sharding, [jax.device_put(full[index], self.dev)])

  @staticmethod
  def local(a):
    return np.asarray(a.addressable_shards[0].data)

  def ag_fn(self, algorithm: str, bias: bool = False, lead: int = 0, name: str | None = None):
    """jit(shard_map(ag_matmul with the gathered x)) over ("tp",): x rows and w columns sharded. `name` names its
    program (jit_<name>), and with it its call site: programs named alike are the same call site."""
    import jax
    from jax.sharding import PartitionSpec as P

    import jax_overlap as jo

    none = (None,) * lead
    body = (lambda x, w, b: jo.ag_matmul(x, w, b, axis_name="tp", algorithm=algorithm, return_gathered=True)) if bias \
        else (lambda x, w: jo.ag_matmul(x, w, axis_name="tp", algorithm=algorithm, return_gathered=True))
    if name is not None:
      body.__name__ = body.__qualname__ = name
    in_specs = (P(*none, "tp"), P(None, "tp")) + ((P("tp"),) if bias else ())
    return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=in_specs,
                                 out_specs=(P(*none, None, "tp"), P(*none, "tp"))))

  def rs_fn(self, algorithm: str, bias: bool = False, lead: int = 0):
    """jit(shard_map(matmul_rs)) over ("tp",): x's contraction and w's rows sharded, rows scattered."""
    import jax
    from jax.sharding import PartitionSpec as P

    import jax_overlap as jo

    none = (None,) * lead
    body = (lambda x, w, b: jo.matmul_rs(x, w, b, axis_name="tp", algorithm=algorithm)) if bias \
        else (lambda x, w: jo.matmul_rs(x, w, axis_name="tp", algorithm=algorithm))
    in_specs = (P(*none, None, "tp"), P("tp", None)) + ((P(),) if bias else ())
    return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=P(*none, "tp", None)))
