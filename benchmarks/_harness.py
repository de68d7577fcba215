"""Shared by bench_ag_matmul.py and bench_matmul_rs.py: the run, timing, baselines, results files.

Columns, all measured in the same run on the same GPU:
  fused     jax_overlap with algorithm="fused" inside shard_map (world 1 on one GPU)
  xla       the reference path (algorithm="xla": XLA all_gather/psum_scatter + dot)
  cublas    the GEMM alone through torch.matmul (cuBLAS) on the same data, when torch is present,
            each call timed alone (the GPU idles between timings)
  cublas_b2b  the same with UNROLL calls back to back per timing, as the chained fused calls run;
            kernel_vs_cublas_b2b compares the fused kernel with it
  kernel    the fused kernel's duration on the GPU (CUPTI, through jax.profiler; tracing off)
  trace_span  the same kernel's span from its own trace (first tile start to last tile end)
  gpu_call  GPU time per call of the chained executable (first kernel start to last end / UNROLL),
            for the fused and the xla variant
  overhead  GPU idle time per call between the chain's kernels: the launch gaps the fused
            op's dispatch leaves (the chain's own update kernel is busy time, not overhead)
Each JAX variant runs UNROLL calls in one executable (inputs chained, so XLA cannot
hoist them); wall times are medians over REPEATS executions, divided by UNROLL, and
include the executable's launch (~20 us per call at UNROLL 20 for both variants).
Emulated ranks: N ranks on the one GPU (jax_overlap._native_testing.SimGroup, each rank its own
workspace and stream, SMs split N ways) running the full protocol; this measures
protocol overhead against one GEMM of the same total size, not a multi-GPU speed.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import glob
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import jax_overlap as jo
from jax_overlap.runtime import backend, native
from jax_overlap.ops import OPS
from jax_overlap.planning import fused

UNROLL = 20
REPEATS = 7


_STARTED = time.monotonic()


def note(label: str) -> None:
  """A line on stderr with the seconds since the start: a log cut short by a time limit says where it was."""
  sys.stderr.write(f"{time.monotonic() - _STARTED:6.0f} s  {label}\n")
  sys.stderr.flush()


def progress(i: int, total: int, label: str) -> None:
  done = int(30 * i / total)
  note(f"[{'#' * done}{'.' * (30 - done)}] {i}/{total} {label}")


def in_turns(timers: dict, rounds: int) -> dict:
  """{name}_us: each timer's median over `rounds` rounds, the timers taking turns within a round. The GPU's clocks
  drift under sustained GEMMs (its power limit): turns spread the drift over every column alike."""
  times = {name: [] for name in timers}
  for _ in range(rounds):
    for name, timed in timers.items():
      times[name].append(timed())
  return {f"{name}_us": statistics.median(t) for name, t in times.items()}


def vendor_gemm_kernel(name: str) -> bool:
  """Whether a GPU kernel's name is the vendor BLAS's GEMM (cuBLAS/cuBLASLt: nvjet, cutlass, xmma, *gemm*)."""
  return any(s in name.lower() for s in ("gemm", "nvjet", "cutlass", "xmma"))


def wall_us(fn, *args, unroll: int = UNROLL) -> float:
  """Median wall time of fn(*args) (which runs `unroll` calls), per call, in us."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(REPEATS):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times) / unroll * 1e6


def synced_timer(fn, *args, calls: int):
  """A timer of one run of fn(*args) (`calls` chained calls), waited for alone: wall time per call, us. Compiles
  and warms up first."""
  jax.block_until_ready(fn(*args))

  def timed() -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t0) / calls * 1e6
  return timed


def back_to_back_timer(fn, *args, calls: int, executions: int = 4):
  """A timer of `executions` runs of fn(*args) (`calls` chained calls each) dispatched before one wait, as a
  training loop dispatches its steps (each executable's dispatch overlaps the GPU's work of the one before): wall
  time per call, us. fn is compiled and warm (synced_timer ran it)."""
  def timed() -> float:
    t0 = time.perf_counter()
    jax.block_until_ready([fn(*args) for _ in range(executions)])
    return (time.perf_counter() - t0) / (executions * calls) * 1e6
  return timed


def chained(op, unroll: int = UNROLL):
  """`unroll` calls of op(x, w) in one executable; each call's input depends on the previous output."""
  def run(x, w):
    for _ in range(unroll):
      y = op(x, w)
      x = x.at[(0,) * x.ndim].set(y[(0,) * y.ndim].astype(x.dtype))
    return x
  return jax.jit(run)


def one_gpu_mesh():
  return Mesh(np.array(jax.devices()[:1]), ("tp",))


def cublas_us(m: int, n: int, k: int, back_to_back: int = 1) -> float | None:
  """Time of torch.matmul (cuBLAS) on the benchmark's data, per call, median of 20 timings.

  back_to_back: calls per timing, launched back to back (the chained fused calls'
  situation); 1 times each call alone, the GPU idling between timings.
  """
  try:
    import torch
  except ImportError:
    return None
  a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
  b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) * k ** -0.5
  for _ in range(3):
    torch.matmul(a, b)
  times = []
  for _ in range(20):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(back_to_back):
      torch.matmul(a, b)
    e.record()
    e.synchronize()
    times.append(s.elapsed_time(e) * 1e3 / back_to_back)
  return statistics.median(times)


def traced_events(fn, *args, ordinal: int = 0):
  """Trace events of GPU `ordinal` from one run of fn(*args) after a warm-up run, and ticks per us."""
  jo.initialize(trace=True)
  try:
    jax.block_until_ready(fn(*args))
    jo.tracing.events(ordinal)  # discard the warm-up
    jax.block_until_ready(fn(*args))
    return jo.tracing.events(ordinal)
  finally:
    jo.initialize(trace=False)


def kernel_span_us(fn, *args) -> float:
  """Median span of the fused kernel per call, from its trace events."""
  ev, ticks_per_us = traced_events(fn, *args)
  ev = ev[ev["kind"] == 0]  # GEMM tiles
  spans = call_spans(ev["start"].astype(np.int64), ev["end"].astype(np.int64))
  # The last call may be cut short by the trace buffer: dropped.
  return float(np.median(spans[:-1] if len(spans) > 1 else spans)) / ticks_per_us


def call_spans(starts: np.ndarray, ends: np.ndarray) -> list[int]:
  """Span (last end - first start) of each call in tile events of calls run one after another.

  Inside XLA's command buffers the calls follow each other with gaps under a
  microsecond, so a call is told by its first tile starting after every earlier
  tile ended (within a call some workgroup is always mid-tile).
  """
  order = np.argsort(starts, kind="stable")
  starts, ends = starts[order], ends[order]
  firsts = np.where(starts[1:] > np.maximum.accumulate(ends)[:-1])[0] + 1
  return [int(ends[b].max() - starts[b].min()) for b in np.split(np.arange(len(starts)), firsts) if len(b)]


def gpu_timeline(fn, *args, unroll: int = UNROLL, kernel="jo::") -> dict:
  """One profiled run of fn(*args) (`unroll` chained calls): the GPU's own view, from CUPTI.

  {} when the profile holds no GPU kernel (no GPU, or no CUPTI); else timeline_stats of it.
  """
  jax.block_until_ready(fn(*args))
  return timeline_stats(profiled_trace(lambda: jax.block_until_ready(fn(*args))), unroll, kernel)


def profiled_trace(run) -> list[dict]:
  """The trace events of one call of run() (which waits for its GPU work) under jax's profiler."""
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      run()
    return trace_events(d)


def gpu_timelines_in_turns(fns: dict, *args, rounds: int = 3, unroll: int = UNROLL, kernel="jo::") -> dict:
  """{name: timeline_stats} of each fn(*args), profiled `rounds` times in turns (medians of each figure): one
  profile after another would give the later ones a hotter GPU (its clocks fall under sustained GEMMs)."""
  runs = {name: [] for name in fns}
  for _ in range(rounds):
    for name, fn in fns.items():
      runs[name].append(gpu_timeline(fn, *args, unroll=unroll, kernel=kernel))
  return {name: {key: statistics.median(r[key] for r in stats) for key in stats[0]} if all(stats) else {}
          for name, stats in runs.items()}


def trace_events(trace_dir: str) -> list[dict]:
  """The events of the jax.profiler trace written under trace_dir ([] where none was)."""
  files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
  if not files:
    return []
  with gzip.open(files[0]) as f:
    trace = json.load(f)
  return trace["traceEvents"] if isinstance(trace, dict) else trace


def gpu_events(events: list[dict]) -> list[dict]:
  """The GPU's complete events of a Chrome/Perfetto trace, in start order."""
  gpu_pids = {e["pid"] for e in events
              if e.get("ph") == "M" and e.get("name") == "process_name" and "GPU" in str(e["args"].get("name"))}
  return sorted((e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids), key=lambda e: e["ts"])


def timeline_stats(events: list[dict], unroll: int, kernel) -> dict:
  """Per-call figures from a Chrome/Perfetto trace's GPU events ({} when `kernel` never ran).

  kernel_us: median duration of the kernels whose name contains `kernel` (or for which it is true, a callable);
  call_us: GPU span per call (first kernel start to last end, over unroll);
  idle_us: GPU idle time per call between the chain's kernels (launch gaps: the
  per-call dispatch overhead the GPU sees); overlapping events count once;
  other_us: GPU time per call of the other kernels and copies.
  """
  ev = gpu_events(events)
  ours_name = kernel if callable(kernel) else (lambda name: kernel in name)
  ours = [e["dur"] for e in ev if ours_name(e["name"])]
  if not ours:
    return {}
  span = max(e["ts"] + e["dur"] for e in ev) - ev[0]["ts"]
  busy_end, idle = ev[0]["ts"] + ev[0]["dur"], 0.0
  for e in ev[1:]:
    idle += max(e["ts"] - busy_end, 0.0)
    busy_end = max(busy_end, e["ts"] + e["dur"])
  other = sum(e["dur"] for e in ev if not ours_name(e["name"]))
  return {"kernel_us": statistics.median(ours), "call_us": span / unroll, "idle_us": idle / unroll,
          "other_us": other / unroll}


def git_commit() -> str:
  # The device machine's copy of the tree carries no git metadata or stale
  # metadata (runs there reported the session's first commit): name it.
  if "JAX_OVERLAP_COMMIT" in os.environ:
    return os.environ["JAX_OVERLAP_COMMIT"]
  try:
    return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True, stderr=subprocess.DEVNULL,
                                   cwd=os.path.dirname(__file__)).strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


ONE_GPU_SERIES = (("fused", "#d62728"), ("xla", "#1f77b4"), ("cublas", "#7f7f7f"))


def shape_label(r: dict) -> str:
  return f"M={r['m']} N={r['n']} K={r['k']}"


def write_results(name: str, rows: list[dict], out_dir: str, command: str, series=ONE_GPU_SERIES,
                  label=shape_label, plotted=lambda r: r.get("world", 1) == 1, meta=None) -> str:
  """rows as JSON (with date, device, commit, command, and the benchmark's own `meta`) and, where `plotted`
  keeps rows, a bar chart of each series' TFLOP/s. Returns the files' path without extension."""
  os.makedirs(out_dir, exist_ok=True)
  stamp = datetime.date.today().isoformat()
  meta = {"date": stamp, "device": jax.devices()[0].device_kind, "devices": len(jax.devices()), "commit": git_commit(),
          "command": command, "jax": jax.__version__, "build": jo.build_info(), **(meta or {})}
  path = os.path.join(out_dir, f"{name}_{stamp}")
  with open(path + ".json", "w") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1)
  charted = [r for r in rows if plotted(r)]
  if charted:  # a table of no TFLOP/s rows (a sweep, host costs) has no chart
    _svg_bars(path + ".svg", f"{name} on {meta['device']} ({stamp}, {meta['commit']})", charted, series, label)
  return path


def _svg_bars(path: str, title: str, groups: list[dict], series, label) -> None:
  """A dependency-free grouped bar chart of TFLOP/s per row."""
  top = max([r.get(f"{s}_tflops") or 0 for r in groups for s, _ in series] + [1])
  step = 40 * len(series) + 40
  width, height, pad = step * max(len(groups), 1) + 80, 320, 40
  parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="11"><text x="10" y="18" font-size="13">{title}</text>']
  for gi, r in enumerate(groups):
    x0 = pad + gi * step
    for si, (s, color) in enumerate(series):
      v = r.get(f"{s}_tflops") or 0
      h = (height - 90) * v / top
      parts.append(f'<rect x="{x0 + si * 40}" y="{height - 50 - h:.1f}" width="34" height="{h:.1f}" '
                   f'fill="{color}"/><text x="{x0 + si * 40}" y="{height - 54 - h:.1f}">{v:.0f}</text>')
    parts.append(f'<text x="{x0}" y="{height - 32}">{label(r)}</text>')
  for si, (s, color) in enumerate(series):
    parts.append(f'<rect x="{pad + si * 90}" y="{height - 18}" width="10" height="10" fill="{color}"/>'
                 f'<text x="{pad + si * 90 + 14}" y="{height - 9}">{s} TFLOP/s</text>')
  parts.append("</svg>")
  with open(path, "w") as f:
    f.write("".join(parts))


def print_table(rows: list[dict], cols=None) -> None:
  cols = cols or ["world", "m", "n", "k", "fused_us", "xla_us", "cublas_us", "kernel_us", "gpu_call_us",
                  "xla_gpu_call_us", "overhead_us", "kernel_tflops", "cublas_tflops", "fused_vs_cublas",
                  "kernel_vs_cublas", "cublas_b2b_us", "kernel_vs_cublas_b2b", "emulated_us", "single_gemm_us",
                  "protocol_overhead"]
  present = [c for c in cols if any(r.get(c) is not None for r in rows)]
  print(" ".join(f"{c:>14}" for c in present))
  for r in rows:
    print(" ".join(f"{_fmt(r.get(c)):>14}" for c in present))


def _fmt(v) -> str:
  if v is None:
    return "-"
  if isinstance(v, float):
    return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
  return str(v)


def tflops(m: int, n: int, k: int, us: float | None) -> float | None:
  return None if not us else 2.0 * m * n * k / us / 1e6


def random_bf16(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.bfloat16)


def sim_group_us(world: int, op: str, m_total: int, n: int, k: int) -> float:
  """Median wall time of one emulated call of `world` ranks on this GPU (all ranks, synced)."""
  from jax_overlap import _native_testing  # the harness module: GPU builds only
  g = _native_testing.SimGroup(0, world, bytes_per_rank=2 << 30)
  rng = np.random.default_rng(0)
  dev = jax.devices()[0]

  def put(shape, scale=1.0):
    return jax.device_put((rng.standard_normal(shape) * scale).astype(jnp.bfloat16), dev)

  if op == "ag_matmul":
    m = m_total // world
    xs = [put((m, k)) for _ in range(world)]
    ws = [put((k, n // world), k ** -0.5) for _ in range(world)]
    ys = [jnp.zeros((m_total, n // world), jnp.bfloat16) for _ in range(world)]
    gs = [jnp.zeros((m_total, k), jnp.bfloat16) for _ in range(world)]
    geometry = functools.partial(backend.current().gemm_geometry, "ag_matmul", dtype_name="bfloat16",
                                 w_kmajor=False, world=world, batch=1, m=m, k=k, n=n // world,
                                 device=_sim_props(world))
    plan, _ = fused.plan(OPS["ag_matmul"], dtype_name="bfloat16", rows=m, k=k, n=n // world, world=world,
                         device=_sim_props(world), tiles=backend.current().tile_shapes(), geometry=geometry)
    call = dict(dtype="bfloat16", tile=plan.tile, comm_workgroups=plan.comm_workgroups, chunk_k=plan.chunk_k,
                w_kmajor=False, batch=1, m=m, k=k, n=n // world, x=[a.unsafe_buffer_pointer() for a in xs],
                w=[a.unsafe_buffer_pointer() for a in ws], bias=[0] * world,
                out=[a.unsafe_buffer_pointer() for a in ys], gathered=[a.unsafe_buffer_pointer() for a in gs])
    launch = lambda: g.ag_matmul(call)
  else:
    xs = [put((m_total, k // world)) for _ in range(world)]
    ws = [put((k // world, n), k ** -0.5) for _ in range(world)]
    outs = [jnp.zeros((m_total // world, n), jnp.bfloat16) for _ in range(world)]
    geometry = functools.partial(backend.current().gemm_geometry, "matmul_rs", dtype_name="bfloat16",
                                 w_kmajor=False, world=world, batch=1, m=m_total, k=k // world, n=n,
                                 device=_sim_props(world))
    plan, _ = fused.plan(OPS["matmul_rs"], dtype_name="bfloat16", rows=m_total, k=k // world, n=n, world=world,
                         device=_sim_props(world), tiles=backend.current().tile_shapes(), geometry=geometry)
    call = dict(dtype="bfloat16", tile=plan.tile, comm_workgroups=plan.comm_workgroups, w_kmajor=False, batch=1,
                m=m_total,
                k=k // world, n=n, x=[a.unsafe_buffer_pointer() for a in xs],
                w=[a.unsafe_buffer_pointer() for a in ws], bias=[0] * world,
                out=[a.unsafe_buffer_pointer() for a in outs])
    launch = lambda: g.matmul_rs(call)
  jax.block_until_ready([xs, ws])
  launch()
  times = []
  for _ in range(5):
    t0 = time.perf_counter()
    launch()
    times.append(time.perf_counter() - t0)
  if g.errors():
    raise RuntimeError(g.errors())
  return statistics.median(times) * 1e6


def _sim_props(world: int) -> backend.DeviceProps:
  info = native.module().device_info(0)
  return backend.DeviceProps(sm_count=info["sm_count"], smem_per_block=info["smem_per_block"], ranks_per_gpu=world)


EMULATED_WORLDS = [2, 4, 8]


def run(op_name: str, make_op, default_shapes, argv=None) -> None:
  """The benchmark of one op: world 1 (fused, xla, cublas, kernel span) and emulated ranks per shape.

  make_op(algorithm) returns a function (x, w) -> y calling the op inside shard_map on one GPU;
  x is [M, K] and w [K, N] as that function expects them.
  """
  ap = argparse.ArgumentParser(description=f"{op_name} benchmark (benchmarks/_harness.py)")
  ap.add_argument("--out", default="benchmarks/results")
  ap.add_argument("--shapes", nargs="*", default=[",".join(map(str, s)) for s in default_shapes],
                  help="M,N,K per shape")
  ap.add_argument("--emulated", nargs="*", type=int, default=EMULATED_WORLDS,
                  help="emulated rank counts per shape (none: world 1 only)")
  args = ap.parse_args(argv)
  shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes]
  total = len(shapes) * (1 + len(args.emulated))
  rows, i = [], 0
  for m, n, k in shapes:
    progress(i, total, f"world 1 M={m}")
    x, w = random_bf16((m, k), 0), random_bf16((k, n), 1) * (k ** -0.5)
    fused, xla = chained(make_op("fused")), chained(make_op("xla"))
    f_us, x_us = wall_us(fused, x, w), wall_us(xla, x, w)
    timeline = gpu_timeline(fused, x, w)
    trace_span = kernel_span_us(fused, x, w)
    c_us = cublas_us(m, n, k)
    c_b2b_us = cublas_us(m, n, k, back_to_back=UNROLL)
    kernel = timeline.get("kernel_us")
    rows.append(dict(world=1, m=m, n=n, k=k, fused_us=f_us, xla_us=x_us, cublas_us=c_us, kernel_us=kernel,
                     trace_span_us=trace_span, gpu_call_us=timeline.get("call_us"),
                     overhead_us=timeline.get("idle_us"), xla_gpu_call_us=gpu_timeline(xla, x, w, kernel="").get("call_us"),
                     fused_tflops=tflops(m, n, k, f_us), xla_tflops=tflops(m, n, k, x_us),
                     kernel_tflops=tflops(m, n, k, kernel), cublas_tflops=tflops(m, n, k, c_us),
                     fused_vs_cublas=(c_us / f_us) if c_us else None,
                     kernel_vs_cublas=(c_us / kernel) if c_us and kernel else None,
                     cublas_b2b_us=c_b2b_us,
                     kernel_vs_cublas_b2b=(c_b2b_us / kernel) if c_b2b_us and kernel else None))
    i += 1
    for world in args.emulated:
      progress(i, total, f"emulated {world} ranks M={m}")
      em = sim_group_us(world, op_name, m, n, k)
      rows.append(dict(world=world, m=m, n=n, k=k, emulated_us=em, single_gemm_us=f_us, protocol_overhead=em / f_us))
      i += 1
  progress(total, total, "done")
  path = write_results(op_name, rows, args.out, "python " + " ".join(sys.argv))
  print_table(rows)
  print(f"results: {path}.json, {path}.svg")
