"""One process of a two-process jax.distributed job on CPU that lowers calls for "cuda" as two hosts would.

  python tests/two_hosts.py --rank R --port P --out FILE     (tests/test_decisions.py starts both)

Each process has 4 CPU devices, a FakeNative (tests/fake_gpu.py) for its GPUs
and a host of its own ("host-0", "host-1"); the key-value store, barriers and
agreements are jax.distributed's own. Each scenario makes the processes differ
(timings, a failing set-up step, a process that lowers a program once more),
lowers the same programs on both, and records per process what they lowered
(the custom calls), the errors raised, whether the workspace was set up, and
how long it took; test_decisions.py compares the two processes' records.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_TESTS), _TESTS]  # this checkout's jax_overlap, as pytest imports it
import fake_gpu  # noqa: E402

import jax_overlap as jo  # noqa: E402
from jax_overlap import _compat  # noqa: E402
from jax_overlap.runtime import processes, workspace  # noqa: E402

# A bound on every wait for the other process (a stalled collective step shows as this long, or its error).
KV_TIMEOUT_MS = 20_000
# Per-rank GEMM rows, k and n of the calls: with the model GPU, overlapping the transfer pays (pipelined), unless
# a process's GEMMs are 100 times slower (then chunking only costs).
ROWS, K, N = 4096, 8192, 2048


def _custom_calls(text: str) -> list:
  return [line.strip() for line in text.splitlines() if "stablehlo.custom_call @jax_overlap" in line]


def _tp_fn(op: str, mesh: Mesh, algorithm: str, name: str, scale=None):
  fn = getattr(jo, op)
  specs = {"ag_matmul": (P("tp"), P(None, "tp"), P(None, "tp")), "matmul_rs": (P(None, "tp"), P("tp"), P("tp"))}
  x_spec, w_spec, out_spec = specs[op]

  def body(x, w):  # with a scale, another program of the same name
    return fn(x if scale is None else x * scale, w, axis_name="tp", algorithm=algorithm)

  body.__name__ = body.__qualname__ = name  # the module's name: jit_<name>
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec)), (x_spec, w_spec)


def _operands(op: str, world: int, mesh: Mesh, specs, sharded: bool = True):
  shapes = {"ag_matmul": ((world * ROWS, K), (K, world * N)), "matmul_rs": ((ROWS, world * K), (world * K, N))}
  return [jax.ShapeDtypeStruct(shape, np.dtype("bfloat16"),
                               sharding=NamedSharding(mesh, spec) if sharded else None)
          for shape, spec in zip(shapes[op], specs)]


def _lower(op: str, mesh: Mesh, algorithm: str, name: str = "layer", sharded: bool = True, scale=None) -> list:
  f, specs = _tp_fn(op, mesh, algorithm, name, scale)
  return _custom_calls(f.trace(*_operands(op, mesh.shape["tp"], mesh, specs, sharded)).lower(
      lowering_platforms=("cuda",)).as_text())


def _attempt(record: dict, what: str, lower) -> None:
  try:
    record["calls"][what] = lower()
  except Exception as e:  # recorded for the parent, which says what each process must have raised
    record["errors"][what] = f"{type(e).__name__}: {e}"


def scenario(name: str, rank: int, fake, meshes) -> dict:
  local, spanning = meshes
  record = {"calls": {}, "errors": {}}
  if name == "hosts":  # tp across the two hosts: nothing to set up, the XLA path on both
    _attempt(record, "auto", lambda: _lower("ag_matmul", spanning, "auto"))
    _attempt(record, "pipelined", lambda: _lower("ag_matmul", spanning, "pipelined"))
  elif name == "figures":  # process 1's GEMMs time 100 times slower: alone it would take the XLA path
    fake.gemm_scale = 100.0 if rank == 1 else 1.0
    for op in ("ag_matmul", "matmul_rs"):
      _attempt(record, op, lambda op=op: _lower(op, local, "auto"))
  elif name == "inspect":  # process 0 alone lowers the program once more first, as to look at its HLO
    if rank == 0:
      _attempt(record, "inspected", lambda: _lower("ag_matmul", local, "auto", sharded=False))
    _attempt(record, "layer", lambda: _lower("ag_matmul", local, "auto"))
    _attempt(record, "other", lambda: _lower("ag_matmul", local, "auto", name="other"))
  elif name == "programs":  # two programs of one name, lowered in opposite orders by the two processes
    for scale in ((2.0, 3.0) if rank == 0 else (3.0, 2.0)):
      _attempt(record, f"times {scale}", lambda scale=scale: _lower("ag_matmul", local, "auto", scale=scale))
  elif name.startswith(("blas", "oom")):  # one step fails on one process: no vendor BLAS, or no memory for the workspace
    failing = 0 if name.endswith("_leader") else 1
    fake.fail = ({"prepare_vendor_blas"} if name.startswith("blas") else {"allocate_workspace"}) if rank == failing \
        else set()
    # The explicit call first: it measures the figures, whose measurement process 0 must not skip.
    _attempt(record, "pipelined", lambda: _lower("ag_matmul", local, "pipelined", name="explicit"))
    _attempt(record, "auto", lambda: _lower("ag_matmul", local, "auto"))
  elif name == "tuning":  # each process would choose its own GEMM algorithms: both run process 0's
    fake.choice_salt = rank
    fake.tuned, fake.installed = [], []
    _attempt(record, "auto", lambda: _lower("ag_matmul", local, "auto"))
    record["tuned"], record["installed"] = fake.tuned, fake.installed
  record["active"] = workspace.is_active()
  return record


SCENARIOS = ("hosts", "figures", "inspect", "programs", "blas", "blas_leader", "oom", "oom_leader", "tuning")


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--rank", type=int, required=True)
  ap.add_argument("--port", type=int, required=True)
  ap.add_argument("--out", required=True)
  args = ap.parse_args()
  # The processes only lower: no collectives between them, and none of gloo's need of a resolvable host name.
  jax.config.update("jax_cpu_collectives_implementation", None)
  jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=2, process_id=args.rank)
  processes._KV_TIMEOUT_MS = KV_TIMEOUT_MS
  fake = fake_gpu.FakeNative()
  fake_gpu.install(setattr, fake, host=f"host-{args.rank}")
  devices = np.array(jax.devices())  # process 0's 4 devices, then process 1's
  meshes = (Mesh(devices.reshape(2, 4), ("dp", "tp")), Mesh(devices.reshape(8), ("tp",)))
  client = _compat.kv_client()
  results = {}
  for name in SCENARIOS:
    client.wait_at_barrier(f"two_hosts/{name}", 60_000)  # both start together: the time is the scenario's own
    t0 = time.monotonic()
    results[name] = scenario(name, args.rank, fake, meshes)
    results[name]["seconds"] = time.monotonic() - t0
    results[name]["setup_failed"] = workspace.setup_failed() if hasattr(workspace, "setup_failed") else None
    jo.shutdown()
    jax.clear_caches()
    fake.fail, fake.gemm_scale = set(), 1.0
  with open(args.out, "w") as fh:
    json.dump(results, fh)


if __name__ == "__main__":
  main()
