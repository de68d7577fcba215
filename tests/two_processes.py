"""Two jax.distributed processes on this machine: a worker script run as ranks 0 and 1 (a coordinator port
free here), each writing its records as JSON; the records, or an assertion error with the failing process's log."""

import json
import os
import socket
import subprocess
import sys


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run(script: str, tmp) -> list:
  """Runs tests/`script` --rank r --port P --out tmp/r.json for r = 0, 1 (without this process's XLA_FLAGS and
  JAX_PLATFORMS: the worker sets its own devices) and returns both records."""
  port = _free_port()
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  procs = [subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), script), "--rank", str(r),
                             "--port", str(port), "--out", str(tmp / f"{r}.json")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
           for r in range(2)]
  logs = [p.communicate(timeout=600)[0].decode()[-3000:] for p in procs]
  for r, p in enumerate(procs):
    hint = ("\n(gloo resolves this machine's hostname: add it to /etc/hosts)"
            if "gloo/transport/tcp/device.cc" in logs[r] else "")
    assert p.returncode == 0, f"process {r}:\n{logs[r]}{hint}"
  return [json.loads((tmp / f"{r}.json").read_text()) for r in range(2)]
