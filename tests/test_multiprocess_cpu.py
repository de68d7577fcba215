"""Two jax.distributed processes of 4 CPU devices each, whose collectives really run (gloo): data parallel across
the processes, tensor parallel inside each (tests/gloo_worker.py). Both ops inside shard_map and on global arrays,
and the layers' gradients, against float64 on every process's shards.

XLA's NCCL refuses two ranks on one GPU, so this is where the XLA path across processes is tested; the GPU
algorithms across processes run under MPS on the device machine (tests/gpu/multiprocess.py).
"""

import json
import os
import socket
import subprocess
import sys

import pytest


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("gloo")
  script = os.path.join(os.path.dirname(__file__), "gloo_worker.py")
  port = _free_port()
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  procs = [subprocess.Popen([sys.executable, script, "--rank", str(r), "--port", str(port), "--out",
                             str(tmp / f"{r}.json")], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
           for r in range(2)]
  logs = [p.communicate(timeout=600)[0].decode()[-3000:] for p in procs]
  for r, p in enumerate(procs):
    hint = ("\n(gloo resolves this machine's hostname: add it to /etc/hosts)"
            if "gloo/transport/tcp/device.cc" in logs[r] else "")
    assert p.returncode == 0, f"process {r}:\n{logs[r]}{hint}"
  return [json.loads((tmp / f"{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("mode", ["shard_map", "global", "layers"])
def test_values_and_gradients_across_processes(records, mode):
  # float32 products of sums over K = 32 and F = 128 against float64: a few float32 ulps of the largest value
  for rank, record in enumerate(records):
    errors = record[mode]
    assert errors["processes"] == [0, 1], f"process {rank}: the result spans processes {errors['processes']}"
    for what in ("z", "dx", "dw1", "dw2"):
      assert errors[what] < 1e-5, f"process {rank}, {mode}: {what} off float64 by {errors[what]:.2e} (relative)"
