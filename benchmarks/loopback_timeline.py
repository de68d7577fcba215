"""Where a loopback call's time goes: the GPU timeline of one pipelined call as rank 0 of T (float8 or bf16).

  python benchmarks/loopback_timeline.py [--op matmul_rs] [--world 8] [--dtype float8_e4m3fn]
                                         [--shape M,N,K]

Times bench_fp8's loopback call (the op's schedule, this GPU's data standing in for the peers', the stages the
cost model plans), then runs it once more under jax.profiler and prints every GPU event of that call: stream,
start and duration (us from its first event), kernel or copy. One case per run; the record of 2026-12-02
is benchmarks/results/loopback_timeline_2026-12-02_5875325_margin0.txt.
"""

from __future__ import annotations

import argparse

import _harness
import bench_fp8
from jax_overlap import _native_testing


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--op", default="matmul_rs", choices=("ag_matmul", "matmul_rs"))
  ap.add_argument("--world", type=int, default=8)
  ap.add_argument("--dtype", default=bench_fp8.FP8, choices=(bench_fp8.FP8, "bfloat16"))
  ap.add_argument("--shape", default="16384,3584,8192", help="M,N,K")
  args = ap.parse_args(argv)
  m, n, k = (int(v) for v in args.shape.split(","))
  call, _buffers = bench_fp8.loopback_call(args.op, args.world, m, n, k, args.dtype)
  stages = list(bench_fp8.planned(args.op, args.world, m, n, k, args.dtype).stages)
  call = dict(call, stages=stages)
  us = _native_testing.time_loopback(0, args.op, args.world, call, 10)
  # no timing: its warm-up call alone, waited for
  warm_up_only = lambda: _native_testing.time_loopback(0, args.op, args.world, call, 0)  # noqa: E731
  events = _harness.gpu_events(_harness.profiled_trace(warm_up_only))
  t0 = events[0]["ts"]
  span = max(e["ts"] + e["dur"] for e in events) - t0
  print(f"{args.op} T={args.world} {args.dtype} {m}x{n}x{k} stages={stages}: "
        f"{us:.0f} us per call timed, {span:.0f} us traced")
  for e in events:
    print(f"  stream {str(e['tid'])[-6:]:>6} {e['ts'] - t0:7.1f} +{e['dur']:7.1f}  {e['name'][:80]}")


if __name__ == "__main__":
  main()
