"""Several JAX processes, one jax.distributed job: the runtime and the fused ops end to end.

  python tests/gpu/multiprocess.py --worlds 2 4 8      (all on ONE GPU; starts and stops MPS)
  python tests/gpu/multiprocess.py --per-gpu           (one process per GPU of this machine)

For each world size, `world` worker processes join one jax.distributed job on
127.0.0.1 and form a `world`-device mesh: on the same GPU under MPS, or one GPU
each (CUDA_VISIBLE_DEVICES; the workspaces are mapped by IPC handles across
processes either way). XLA's own collectives cannot run on duplicate GPUs
(NCCL refuses them), so every check uses only jax_overlap's custom calls. Each
worker:
  1. all_gather custom call inside shard_map: 1000 calls in a row, every result checked;
  2. fused ag_matmul (with the gathered x) and matmul_rs vs a float64 NumPy reference;
  3. matmul_rs twice: identical bits;
  4. the VJP of a TP MLP (ag_matmul -> gelu -> matmul_rs) vs NumPy gradients;
  5. the last rank exits; every survivor's next call fails with the watchdog
     error (rank, peer, flag) within the timeout, and check_errors() raises it.
Prints one JSON line per worker and a summary; exits 1 on any failure.
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

import numpy as np  # jax is imported by the worker after its environment is set

WATCHDOG_SECONDS = 3.0
_GELU_C = (2 / np.pi) ** 0.5


def _gelu(x):
  """jax.nn.gelu (tanh approximation) in float64."""
  return 0.5 * x * (1 + np.tanh(_GELU_C * (x + 0.044715 * x ** 3)))


def _gelu_grad(x):
  c = _GELU_C
  t = np.tanh(c * (x + 0.044715 * x ** 3))
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)


def worker(rank: int, world: int, port: int, out_path: str, per_gpu: bool) -> None:
  os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.6" if per_gpu else f"{0.6 / world:.3f}"
  os.environ["JAX_OVERLAP_WATCHDOG_SECONDS"] = str(WATCHDOG_SECONDS)
  import jax
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=world, process_id=rank)
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  import jax_overlap as jo

  res = {"rank": rank, "world": world, "checks": {}, "ok": True}

  def check(name, ok, detail=""):
    res["checks"][name] = {"ok": bool(ok), "detail": detail}
    res["ok"] &= bool(ok)
    with open(out_path, "w") as fh:  # after every check: a later crash keeps what passed
      json.dump(res, fh)

  mesh = Mesh(np.array(jax.devices()), ("tp",))
  dev = jax.local_devices()[0]

  def shard(full, spec):
    """Global array from the full host array: this process contributes its shard."""
    sharding = NamedSharding(mesh, spec)
    index = sharding.addressable_devices_indices_map(full.shape)[dev]
    return jax.make_array_from_single_device_arrays(full.shape, sharding, [jax.device_put(full[index], dev)])

  def local(a):
    return np.asarray(a.addressable_shards[0].data)

  def rel(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref)) if np.all(np.isfinite(out)) else float("inf")

  rng = np.random.default_rng(1234)  # same data on every rank
  info = jo.initialize()
  check("initialize", info["active"] and len(info["reachable_devices"]) == world, json.dumps(info["devices"]))

  # 1. all_gather, 1000 calls.
  m, c = 64, 128
  base = rng.standard_normal((world * m, c)).astype(np.float32)
  gather = jax.jit(jax.shard_map(lambda x, i: jo.all_gather(x + i, axis_name="tp")[None], mesh=mesh,
                                 in_specs=(P("tp"), P()), out_specs=P("tp")))
  x = shard(base, P("tp"))

  def step(i):
    return shard(np.array(i, np.float32), P())

  bad = []
  t0 = time.perf_counter()
  for i in range(1000):
    got = local(gather(x, step(i)))[0]
    if not np.array_equal(got, base + np.float32(i)):
      bad.append(i)
  check("all_gather_1000_calls", not bad, f"{len(bad)} bad calls; {(time.perf_counter() - t0) * 1e3:.0f} ms")

  # 2. fused ag_matmul and matmul_rs.
  m, k, n = 192, 512, 256
  X = rng.standard_normal((world * m, k)).astype(jnp.bfloat16)
  W = (rng.standard_normal((k, world * n)) / np.sqrt(k)).astype(jnp.bfloat16)
  ag = jax.jit(jax.shard_map(lambda x, w: jo.ag_matmul(x, w, axis_name="tp", algorithm="fused", return_gathered=True),
                             mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=(P(None, "tp"), P("tp"))))
  y, g = ag(shard(X, P("tp")), shard(W, P(None, "tp")))
  ref = np.asarray(X, np.float64) @ np.asarray(W, np.float64)[:, rank * n:(rank + 1) * n]
  check("ag_matmul", rel(local(y), ref) < 1e-2, f"rel err {rel(local(y), ref):.2e}")
  check("ag_matmul_gathered", np.array_equal(local(g), np.asarray(X)), "")

  Mt, kl, N = world * 96, 256, 384
  Xr = rng.standard_normal((Mt, world * kl)).astype(jnp.bfloat16)
  Wr = (rng.standard_normal((world * kl, N)) / np.sqrt(world * kl)).astype(jnp.bfloat16)
  rs = jax.jit(jax.shard_map(lambda x, w: jo.matmul_rs(x, w, axis_name="tp", algorithm="fused"), mesh=mesh,
                             in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None)))
  xr, wr = shard(Xr, P(None, "tp")), shard(Wr, P("tp", None))
  z1, z2 = local(rs(xr, wr)), local(rs(xr, wr))
  ref = (np.asarray(Xr, np.float64) @ np.asarray(Wr, np.float64))[rank * 96:(rank + 1) * 96]
  check("matmul_rs", rel(z1, ref) < 2e-2, f"rel err {rel(z1, ref):.2e}")
  check("matmul_rs_bitwise_repeat", np.array_equal(z1.view(np.uint16), z2.view(np.uint16)), "")

  # 4. VJP of a TP MLP through both fused ops (no bias: nothing replicated, so no XLA psum).
  m, d, f = 64, 256, 128
  Xm = rng.standard_normal((world * m, d)).astype(jnp.bfloat16)
  W1 = (rng.standard_normal((d, world * f)) / np.sqrt(d)).astype(jnp.bfloat16)
  W2 = (rng.standard_normal((world * f, d)) / np.sqrt(world * f)).astype(jnp.bfloat16)
  DY = rng.standard_normal((world * m, d)).astype(jnp.bfloat16)

  def mlp(x, w1, w2):
    h = jax.nn.gelu(jo.ag_matmul(x, w1, axis_name="tp", algorithm="fused"))
    return jo.matmul_rs(h, w2, axis_name="tp", algorithm="fused")

  fn = jax.shard_map(mlp, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp", None)), out_specs=P("tp"))
  args = (shard(Xm, P("tp")), shard(W1, P(None, "tp")), shard(W2, P("tp", None)))
  grads = jax.jit(lambda x, w1, w2, dy: jax.vjp(fn, x, w1, w2)[1](dy))
  dx, dw1, dw2 = grads(*args, shard(DY, P("tp")))
  x64, w1, w2, dy = (np.asarray(a, np.float64) for a in (Xm, W1, W2, DY))
  pre = x64 @ w1
  h = _gelu(pre)
  dpre = (dy @ w2.T) * _gelu_grad(pre)
  want = {"dx": (dpre @ w1.T)[rank * m:(rank + 1) * m],
          "dw1": (x64.T @ dpre)[:, rank * f:(rank + 1) * f],
          "dw2": (h.T @ dy)[rank * f:(rank + 1) * f]}
  for name, got in (("dx", dx), ("dw1", dw1), ("dw2", dw2)):
    err = rel(local(got), want[name])
    check(f"mlp_vjp_{name}", err < 3e-2, f"rel err {err:.2e}")

  # 5. A peer dies: survivors fail within the watchdog, they do not hang.
  jo.initialize(sync_after_launch=True)
  x = shard(base, P("tp"))
  for i in range(5):
    gather(x, step(i)).block_until_ready()
  if rank == world - 1:
    check("exits_to_test_peers", True, "this rank leaves; its peers must time out")
    os._exit(0)
  t0 = time.monotonic()
  err = None
  try:
    for i in range(5, 20):
      gather(x, step(i)).block_until_ready()
  except Exception as e:  # XlaRuntimeError carrying the watchdog record
    err = str(e)
  waited = time.monotonic() - t0
  check("peer_death_raises", err is not None and "timed out" in err and f"rank {world - 1}" in err,
        (err or "no error")[:300])
  check("peer_death_within_watchdog", waited < WATCHDOG_SECONDS + 5.0, f"{waited:.1f} s")
  try:
    jo.check_errors()
    check("check_errors_raises", False, "no PeerTimeoutError")
  except jo.PeerTimeoutError as e:
    check("check_errors_raises", e.record["peer"] == world - 1, json.dumps(e.record))
  os._exit(0)  # skip jax.distributed's exit barrier: a peer is gone


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


def run_world(world: int, env: dict, per_gpu: bool, timeout: float = 600) -> list[dict]:
  port = _free_port()
  with tempfile.TemporaryDirectory() as tmp:
    outs = [os.path.join(tmp, f"rank{r}.json") for r in range(world)]
    # Under MPS every rank shares one GPU: the first visible one, also on
    # machines with several (each process would otherwise see all of them).
    shared = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    rank_env = lambda r: dict(env, CUDA_VISIBLE_DEVICES=str(r) if per_gpu else shared)
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), "--world", str(world), "--port",
                               str(port), "--out", outs[r]] + (["--per-gpu"] if per_gpu else []), env=rank_env(r))
             for r in range(world)]
    deadline = time.monotonic() + timeout
    for p in procs:
      try:
        p.wait(timeout=max(deadline - time.monotonic(), 1))
      except subprocess.TimeoutExpired:
        p.kill()
    results = []
    for r, path in enumerate(outs):
      if os.path.exists(path):
        results.append(json.load(open(path)))
      else:
        results.append({"rank": r, "world": world, "ok": False, "checks": {"finished": {"ok": False, "detail": ""}}})
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
  args = ap.parse_args(argv)
  if args.worker is not None:
    worker(args.worker, args.world, args.port, args.out, args.per_gpu)
    return 0
  ok = True
  worlds = args.worlds or ([_gpu_count()] if args.per_gpu else [2, 4, 8])
  if args.per_gpu and max(worlds) > _gpu_count():
    print(f"--per-gpu: world {max(worlds)} needs that many GPUs; this machine has {_gpu_count()}")
    return 1
  with tempfile.TemporaryDirectory() as tmp:
    env = dict(os.environ, NCCL_NVLS_ENABLE="0") if args.per_gpu else _start_mps(tmp)
    try:
      for world in worlds:
        t0 = time.monotonic()
        results = run_world(world, env, args.per_gpu)
        for r in results:
          print(json.dumps(r))
        failed = sorted({f"{name} (rank {r['rank']}): {c['detail']}" for r in results
                         for name, c in r["checks"].items() if not c["ok"]})
        ok &= all(r["ok"] for r in results)
        print(f"world {world}: {'PASS' if all(r['ok'] for r in results) else 'FAIL'} "
              f"({time.monotonic() - t0:.0f} s) {'; '.join(failed)[:2000]}", flush=True)
    finally:
      if not args.per_gpu:
        _stop_mps(env)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
