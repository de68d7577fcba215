"""Several JAX processes, one jax.distributed job: the runtime and the ops end to end.

  python tests/gpu/multiprocess.py --worlds 2 4 8      (all on ONE GPU; starts and stops MPS)
  python tests/gpu/multiprocess.py --per-gpu           (one process per GPU of this machine)
  python tests/gpu/multiprocess.py --scenarios abort   (some scenarios only; default: all)

For each world size, `world` worker processes join one jax.distributed job on
127.0.0.1 and form a `world`-device mesh: on the same GPU under MPS, or one GPU
each (CUDA_VISIBLE_DEVICES; the workspaces are mapped by IPC handles across
processes either way). XLA's own collectives cannot run on duplicate GPUs
(NCCL refuses them), so every check uses only jax_overlap's custom calls.

What the workers run is a scenario (tests/gpu/scenarios/: "main" the ops and
their failures, "abort" a peer's death under JAX_OVERLAP_ON_TIMEOUT=abort, ...).
The parent requires every worker's exit code and every check of its scenario (a
crash or a hang after some checks is a failure, never a pass). Prints one JSON
line per worker and a summary; exits 1 on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

# The scenarios check results with the tests' one tolerance scheme (tests/tolerance.py).
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# jax is imported by the worker after its environment is set.
from scenarios import SCENARIOS  # noqa: E402
from scenarios.common import WATCHDOG_SECONDS, Ctx  # noqa: E402


def worker(rank: int, world: int, port: int, out_path: str, per_gpu: bool, scenario: str) -> None:
  module = SCENARIOS[scenario]
  os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.5" if per_gpu else f"{0.5 / world:.3f}"
  os.environ["JAX_OVERLAP_WATCHDOG_SECONDS"] = str(WATCHDOG_SECONDS)
  os.environ["JAX_OVERLAP_WORKSPACE_BYTES"] = str(256 << 20)
  os.environ.update(module.ENV)
  import jax
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=world, process_id=rank)
  module.run(Ctx(rank, world, scenario, out_path))


def _gpu_count() -> int:
  out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True,
                       check=False).stdout
  return len(out.split())


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start_mps(tmp: str) -> dict:
  env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=f"{tmp}/mps", CUDA_MPS_LOG_DIRECTORY=f"{tmp}/mpslog")
  os.makedirs(env["CUDA_MPS_PIPE_DIRECTORY"], exist_ok=True)
  os.makedirs(env["CUDA_MPS_LOG_DIRECTORY"], exist_ok=True)
  subprocess.run(["nvidia-cuda-mps-control", "-d"], env=env, check=True)
  return env


def _stop_mps(env: dict) -> None:
  subprocess.run(["nvidia-cuda-mps-control"], input=b"quit\n", env=env, check=False)


def _verdict(results: list[dict], scenario: str) -> None:
  """Marks each worker's result failed unless its exit code and every required check are right."""
  module = SCENARIOS[scenario]
  for r in results:
    rank, world = r["rank"], r["world"]
    if hasattr(module, "verdict"):
      module.verdict(r)
    missing = [c for c in module.required(rank, world) if c not in r["checks"]]
    if missing:
      r["checks"]["required_checks"] = {"ok": False, "detail": f"missing {missing}"}
    want_rc = module.returncode(rank, world)
    r["checks"]["exit_code"] = {"ok": r["returncode"] == want_rc, "detail": f"{r['returncode']} (want {want_rc})"}
    r["ok"] = all(c["ok"] for c in r["checks"].values())


def run_world(world: int, env: dict, per_gpu: bool, timeout: float = 600, scenario: str = "main") -> list[dict]:
  port = _free_port()
  with tempfile.TemporaryDirectory() as tmp:
    outs = [os.path.join(tmp, f"rank{r}.json") for r in range(world)]
    errs = [open(os.path.join(tmp, f"rank{r}.err"), "w+") for r in range(world)]
    # Under MPS every rank shares one GPU: the first visible one, also on
    # machines with several (each process would otherwise see all of them).
    shared = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    rank_env = lambda r: dict(env, CUDA_VISIBLE_DEVICES=str(r) if per_gpu else shared)
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), "--world", str(world), "--port",
                               str(port), "--out", outs[r], "--scenario", scenario] +
                              (["--per-gpu"] if per_gpu else []), env=rank_env(r), stderr=errs[r])
             for r in range(world)]
    deadline = time.monotonic() + timeout
    for p in procs:
      try:
        p.wait(timeout=max(deadline - time.monotonic(), 1))
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    results = []
    for r, path in enumerate(outs):
      result = json.load(open(path)) if os.path.exists(path) else {"rank": r, "world": world, "ok": False,
                                                                   "checks": {}}
      errs[r].seek(0)
      result["stderr"] = errs[r].read()[-4000:]
      result["returncode"] = procs[r].returncode
      results.append(result)
    _verdict(results, scenario)
    return results


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--worlds", type=int, nargs="*", default=None,
                  help="world sizes (default: 2 4 8 on one GPU; every GPU with --per-gpu)")
  ap.add_argument("--per-gpu", action="store_true", help="one process per GPU instead of all on GPU 0 under MPS")
  ap.add_argument("--worker", type=int)
  ap.add_argument("--world", type=int)
  ap.add_argument("--port", type=int)
  ap.add_argument("--out")
  ap.add_argument("--scenario", default="main", choices=tuple(SCENARIOS), help="(a worker's scenario)")
  ap.add_argument("--scenarios", nargs="*", choices=tuple(SCENARIOS), default=tuple(SCENARIOS),
                  help="the scenarios to run (default: all)")
  args = ap.parse_args(argv)
  if args.worker is not None:
    worker(args.worker, args.world, args.port, args.out, args.per_gpu, args.scenario)
    return 0
  ok = True
  worlds = args.worlds or ([_gpu_count()] if args.per_gpu else [2, 4, 8])
  if args.per_gpu and max(worlds) > _gpu_count():
    print(f"--per-gpu: world {max(worlds)} needs that many GPUs; this machine has {_gpu_count()}")
    return 1
  with tempfile.TemporaryDirectory() as tmp:
    env = dict(os.environ, NCCL_NVLS_ENABLE="0") if args.per_gpu else _start_mps(tmp)
    try:
      runs = [(w, name) for name in args.scenarios for w in (SCENARIOS[name].WORLDS or worlds)]
      for world, scenario in runs:
        t0 = time.monotonic()
        results = run_world(world, env, args.per_gpu, scenario=scenario)
        for r in results:
          print(json.dumps({k: v for k, v in r.items() if k != "stderr"}))
          if not r["ok"] and r["stderr"]:  # a worker's exception (or the record it died with) says why
            print(f"--- stderr of rank {r['rank']} (world {world} {scenario}), last lines:\n{r['stderr'][-1500:]}")
        failed = sorted({f"{name} (rank {r['rank']}): {c['detail']}" for r in results
                         for name, c in r["checks"].items() if not c["ok"]})
        ok &= all(r["ok"] for r in results)
        print(f"world {world} {scenario}: {'PASS' if all(r['ok'] for r in results) else 'FAIL'} "
              f"({time.monotonic() - t0:.0f} s) {'; '.join(failed)[:2000]}", flush=True)
    finally:
      if not args.per_gpu:
        _stop_mps(env)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
