"""ag_matmul and matmul_rs across the GPUs of one machine, against every baseline in one run.

  python benchmarks/bench_multi_gpu.py [--tp 2 4 8] [--m 1024 4096 16384 65536] [--out benchmarks/results]

Shapes are per rank, as tensor parallelism sees them: each rank's GEMM is [M total, K] @ [K, N]
(ag_matmul gathers x's M/T row shards first; matmul_rs reduce-scatters the [M, N] partials).
Rows are appended to OUT/multi_gpu_DATE.jsonl as they finish, and a rerun skips the rows there.
A row's columns are all measured in one run (bf16, one process driving T GPUs, times in us per call):
  pipelined, fused, xla
                     jax_overlap with that algorithm inside jax.shard_map (pipelined_stages: the stage
                     plan the cost model chose; auto_picks: the algorithm "auto" chose, both read from the
                     lowered program)
  xla_cm             XLA's own collective matmul (windowed einsum) on sharded arrays under jax.jit,
                     measured in a child process started with XLA_CM_FLAGS (XLA flags are per process)
  ppermute           the collective-matmul pattern of the JAX shard_map docs (dot per shard + ppermute)
  cublas             the per-rank GEMM alone (torch.matmul on GPU 0), when torch is present
  ideal              max(cublas, bytes each rank receives / link), link = a ppermute ring measured here
  pipelined_vs_ideal, xla_vs_pipelined
                     the pipelined call against the ideal and against XLA's path (the targets at
                     M = 16384, T = 4 and 8: at most 1.15 and at least 1.35)
  kernel, wait, comm the fused kernel's span on GPU 0 from its trace; summed GEMM-side wait per GEMM
                     workgroup; the span of its fetch/reduce work
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys

if __name__ == "__main__":  # before jax is imported; not when a test imports the baselines
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and the child process share the GPUs
  os.environ.setdefault("JAX_OVERLAP_WORKSPACE_BYTES", str(12 << 30))  # regions of every shape stay placed
  os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import _harness  # noqa: E402
import jax_overlap as jo  # noqa: E402

XLA_CM_FLAGS = "--xla_gpu_threshold_for_windowed_einsum_mib=0 --xla_gpu_multi_streamed_windowed_einsum=true"
NK = [(3584, 8192), (8192, 3584)]
MS = [1024, 4096, 16384, 65536]
LINK_BYTES = 256 << 20
OPS = ("ag_matmul", "matmul_rs")
BASELINES = ("xla_us", "xla_cm_us", "ppermute_us")
SERIES = (("pipelined", "#ff7f0e"), ("fused", "#d62728"), ("xla", "#1f77b4"), ("xla_cm", "#2ca02c"), ("ppermute", "#9467bd"),
          ("ideal", "#7f7f7f"))  # TFLOP/s per rank in the plot
COLUMNS = ["op", "tp", "m", "n", "k", "pipelined_us", "pipelined_stages", "fused_us", "auto_picks", "xla_us",
           "xla_cm_us", "ppermute_us", "cublas_us", "ideal_us", "kernel_us", "wait_us", "comm_us",
           "pipelined_vs_ideal", "xla_vs_pipelined", "pipelined_vs_best_baseline", "fused_vs_best_baseline"]


def mesh_of(t: int) -> Mesh:
  return Mesh(np.array(jax.devices()[:t]), ("tp",))


# (x, w, output) partition specs of each op: ag_matmul gathers x's rows and owns w's columns;
# matmul_rs owns x's columns and w's rows and reduce-scatters the output's rows.
SPECS = {"ag_matmul": (P("tp", None), P(None, "tp"), P(None, "tp")),
         "matmul_rs": (P(None, "tp"), P("tp", None), P("tp", None))}


def global_shapes(op: str, t: int, m: int, n: int, k: int):
  """(x, w) global shapes; each rank's GEMM is [m, k] @ [k, n]."""
  if op == "ag_matmul":
    return (m, k), (k, t * n)
  return (m, t * k), (t * k, n)


def jo_op(op: str, mesh: Mesh, algorithm: str):
  xs, ws, out = SPECS[op]
  fn = jo.ag_matmul if op == "ag_matmul" else jo.matmul_rs
  return jax.shard_map(lambda x, w: fn(x, w, axis_name="tp", algorithm=algorithm), mesh=mesh, in_specs=(xs, ws),
                       out_specs=out)


def ppermute_op(op: str, mesh: Mesh):
  """Collective matmul by hand: one dot per shard, the next shard (or the partial sum) moving around the ring."""
  t = mesh.shape["tp"]
  xs, ws, out = SPECS[op]

  def ag(x, w):  # x [m/t, k], w [k, n] -> [m, n]; receive from rank + 1 each step
    idx = jax.lax.axis_index("tp")
    blocks, chunk = [None] * t, x
    for s in range(t):
      blocks[s] = chunk @ w  # rows of shard (idx + s) % t
      if s < t - 1:
        chunk = jax.lax.ppermute(chunk, "tp", [(j, (j - 1) % t) for j in range(t)])
    y = jnp.stack(blocks)  # [t, m/t, n], block s holds shard (idx + s) % t
    return jnp.roll(y, idx, axis=0).reshape(-1, y.shape[-1])

  def rs(x, w):  # x [m, k/t], w [k/t, n] -> [m/t, n]; the partial for block b ends at rank b
    idx = jax.lax.axis_index("tp")
    xb = x.reshape(t, -1, x.shape[-1])
    part = lambda b: jnp.dot(jax.lax.dynamic_index_in_dim(xb, b % t, keepdims=False), w,
                             preferred_element_type=jnp.float32)
    acc = part(idx - 1)
    for s in range(1, t):
      acc = jax.lax.ppermute(acc.astype(x.dtype), "tp", [(j, (j + 1) % t) for j in range(t)])
      acc = acc + part(idx - s - 1)
    return acc.astype(x.dtype)

  return jax.shard_map(ag if op == "ag_matmul" else rs, mesh=mesh, in_specs=(xs, ws), out_specs=out)


def xla_jit_op(op: str, mesh: Mesh):
  """The plain program on sharded arrays; with XLA_CM_FLAGS XLA rewrites it as a windowed einsum."""
  return lambda x, w: jax.lax.with_sharding_constraint(x @ w, NamedSharding(mesh, SPECS[op][2]))


def inputs(op: str, mesh: Mesh, m: int, n: int, k: int):
  t = mesh.shape["tp"]
  (xshape, wshape), (xs, ws, _) = global_shapes(op, t, m, n, k), SPECS[op]
  x = jax.device_put(_harness.random_bf16(xshape, 0), NamedSharding(mesh, xs))
  w = jax.device_put(_harness.random_bf16(wshape, 1) * (xshape[1] ** -0.5), NamedSharding(mesh, ws))
  return x, w


def link_gbps(mesh: Mesh) -> float:
  """Bytes each rank receives per second in a ppermute ring (every rank sends LINK_BYTES to rank + 1)."""
  t = mesh.shape["tp"]
  a = jax.device_put(jnp.zeros((t * LINK_BYTES // 2,), jnp.bfloat16), NamedSharding(mesh, P("tp")))
  ring = jax.shard_map(lambda v: jax.lax.ppermute(v, "tp", [(j, (j + 1) % t) for j in range(t)]), mesh=mesh,
                       in_specs=P("tp"), out_specs=P("tp"))
  us = _harness.wall_us(_harness.chained(lambda v, _: ring(v)), a, a)
  return LINK_BYTES / us / 1e3


def received_bytes(op: str, t: int, m: int, n: int, k: int) -> int:
  return (t - 1) * (m // t) * (k if op == "ag_matmul" else n) * 2


def lowered_choice(op: str, text: str) -> tuple[str, list | None]:
  """The algorithm a lowered jax_overlap call took (its custom call's name) and, for pipelined, its stages."""
  if f"@jax_overlap_{op}_pipelined(" in text:
    found = re.search(r"stages = (?:array<i64: ([-\d, ]+)>|dense<(\[?[-\d, ]+\]?)> : tensor<(\d+)xi64>)", text)
    if found is None:
      return "pipelined", None
    if found.group(1):
      return "pipelined", [int(v) for v in found.group(1).split(",")]
    values = [int(v) for v in found.group(2).strip("[]").split(",")]
    return "pipelined", values * int(found.group(3)) if len(values) == 1 else values
  return ("fused" if f"@jax_overlap_{op}(" in text else "xla"), None


def trace_split(fn, x, w) -> dict:
  """One fused call traced on GPU 0: kernel span, GEMM-side wait per GEMM workgroup, comm span (us)."""
  ev, tpu = _harness.traced_events(jax.jit(fn), x, w)
  if len(ev) == 0:
    return {}
  kinds = {name: ev[ev["kind"] == i] for i, name in enumerate(jo.tracing.KINDS)}
  span = lambda e: float(e["end"].max() - e["start"].min()) / tpu if len(e) else 0.0
  gemm_blocks = max(len(np.unique(kinds["gemm_tile"]["block"])), 1)
  comm = np.concatenate([kinds["fetch"], kinds["publish"], kinds["reduce"]])
  return {"kernel_us": span(ev), "wait_us": float((kinds["wait"]["end"] - kinds["wait"]["start"]).sum()) / tpu /
          gemm_blocks, "comm_us": span(comm)}


def unroll_for(m: int, n: int, k: int) -> int:
  """Calls per timed executable: about 20 ms of GEMM at 500 TFLOP/s, 2 to UNROLL."""
  return int(min(max(20000 / (2.0 * m * n * k / 5e8), 2), _harness.UNROLL))


def timed(fn, x, w, m: int, n: int, k: int) -> float:
  u = unroll_for(m, n, k)
  return _harness.wall_us(_harness.chained(fn, u), x, w, unroll=u)


def key(r: dict) -> tuple:
  return r["op"], r["tp"], r["m"], r["n"], r["k"]


def load_rows(path: str) -> dict:
  """Rows measured earlier into `path` (JSON lines): a run cut short resumes where it stopped."""
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return {key(r): r for r in map(json.loads, f) if r}


def append_row(path: str, row: dict) -> None:
  with open(path, "a") as f:
    f.write(json.dumps(row) + "\n")


def measure_xla_cm(configs, path: str) -> dict:
  """XLA's collective matmul for every config not yet in `path`, in a child process started with
  XLA_CM_FLAGS (rows appended to `path` as they finish); returns {key: row} of `path`."""
  todo = [c for c in configs if c not in load_rows(path)]
  if todo:
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + XLA_CM_FLAGS).strip())
    spec = ";".join(",".join(map(str, c)) for c in todo)
    out = subprocess.run([sys.executable, __file__, "--child-xla-cm", spec, "--out", path], env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
      sys.stderr.write(f"xla_cm child failed ({out.returncode}):\n{out.stderr[-3000:]}\n")
  return load_rows(path)


def child_xla_cm(spec: str, path: str) -> None:
  for item in spec.split(";"):
    op, t, m, n, k = item.split(",")
    t, m, n, k = int(t), int(m), int(n), int(k)
    mesh = mesh_of(t)
    x, w = inputs(op, mesh, m, n, k)
    fn = xla_jit_op(op, mesh)
    hlo = jax.jit(fn).lower(x, w).compile().as_text()
    append_row(path, {"op": op, "tp": t, "m": m, "n": n, "k": k, "us": timed(fn, x, w, m, n, k),
                      "windowed": "collective-permute" in hlo})
    del x, w


def measure(op: str, t: int, m: int, n: int, k: int, link: float, xla_cm: dict) -> dict:
  mesh = mesh_of(t)
  x, w = inputs(op, mesh, m, n, k)
  row = dict(op=op, tp=t, m=m, n=n, k=k, link_gbps=link)
  for algorithm in ("pipelined", "fused", "xla"):
    row[f"{algorithm}_us"] = timed(jo_op(op, mesh, algorithm), x, w, m, n, k)
  # Which algorithm and stage plan a call takes is decided at trace time: read them from the lowering.
  row["pipelined_stages"] = lowered_choice(op, jax.jit(jo_op(op, mesh, "pipelined")).lower(x, w).as_text())[1]
  row["auto_picks"] = lowered_choice(op, jax.jit(jo_op(op, mesh, "auto")).lower(x, w).as_text())[0]
  row["ppermute_us"] = timed(ppermute_op(op, mesh), x, w, m, n, k)
  cm = xla_cm.get((op, t, m, n, k), {})
  row["xla_cm_us"], row["xla_cm_windowed"] = cm.get("us"), cm.get("windowed")
  row["cublas_us"] = _harness.cublas_us(m, n, k)
  row["ideal_us"] = max(row["cublas_us"] or 0.0, received_bytes(op, t, m, n, k) / link / 1e3)
  row.update(trace_split(jo_op(op, mesh, "fused"), x, w))
  best_baseline = min(row[b] for b in BASELINES if row[b])
  row["fused_vs_best_baseline"] = best_baseline / row["fused_us"]
  row["pipelined_vs_best_baseline"] = best_baseline / row["pipelined_us"]
  row["pipelined_vs_ideal"] = row["pipelined_us"] / row["ideal_us"] if row["ideal_us"] else None
  row["xla_vs_pipelined"] = row["xla_us"] / row["pipelined_us"]
  for s, _ in SERIES:
    row[f"{s}_tflops"] = _harness.tflops(m, n, k, row[f"{s}_us"])
  return row


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tp", type=int, nargs="*", default=None, help="group sizes (default: 2, 4, 8 up to the GPUs)")
  ap.add_argument("--m", type=int, nargs="*", default=MS)
  ap.add_argument("--nk", nargs="*", default=[f"{n},{k}" for n, k in NK], help="N,K per rank")
  ap.add_argument("--ops", nargs="*", default=list(OPS))
  ap.add_argument("--out", default="benchmarks/results")
  ap.add_argument("--child-xla-cm", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.child_xla_cm:
    child_xla_cm(args.child_xla_cm, args.out)
    return
  tps = args.tp or [t for t in (2, 4, 8) if t <= len(jax.devices())]
  if not tps or max(tps) > len(jax.devices()):
    sys.exit(f"bench_multi_gpu: needs as many GPUs as the largest --tp; this process has {len(jax.devices())}")
  nks = [tuple(int(v) for v in s.split(",")) for s in args.nk]
  os.makedirs(args.out, exist_ok=True)
  stamp = datetime.date.today().isoformat()
  rows_path = os.path.join(args.out, f"multi_gpu_{stamp}.jsonl")
  configs = [(op, t, m, n, k) for t in tps for op in args.ops for n, k in nks for m in args.m]
  xla_cm = measure_xla_cm(configs, os.path.join(args.out, f"multi_gpu_xla_cm_{stamp}.jsonl"))
  jo.initialize()
  done, links = load_rows(rows_path), {}
  for i, c in enumerate(configs):
    _harness.progress(i, len(configs), "{} T={} M={} N={} K={}".format(*c))
    if c in done:
      continue
    if c[1] not in links:
      links[c[1]] = link_gbps(mesh_of(c[1]))
    done[c] = measure(*c, links[c[1]], xla_cm)
    append_row(rows_path, done[c])
  _harness.progress(len(configs), len(configs), "done")
  rows = [done[c] for c in configs]
  path = _harness.write_results("multi_gpu", rows, args.out, "python " + " ".join(sys.argv), series=SERIES,
                                label=lambda r: f"{r['op'][:2]} T={r['tp']} {r['m']}x{r['n']}x{r['k']}")
  print("peer link (ppermute ring, bytes each rank receives): " +
        ", ".join(sorted({f"T={r['tp']}: {r['link_gbps']:.0f} GB/s" for r in rows})))
  _harness.print_table(rows, COLUMNS)
  print(f"results: {path}.json, {path}.svg")


if __name__ == "__main__":
  main()
