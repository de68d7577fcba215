"""Several JAX processes, one jax.distributed job: the runtime and the ops end to end.

  python tests/gpu/multiprocess.py --worlds 2 4 8      (all on ONE GPU; starts and stops MPS)
  python tests/gpu/multiprocess.py --per-gpu           (one process per GPU of this machine)

For each world size, `world` worker processes join one jax.distributed job on
127.0.0.1 and form a `world`-device mesh: on the same GPU under MPS, or one GPU
each (CUDA_VISIBLE_DEVICES; the workspaces are mapped by IPC handles across
processes either way). XLA's own collectives cannot run on duplicate GPUs
(NCCL refuses them), so every check uses only jax_overlap's custom calls.

Scenario "main" (JAX_OVERLAP_ON_TIMEOUT=raise), each worker:
  1. all_gather custom call inside shard_map: 1000 calls in a row, every result checked;
  2. fused ag_matmul (with the gathered x) and matmul_rs vs a float64 NumPy reference;
  3. pipelined ag_matmul and matmul_rs, bf16 and fp16, odd rows, batch dims, bias, vs float64;
     matmul_rs twice: identical bits; every kind of stage plan pinned (JAX_OVERLAP_PIPELINE_STAGES), with
     ag_matmul's dx (matmul_rs, w K-major); 1000 pipelined calls back to back on changing inputs, all checked;
  4. the VJP of a TP MLP (ag_matmul -> gelu -> matmul_rs) vs NumPy gradients, fused and pipelined;
  5. a straggler: rank 1 sleeps 3 s (far beyond any spin, well within the watchdog) before a call; right results;
     two call sites sharing a region run in different orders on even and odd ranks (fused, pipelined): the
     call-site error and NaN on every rank; after clear_errors() the next call is right;
  6. shutdown(): a call compiled before refuses to run; compiled again after initialize(), it is right;
  7. the last rank enqueues a call and exits at once (dies mid-call); every survivor's calls then
     fail with the watchdog error (rank, peer, flag) within the timeout, their outputs are NaN, and
     check_errors() raises it.
Scenario "abort" (world 2, the default JAX_OVERLAP_ON_TIMEOUT=abort): rank 1 exits mid-call; rank 0's
  process must end by SIGABRT with the error record on its stderr.
The parent requires every worker's exit code and every check of its scenario (a crash or a hang after
some checks is a failure, never a pass). Prints one JSON line per worker and a summary; exits 1 on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np  # jax is imported by the worker after its environment is set

WATCHDOG_SECONDS = 20.0
DEATH_WATCHDOG_SECONDS = 3.0
_GELU_C = (2 / np.pi) ** 0.5

# Checks every worker must report in the main scenario; the rank that dies reports "dies_mid_call" instead of
# the survivors' DEATH_CHECKS.
MAIN_CHECKS = (
    "initialize", "all_gather_1000_calls", "ag_matmul", "ag_matmul_gathered", "matmul_rs", "matmul_rs_bitwise_repeat",
    "pipelined_ag_matmul_bfloat16", "pipelined_ag_matmul_float16", "pipelined_ag_matmul_gathered",
    "pipelined_matmul_rs_bfloat16", "pipelined_matmul_rs_float16", "pipelined_matmul_rs_bitwise_repeat",
    "pipelined_stage_plans", "pipelined_1000_calls", "mlp_vjp_fused", "mlp_vjp_pipelined", "straggler",
    "call_sites_out_of_order_fused", "in_step_after_clear_errors_fused", "call_sites_out_of_order_pipelined",
    "in_step_after_clear_errors_pipelined", "old_call_refused_after_shutdown", "recompiled_after_shutdown") + (
    DEATH_CHECKS := ("peer_death_raises", "peer_death_within_watchdog", "peer_death_outputs_nan",
                     "check_errors_raises"))


def _gelu(x):
  """jax.nn.gelu (tanh approximation) in float64."""
  return 0.5 * x * (1 + np.tanh(_GELU_C * (x + 0.044715 * x ** 3)))


def _gelu_grad(x):
  c = _GELU_C
  t = np.tanh(c * (x + 0.044715 * x ** 3))
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)


def stage_plans(world: int) -> list:
  """Pipelined stage plans that exercise every path: one chunk per stage, all peers in one stage, a stage that
  wraps past the last rank, and (matmul_rs only: ag_matmul's first stage is its own shard) one stage of all."""
  plans = {(1,) * world, (1, world - 1), (world,)}
  if world >= 4:
    plans.add((1, 2, world - 3))
  return sorted(plans)


def worker(rank: int, world: int, port: int, out_path: str, per_gpu: bool, scenario: str) -> None:
  os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.5" if per_gpu else f"{0.5 / world:.3f}"
  os.environ["JAX_OVERLAP_WATCHDOG_SECONDS"] = str(WATCHDOG_SECONDS)
  os.environ["JAX_OVERLAP_WORKSPACE_BYTES"] = str(256 << 20)
  if scenario == "main":
    os.environ["JAX_OVERLAP_ON_TIMEOUT"] = "raise"
  import jax
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=world, process_id=rank)
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  import jax_overlap as jo

  res = {"rank": rank, "world": world, "scenario": scenario, "checks": {}, "ok": True}

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

  def ag_fn(algorithm, bias=False, lead=0):
    none = (None,) * lead
    body = (lambda x, w, b: jo.ag_matmul(x, w, b, axis_name="tp", algorithm=algorithm, return_gathered=True)) if bias \
        else (lambda x, w: jo.ag_matmul(x, w, axis_name="tp", algorithm=algorithm, return_gathered=True))
    in_specs = (P(*none, "tp"), P(None, "tp")) + ((P("tp"),) if bias else ())
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                                 out_specs=(P(*none, None, "tp"), P(*none, "tp"))))

  def rs_fn(algorithm, bias=False, lead=0):
    none = (None,) * lead
    body = (lambda x, w, b: jo.matmul_rs(x, w, b, axis_name="tp", algorithm=algorithm)) if bias \
        else (lambda x, w: jo.matmul_rs(x, w, axis_name="tp", algorithm=algorithm))
    in_specs = (P(*none, None, "tp"), P("tp", None)) + ((P(),) if bias else ())
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P(*none, "tp", None)))

  rng = np.random.default_rng(1234)  # same data on every rank
  if scenario == "abort":
    x = rng.standard_normal((world * 64, 256)).astype(jnp.bfloat16)
    w = rng.standard_normal((256, world * 128)).astype(jnp.bfloat16)
    jo.initialize(watchdog_seconds=DEATH_WATCHDOG_SECONDS)
    ag = ag_fn("pipelined")
    args = (shard(x, P("tp")), shard(w, P(None, "tp")))
    jax.block_until_ready(ag(*args))
    check("first_call", True)
    if rank == world - 1:
      ag(*args)
      os._exit(0)  # mid-call
    for _ in range(100):
      jax.block_until_ready(ag(*args))  # the monitor thread must end this process
      time.sleep(0.1)
    check("aborted", False, "the process survived its peer's death")
    os._exit(0)

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
  y, g = ag_fn("fused")(shard(X, P("tp")), shard(W, P(None, "tp")))
  ref = np.asarray(X, np.float64) @ np.asarray(W, np.float64)[:, rank * n:(rank + 1) * n]
  check("ag_matmul", rel(local(y), ref) < 1e-2, f"rel err {rel(local(y), ref):.2e}")
  check("ag_matmul_gathered", np.array_equal(local(g), np.asarray(X)), "")
  Mt, kl, N = world * 96, 256, 384
  Xr = rng.standard_normal((Mt, world * kl)).astype(jnp.bfloat16)
  Wr = (rng.standard_normal((world * kl, N)) / np.sqrt(world * kl)).astype(jnp.bfloat16)
  rs = rs_fn("fused")
  xr, wr = shard(Xr, P(None, "tp")), shard(Wr, P("tp", None))
  z1, z2 = local(rs(xr, wr)), local(rs(xr, wr))
  ref = (np.asarray(Xr, np.float64) @ np.asarray(Wr, np.float64))[rank * 96:(rank + 1) * 96]
  check("matmul_rs", rel(z1, ref) < 2e-2, f"rel err {rel(z1, ref):.2e}")
  check("matmul_rs_bitwise_repeat", np.array_equal(z1.view(np.uint16), z2.view(np.uint16)), "")

  # 3. pipelined: odd rows, a batch dim, bias, both 16-bit dtypes.
  for dtype in (jnp.bfloat16, jnp.float16):
    name = np.dtype(dtype).name
    m, k, n = 37, 520, 136
    X = rng.standard_normal((2, world * m, k)).astype(dtype)
    W = (rng.standard_normal((k, world * n)) / np.sqrt(k)).astype(dtype)
    B = rng.standard_normal((world * n,)).astype(dtype)
    y, g = ag_fn("pipelined", bias=True, lead=1)(shard(X, P(None, "tp")), shard(W, P(None, "tp")), shard(B, P("tp")))
    cols = slice(rank * n, (rank + 1) * n)
    ref = np.asarray(X, np.float64) @ np.asarray(W, np.float64)[:, cols] + np.asarray(B, np.float64)[cols]
    check(f"pipelined_ag_matmul_{name}", rel(local(y), ref) < 2e-2, f"rel err {rel(local(y), ref):.2e}")
    if dtype == jnp.bfloat16:
      check("pipelined_ag_matmul_gathered", np.array_equal(local(g), np.asarray(X)), "")
    Mt, kl, N = world * 37, 264, 136
    Xr = rng.standard_normal((2, Mt, world * kl)).astype(dtype)
    Wr = (rng.standard_normal((world * kl, N)) / np.sqrt(world * kl)).astype(dtype)
    Br = rng.standard_normal((N,)).astype(dtype)
    rsp = rs_fn("pipelined", bias=True, lead=1)
    args = (shard(Xr, P(None, None, "tp")), shard(Wr, P("tp", None)), shard(Br, P()))
    z1, z2 = local(rsp(*args)), local(rsp(*args))
    ref = (np.asarray(Xr, np.float64) @ np.asarray(Wr, np.float64))[:, rank * 37:(rank + 1) * 37] + \
        np.asarray(Br, np.float64)
    check(f"pipelined_matmul_rs_{name}", rel(z1, ref) < 3e-2, f"rel err {rel(z1, ref):.2e}")
    if dtype == jnp.bfloat16:
      check("pipelined_matmul_rs_bitwise_repeat", np.array_equal(z1.view(np.uint16), z2.view(np.uint16)), "")

  # 3b. every kind of stage plan, pinned: both ops, odd rows, a batch dim, bias; and ag_matmul's dx (a
  # pipelined matmul_rs with w transposed, K-major) under the same plan.
  m, k, n = 37, 520, 136
  X = rng.standard_normal((2, world * m, k)).astype(jnp.bfloat16)
  W = (rng.standard_normal((k, world * n)) / np.sqrt(k)).astype(jnp.bfloat16)
  B = rng.standard_normal((world * n,)).astype(jnp.bfloat16)
  DY = rng.standard_normal((2, world * m, world * n)).astype(jnp.bfloat16)
  Xr = rng.standard_normal((2, world * m, world * 264)).astype(jnp.bfloat16)
  Wr = (rng.standard_normal((world * 264, n)) / np.sqrt(world * 264)).astype(jnp.bfloat16)
  x64, w64, b64, dy64 = (np.asarray(a, np.float64) for a in (X, W, B, DY))
  cols, rows = slice(rank * n, (rank + 1) * n), slice(rank * m, (rank + 1) * m)
  ag_dx = jax.jit(jax.shard_map(
      lambda x, w, b, dy: jax.vjp(lambda x: jo.ag_matmul(x, w, b, axis_name="tp", algorithm="pipelined"), x)[1](dy)[0],
      mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), P("tp"), P(None, None, "tp")), out_specs=P(None, "tp")))
  errors = {}
  for stages in stage_plans(world):
    os.environ["JAX_OVERLAP_PIPELINE_STAGES"] = ",".join(map(str, stages))
    jax.clear_caches()
    if stages[0] == 1:
      y, _ = ag_fn("pipelined", bias=True, lead=1)(shard(X, P(None, "tp")), shard(W, P(None, "tp")),
                                                   shard(B, P("tp")))
      dx = ag_dx(shard(X, P(None, "tp")), shard(W, P(None, "tp")), shard(B, P("tp")), shard(DY, P(None, None, "tp")))
      errors[f"ag {stages}"] = rel(local(y), x64 @ w64[:, cols] + b64[cols])
      errors[f"ag dx {stages}"] = rel(local(dx), (dy64 @ w64.T)[:, rows])
    z = rs_fn("pipelined", lead=1)(shard(Xr, P(None, None, "tp")), shard(Wr, P("tp", None)))
    errors[f"rs {stages}"] = rel(local(z), (np.asarray(Xr, np.float64) @ np.asarray(Wr, np.float64))[:, rows])
  del os.environ["JAX_OVERLAP_PIPELINE_STAGES"]
  jax.clear_caches()
  check("pipelined_stage_plans", max(errors.values()) < 3e-2,
        ", ".join(f"{name}: {e:.1e}" for name, e in errors.items()))

  # 1000 pipelined calls back to back, each on new inputs, each checked.
  m, k, n = 32, 128, 64
  X = rng.standard_normal((world * m, k)).astype(jnp.bfloat16)
  W = (rng.standard_normal((k, world * n)) / np.sqrt(k)).astype(jnp.bfloat16)
  agp = jax.jit(jax.shard_map(lambda x, w, i: jo.ag_matmul(x + i, w, axis_name="tp", algorithm="pipelined"),
                              mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P()), out_specs=P(None, "tp")))
  xs, ws = shard(X, P("tp")), shard(W, P(None, "tp"))
  w_local = np.asarray(W, np.float64)[:, rank * n:(rank + 1) * n]
  outs = [agp(xs, ws, shard(np.array(i % 7, jnp.bfloat16), P())) for i in range(1000)]
  bad = [i for i, out in enumerate(outs)
         if rel(local(out), np.asarray((X.astype(np.float32) + i % 7).astype(jnp.bfloat16), np.float64) @ w_local)
         > 2e-2]
  check("pipelined_1000_calls", not bad, f"{len(bad)} bad calls, first {bad[:5]}")

  # 4. VJP of a TP MLP through both ops (no bias: nothing replicated, so no XLA psum).
  m, d, f = 64, 256, 128
  Xm = rng.standard_normal((world * m, d)).astype(jnp.bfloat16)
  W1 = (rng.standard_normal((d, world * f)) / np.sqrt(d)).astype(jnp.bfloat16)
  W2 = (rng.standard_normal((world * f, d)) / np.sqrt(world * f)).astype(jnp.bfloat16)
  DY = rng.standard_normal((world * m, d)).astype(jnp.bfloat16)
  x64, w1, w2, dy = (np.asarray(a, np.float64) for a in (Xm, W1, W2, DY))
  pre = x64 @ w1
  h = _gelu(pre)
  dpre = (dy @ w2.T) * _gelu_grad(pre)
  want = {"dx": (dpre @ w1.T)[rank * m:(rank + 1) * m], "dw1": (x64.T @ dpre)[:, rank * f:(rank + 1) * f],
          "dw2": (h.T @ dy)[rank * f:(rank + 1) * f]}
  for algorithm in ("fused", "pipelined"):
    def mlp(x, w1, w2, algorithm=algorithm):
      h = jax.nn.gelu(jo.ag_matmul(x, w1, axis_name="tp", algorithm=algorithm))
      return jo.matmul_rs(h, w2, axis_name="tp", algorithm=algorithm)

    fn = jax.shard_map(mlp, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P("tp", None)), out_specs=P("tp"))
    args = (shard(Xm, P("tp")), shard(W1, P(None, "tp")), shard(W2, P("tp", None)))
    grads = jax.jit(lambda x, w1, w2, dy: jax.vjp(fn, x, w1, w2)[1](dy))(*args, shard(DY, P("tp")))
    errs = {name: rel(local(got), want[name]) for name, got in zip(("dx", "dw1", "dw2"), grads)}
    check(f"mlp_vjp_{algorithm}", all(e < 3e-2 for e in errs.values()), json.dumps(errs))

  # 5. A straggler: late by seconds, within the watchdog, and nothing is lost.
  m, k, n = 64, 256, 128
  X = rng.standard_normal((world * m, k)).astype(jnp.bfloat16)
  W = (rng.standard_normal((k, world * n)) / np.sqrt(k)).astype(jnp.bfloat16)
  ag = ag_fn("pipelined")
  args = (shard(X, P("tp")), shard(W, P(None, "tp")))
  jax.block_until_ready(ag(*args))
  if rank == 1:
    time.sleep(3.0)
  y, _ = ag(*args)
  ref = np.asarray(X, np.float64) @ np.asarray(W, np.float64)[:, rank * n:(rank + 1) * n]
  straggled = rel(local(y), ref)
  try:
    jo.check_errors()
    no_error = True
  except jo.PeerTimeoutError as e:
    no_error, straggled = False, str(e)
  check("straggler", no_error and straggled < 1e-2, f"rel err {straggled}")

  # 5b. Two call sites of one shape share a region; even ranks run the first where odd ranks run the
  # second: every rank gets the call-site error and NaN, never the other call's data. clear_errors()
  # puts the ranks back in step.
  for algorithm in ("fused", "pipelined"):
    first, second = (ag_fn(algorithm).lower(*args).compile() for _ in range(2))  # lowered alike everywhere
    y, _ = (first if rank % 2 == 0 else second)(*args)
    nan = bool(np.all(np.isnan(local(y).astype(np.float32))))
    try:
      jo.check_errors()
      err = "no error"
    except jo.PeerTimeoutError as e:
      err = str(e)
    check(f"call_sites_out_of_order_{algorithm}", "another call site" in err and nan, f"NaN {nan}: {err[:300]}")
    jo.clear_errors()
    y, _ = first(*args)
    check(f"in_step_after_clear_errors_{algorithm}", rel(local(y), ref) < 1e-2, f"rel err {rel(local(y), ref):.2e}")

  # 6. shutdown(): compiled calls refuse; compiled again, they run.
  jo.shutdown()
  try:
    jax.block_until_ready(ag(*args))
    check("old_call_refused_after_shutdown", False, "the old call ran")
  except Exception as e:  # XlaRuntimeError
    check("old_call_refused_after_shutdown", "shutdown() freed" in str(e), str(e)[:300])
  jax.clear_caches()
  jo.initialize()
  y, _ = ag_fn("pipelined")(*args)
  check("recompiled_after_shutdown", rel(local(y), ref) < 1e-2, f"rel err {rel(local(y), ref):.2e}")

  # 7. A peer dies in the middle of a call: survivors fail within the watchdog, they do not hang.
  jo.initialize(watchdog_seconds=DEATH_WATCHDOG_SECONDS)
  ag = ag_fn("pipelined")
  for _ in range(3):
    jax.block_until_ready(ag(*args))
  if rank == world - 1:
    ag(*args)  # enqueued, not finished: the process ends under it
    check("dies_mid_call", True)
    os._exit(0)
  t0 = time.monotonic()
  err, nan_outputs = None, False
  for _ in range(20):
    y, g = ag(*args)
    try:
      jax.block_until_ready(y)
      nan_outputs = nan_outputs or bool(np.all(np.isnan(local(y).astype(np.float32))))
    except Exception as e:  # XlaRuntimeError carrying the watchdog record
      err = str(e)
      break
  waited = time.monotonic() - t0
  check("peer_death_raises", err is not None and "timed out" in err and f"rank {world - 1}" in err,
        (err or "no error")[:300])
  check("peer_death_within_watchdog", waited < DEATH_WATCHDOG_SECONDS + 10.0, f"{waited:.1f} s")
  check("peer_death_outputs_nan", nan_outputs, "the timed-out call's output was NaN" if nan_outputs else "not NaN")
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


def _verdict(results: list[dict], scenario: str) -> None:
  """Marks each worker's result failed unless its exit code and every required check are right."""
  for r in results:
    rank, world = r["rank"], r["world"]
    if scenario == "abort":
      required, want_rc = (("first_call",), 0) if rank == world - 1 else (("first_call",), -signal.SIGABRT)
      ok_stderr = rank == world - 1 or ("timed out" in r["stderr"] and "aborting the process" in r["stderr"])
      r["checks"]["aborted_with_record"] = {"ok": ok_stderr, "detail": r["stderr"][-300:]}
    else:
      required = MAIN_CHECKS if rank < world - 1 else \
          tuple(c for c in MAIN_CHECKS if c not in DEATH_CHECKS) + ("dies_mid_call",)
      want_rc = 0
    missing = [c for c in required if c not in r["checks"]]
    if missing:
      r["checks"]["required_checks"] = {"ok": False, "detail": f"missing {missing}"}
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
  ap.add_argument("--scenario", default="main", choices=("main", "abort"))
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
      for world, scenario in [(w, "main") for w in worlds] + [(2, "abort")]:
        t0 = time.monotonic()
        results = run_world(world, env, args.per_gpu, scenario=scenario)
        for r in results:
          print(json.dumps({k: v for k, v in r.items() if k != "stderr"}))
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
