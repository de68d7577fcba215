"""A group of one (the pipelined path's vendor GEMM through JAX) against cuBLAS and XLA's dot on one GPU (issue 39,
world 1), and the per-call host cost.

  python benchmarks/bench_gemm_ab.py [--out DIR] [--shapes M,N,K ...] [--tables gemm host]

(DIR: $OUT when set, else benchmarks/results.) Every column of a row is measured in the same run, in turns
(ROUNDS rounds, medians), the JAX columns as CALLS chained calls in one executable, the torch columns as CALLS
calls back to back between CUDA events; us per call.

  gemm    per M x N x K (x [M, K] @ w, the four shapes of issue 39 by default), bf16 (w [K, N]) and float8 (e4m3
          x and w, tensor scales, w K-major, bf16 out):
            op_us         jax_overlap.ag_matmul, algorithm="pipelined", in shard_map over one GPU: the vendor GEMM
                          with the algorithm tuning chose (planning/tuning.py); wall time per chained call
            op_gpu_us     the same calls' GPU time per call (profiler: the span of the chain's kernels over
                          CALLS; the op and XLA profiled in turns, ROUNDS times, medians): what torch's events
                          measure of theirs; op_kernel_us the vendor GEMM kernel's own time, op_other_us the
                          other kernels' and copies' per call, op_idle_us the GPU's idle time per call
            xla_us, xla_gpu_us   XLA's dot (autotuned when compiled): bf16 jnp.dot; float8 its f8 GEMM (fast
                          accumulation on: not the op's numerics, for reference)
            torch_us      torch.matmul (cuBLAS's default algorithm) / torch._scaled_mm (fast accumulation off, as
                          the op)
            torch_tuned_us  torch.matmul under TunableOp (torch.cuda.tunable: cuBLAS's and cuBLASLt's candidates
                          timed at the first call), where this torch has it (bf16)
            tuned_us, first_us   the op's GEMM problem as DeviceBlas::tune timed it: its chosen algorithm (index
                          `index` of `candidates`) and the heuristic's first (the same C++ timing loop)
            gpu_ratio     GPU time, the op against XLA's dot profiled in turns and its algorithm as tuning timed it
                          (bf16: min(xla_gpu_us, tuned_us) / op_gpu_us; fp8: tuned_us / op_gpu_us; target >= 0.98)
            best_ratio    the columns timed in turns (chains' wall time, torch's CUDA events): bf16
                          min(xla_us, torch_us, torch_tuned_us) / op_us (target >= 0.98), fp8 torch_us / op_us
                          (target >= 0.97); the op's wall time holds its executable's launch and sync, which
                          torch's events do not
            op_b2b_us, xla_b2b_us   the chains' wall time with 4 executables dispatched before one wait, as a
                          training loop dispatches (an executable's launch overlaps the GPU's work of the one
                          before); b2b_ratio is best_ratio with op_b2b_us (bf16: and xla_b2b_us) in place of the
                          synced wall times
  host    the per-call cost of dispatching a group of one, in a process with XLA's command buffers off
          (--xla_gpu_enable_command_buffer=, so that XLA dispatches each call): CALLS chained calls of a
          128 x 128 x 128 GEMM (the GPU idles), op against XLA's dot, wall time per call; handler_us the host
          time inside the op's FFI handler per call, vendor_call_us the part of it in the vendor GEMM's call
          (cublasLtMatmul), from the handler's counters in a pass of their own. With command buffers on (the
          default) XLA replays a recorded group of one without calling the handler.
Results: DIR/gemm_ab_<date>.json (with date, device, commit, command); the tables print last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU with JAX here

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import _harness  # noqa: E402
import bench_fp8  # noqa: E402
import jax_overlap as jo  # noqa: E402
from jax_overlap.planning import tuning  # noqa: E402
from jax_overlap.runtime import native  # noqa: E402

SHAPES = [(16384, 3584, 8192), (16384, 8192, 3584), (4096, 3584, 8192), (1024, 3584, 8192)]  # M, N, K
ROUNDS = 5
CALLS = bench_fp8.CALLS
E4M3 = jnp.float8_e4m3fn


def _op(fp8: bool):
  def call(x, w, sx, sw):
    def body(x, w, sx, sw):
      if fp8:
        return jo.ag_matmul(x, w, x_scale=sx, w_scale=sw, out_dtype=jnp.bfloat16, w_kmajor=True, axis_name="tp",
                            algorithm="pipelined")
      return jo.ag_matmul(x, w, axis_name="tp", algorithm="pipelined")
    return jax.shard_map(body, mesh=_harness.one_gpu_mesh(),
                         in_specs=(P("tp"), P("tp", None) if fp8 else P(None, "tp"), P(), P()),
                         out_specs=P(None, "tp"))(x, w, sx, sw)
  return call


def _xla(fp8: bool):
  if fp8:
    return lambda x, w, sx, sw: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)
  return lambda x, w, sx, sw: jnp.dot(x, w)


def _torch_timers(m: int, n: int, k: int, fp8: bool) -> dict:
  try:
    import torch
  except ImportError:
    return {}
  if fp8:
    x = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    w = torch.randn(n, k, device="cuda").mul(k ** -0.5).to(torch.float8_e4m3fn).t()  # K-major: column-major [K, N]
    one = torch.tensor(1.0, device="cuda")
    return {"torch": bench_fp8._torch_timer(lambda: torch._scaled_mm(x, w, scale_a=one, scale_b=one,
                                                                     out_dtype=torch.bfloat16))}
  a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
  b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) * k ** -0.5
  timers = {"torch": bench_fp8._torch_timer(lambda: a @ b)}
  tunable = getattr(torch.cuda, "tunable", None)
  if tunable is not None:  # TunableOp on for this column alone; the timer's warm-up calls tune the shape
    if hasattr(tunable, "write_file_on_exit"):  # gone in torch 2.11; nothing is written there by default
      tunable.write_file_on_exit(False)
    tunable.set_max_tuning_duration(2000)

    def tunable_on(fn):
      def run():
        tunable.enable(True)
        try:
          return fn()
        finally:
          tunable.enable(False)
      return run
    tunable.tuning_enable(True)
    timers["torch_tuned"] = tunable_on(tunable_on(lambda: bench_fp8._torch_timer(lambda: a @ b))())
  return timers


def _tuned(m: int, n: int, k: int, fp8: bool) -> dict:
  """The op's GEMM problem as tuning timed it (the call compiled first: its lowering tuned it)."""
  nat = native.module()
  call = dict(dtype=bench_fp8.FP8 if fp8 else "bfloat16", batch=1, m=m, k=k, n=n, w_kmajor=fp8, bias=False,
              stages=[1])
  if fp8:
    call["out_dtype"] = "bfloat16"
  (pid,) = nat.gemm_problems("ag_matmul", 1, call, nat.device_info(0)["sm_count"])
  r = nat.tune_gemm(0, pid, **tuning.options())
  return {"tuned_us": r["us"] or None, "first_us": r["first_us"] or None, "index": r["index"],
          "candidates": r["candidates"], "source": r["source"]}


def gemm_row(m: int, n: int, k: int, fp8: bool) -> dict:
  kx, kw = jax.random.split(jax.random.key(m + n + k))
  x = jax.random.normal(kx, (m, k), jnp.float32)
  if fp8:
    x, w = x.astype(E4M3), jax.random.normal(kw, (n, k), jnp.float32).astype(E4M3)
  else:
    x, w = x.astype(jnp.bfloat16), (jax.random.normal(kw, (k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
  sx, sw = jnp.float32(0.5), jnp.float32(0.5 / k ** 0.5)
  chains = {"op": bench_fp8._chain(_op(fp8)), "xla": bench_fp8._chain(_xla(fp8))}
  timers = {}
  for name, fn in chains.items():
    _harness.note(f"  compiling {name}")
    timers[name] = bench_fp8._jax_timer(fn, x, w, sx, sw)
    timers[f"{name}_b2b"] = _harness.back_to_back_timer(fn, x, w, sx, sw, calls=CALLS)
  timers.update(_torch_timers(m, n, k, fp8))
  row = dict(table="gemm", dtype="float8_e4m3fn" if fp8 else "bfloat16", m=m, n=n, k=k,
             **_harness.in_turns(timers, ROUNDS), **_tuned(m, n, k, fp8))
  timelines = _harness.gpu_timelines_in_turns(chains, x, w, sx, sw, rounds=ROUNDS, unroll=CALLS,
                                             kernel=_harness.vendor_gemm_kernel)
  for name, timeline in timelines.items():
    for figure in ("call", "kernel", "idle", "other"):
      row[f"{name}_{'gpu' if figure == 'call' else figure}_us"] = timeline.get(f"{figure}_us")
  if row.get("op_gpu_us"):
    gpu_best = [v for v in (row.get("tuned_us"), None if fp8 else row.get("xla_gpu_us")) if v]
    row["gpu_ratio"] = min(gpu_best) / row["op_gpu_us"] if gpu_best else None
  for ratio, wall in (("best_ratio", ""), ("b2b_ratio", "_b2b")):
    if fp8:
      row[ratio] = row["torch_us"] / row[f"op{wall}_us"] if row.get("torch_us") else None
    else:
      best = [v for v in (row[f"xla{wall}_us"], row.get("torch_us"), row.get("torch_tuned_us")) if v]
      row[ratio] = min(best) / row[f"op{wall}_us"]
  for name in ("op", "xla", "torch"):  # the chart's series: GPU time where profiled, else the time in turns
    us = row.get(f"{name}_gpu_us") or row.get(f"{name}_us")
    row[f"{name}_tflops"] = _harness.tflops(m, n, k, us) if us else None
  return row


_HOST = """
import json, os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[1])))
import jax, jax.numpy as jnp
import bench_fp8, bench_gemm_ab
m = n = k = 128
x = jnp.ones((m, k), jnp.bfloat16); w = jnp.ones((k, n), jnp.bfloat16) / k; s = jnp.float32(1)
timers = {name: bench_fp8._jax_timer(bench_fp8._chain(fn), x, w, s, s)
          for name, fn in (("op", bench_gemm_ab._op(False)), ("xla", bench_gemm_ab._xla(False)))}
import _harness
result = _harness.in_turns(timers, 7)
from jax_overlap import _native_testing as harness
op = bench_fp8._chain(bench_gemm_ab._op(False))
harness.count_vendor_gemm_runs(True)  # a pass of its own: counting adds a capture query per call
before = harness.vendor_gemm_runs()
jax.block_until_ready([op(x, w, s, s) for _ in range(8)])
after = harness.vendor_gemm_runs()
harness.count_vendor_gemm_runs(False)
runs = after["runs"] - before["runs"]
result["handler_us"] = (after["handler_ns"] - before["handler_ns"]) / runs / 1e3
result["vendor_call_us"] = (after["vendor_ns"] - before["vendor_ns"]) / runs / 1e3
print(json.dumps(result))
"""


GEMM_SERIES = (("op", "#ff7f0e"), ("xla", "#1f77b4"), ("torch", "#7f7f7f"))


def host_rows() -> list:
  env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_enable_command_buffer=".strip()}
  run = subprocess.run([sys.executable, "-P", "-c", _HOST, __file__], env=env, capture_output=True, text=True,
                       timeout=300)
  if run.returncode != 0:
    raise RuntimeError(f"the host-cost process failed:\n{run.stderr[-3000:]}")
  dispatched = json.loads(run.stdout.strip().splitlines()[-1])
  return [dict(table="host", m=128, n=128, k=128, command_buffers=False, op_us=dispatched["op_us"],
               xla_us=dispatched["xla_us"], extra_us=dispatched["op_us"] - dispatched["xla_us"],
               handler_us=dispatched["handler_us"], vendor_call_us=dispatched["vendor_call_us"])]


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
  ap.add_argument("--shapes", nargs="*", help="M,N,K per shape (default: the four of issue 39)")
  ap.add_argument("--tables", nargs="*", choices=["gemm", "host"], default=["gemm", "host"])
  args = ap.parse_args(argv)
  shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
  work = [("gemm", (m, n, k, fp8)) for m, n, k in shapes for fp8 in (False, True)] if "gemm" in args.tables else []
  command, rows = "python " + " ".join(sys.argv), []
  for i, (table, a) in enumerate(work):
    _harness.progress(i, len(work) + 1, f"{table} {a}")
    rows.append(gemm_row(*a))
    path = _harness.write_results("gemm_ab", rows, args.out, command,
                                  series=GEMM_SERIES,
                                  plotted=lambda r: r["table"] == "gemm")
  if "host" in args.tables:
    _harness.progress(len(work), len(work) + 1, "host cost")
    rows += host_rows()
    path = _harness.write_results("gemm_ab", rows, args.out, command, series=GEMM_SERIES,
                                  plotted=lambda r: r["table"] == "gemm")
  _harness.print_table([r for r in rows if r["table"] == "gemm"],
                       ["dtype", "m", "n", "k", "op_us", "op_gpu_us", "xla_us", "xla_gpu_us", "torch_us",
                        "torch_tuned_us", "tuned_us", "first_us", "index", "candidates", "op_kernel_us",
                        "xla_kernel_us", "op_other_us", "xla_other_us", "gpu_ratio", "best_ratio"])
  _harness.print_table([r for r in rows if r["table"] == "gemm"],
                       ["dtype", "m", "n", "k", "op_us", "xla_us", "op_b2b_us", "xla_b2b_us", "torch_us",
                        "torch_tuned_us", "best_ratio", "b2b_ratio", "gpu_ratio"])
  _harness.print_table([r for r in rows if r["table"] == "host"],
                       ["m", "n", "k", "op_us", "xla_us", "extra_us", "handler_us", "vendor_call_us"])
  print(f"results: {path}.json")


if __name__ == "__main__":
  np.set_printoptions(linewidth=120)
  main()
