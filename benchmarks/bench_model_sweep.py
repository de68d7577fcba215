"""The pipelined cost model against the loopback schedule across sizes, and auto against XLA's path (issue 39, item 4).

  python benchmarks/bench_model_sweep.py [--out DIR] [--rows M ...] [--worlds T ...] [--ops OP ...]
                                         [--dtypes D ...] [--budget-s S] [--x-scale-shared]
  python benchmarks/bench_model_sweep.py --fit JSON ...

(DIR: $OUT when set, else benchmarks/results.) One row per (op, dtype, T, M), M the rows per rank (ag_matmul: x's
shard; matmul_rs: the output's block), so that every rank's GEMM is [T*M, K] @ [K, N] (K = 8192, N = 3584, as in
16384 x 3584 x 8192 at T = 8, M = 2048); bf16, and float8 (e4m3, tensor scales, w K-major, bf16 out; with
--x-scale-shared, ag_matmul's x scale is every rank's: a stage's shards in one GEMM, column x_scale_shared). Rows run
from the smallest M up and stop being started after --budget-s (default 280 s: about 5 minutes on the H200 with
the compiles), the results file rewritten after each. Columns, measured in the same run (us, medians of ROUNDS
rounds in turns), each timing after --sustained-ms of the row's GEMM back to back (default: the figures' own
warm-up, planning/figures.py GEMM_WARMUP_MS), so that measurement and model see the sustained clocks a training
step runs at (0: none, the GPU as the previous timing left it):
  stages        the plan the cost model picks from this GPU's figures (the local copy standing in for the link)
  model_us      its estimate of that plan; loopback_us the schedule run as rank 0 of T in loopback
                (csrc/pipelined/schedule.h: the chunk GEMMs, the copies, the streams; this GPU's data for the
                peers'), calls back to back as gemm_us times its GEMMs and as a training step's calls run;
                model_ratio = model_us / loopback_us (target: within 10%)
  loopback_synced_us  the same, one call at a time between two events, waited for: it also times the host's
                enqueue up to the call's first GEMM (vs_gemm_synced = gemm_us / loopback_synced_us)
  loopback_host_us  the host's time to enqueue one loopback call, calls back to back; host_ratio =
                loopback_host_us / loopback_us: near 1, calls back to back run at the host's pace, not the GPU's
  gemm_us       one vendor GEMM of all T*M rows (the GEMMs tuned as calls tune them: planning/tuning.py), back to
                back; vs_gemm = gemm_us / loopback_us (targets 0.93 bf16, 0.90 fp8 for M >= 2048)
  stages_gemm_us  the plan's GEMMs alone (the figures), and chunking_loss = stages_gemm_us / gemm_us - 1: what
                cutting the GEMM into stages costs by M and T (whether a persistent GEMM fed by the copy
                engines would pay)
  xla_dot_us    XLA's own dot of all rows (autotuned; 20 chained calls per timing, wall time per call: a few us
                of launch included); xla_path_us = xla_dot_us + the collective's (T-1) chunks at the local copy
                rate: the XLA path in loopback (a float8 ag_matmul's runs one dot per shard, each with its
                scale: one dot of all rows is a lower bound of it); model_xla_us the model's XLA path
  auto          whether algorithm="auto" takes the pipelined path here (the model's margin, planning.AUTO_MARGIN);
                auto_wrong: it does while loopback_us > xla_path_us (must never be)
  residual_us   loopback_us - model_us, beside stages and moved_mb, the bytes the loopback call copies within
                the GPU (ag_matmul: its own rows and T - 1 stand-in pulls; matmul_rs: T - 1 pulls), for fits
  figures       what the model was given (planning/figures.py Figures), so that a changed model can be checked
                against the row without the GPU
Last, the model's fixed figures fitted to every row (planning/figures.py Figures: stage_overhead_us,
call_overhead_us, sm_pull_hidden; a grid search for the fewest rows off by more than 10%), and each row's ratio
with them (fit_ratio). --fit FILE ... fits them to recorded sweeps instead, without a GPU.
Results: DIR/model_sweep_<date>.json (with date, device, commit, command); the tables print last.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import _harness  # noqa: E402
import bench_fp8  # noqa: E402
from jax_overlap import planning  # noqa: E402
from jax_overlap.ops import OPS  # noqa: E402
from jax_overlap.planning import pipelined, tuning  # noqa: E402
from jax_overlap.quantization import scaling  # noqa: E402
from jax_overlap.runtime import native  # noqa: E402

K, N = 8192, 3584
ROWS = [128 << i for i in range(8)]  # 128 .. 16384
WORLDS = [2, 4, 8]
ROUNDS = 3
FP8 = bench_fp8.FP8
_xla_dots: dict = {}  # (rows, dtype) -> a timer of XLA's dot (each compiled once)


def _xla_dot_timer(rows: int, dtype: str):
  """XLA's dot [rows, K] @ [K, N] (float8: w [N, K], K-major, the form XLA's fp8 GEMM takes), CALLS chained."""
  if (rows, dtype) not in _xla_dots:
    kx, kw = jax.random.split(jax.random.key(rows))
    x = jax.random.normal(kx, (rows, K), jnp.float32).astype(dtype)
    if dtype == FP8:
      w = jax.random.normal(kw, (N, K), jnp.float32).astype(dtype)
      dot = lambda x, w, sx, sw: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())),  # noqa: E731
                                                     preferred_element_type=jnp.bfloat16)
    else:
      w = (jax.random.normal(kw, (K, N), jnp.float32) * K ** -0.5).astype(dtype)
      dot = lambda x, w, sx, sw: jnp.dot(x, w)  # noqa: E731
    _harness.note(f"  compiling XLA's dot of {rows} rows ({dtype})")
    s = jnp.float32(1.0)
    _xla_dots[(rows, dtype)] = bench_fp8._jax_timer(bench_fp8._chain(dot), x, w, s, s)
  return _xla_dots[(rows, dtype)]


def _figures(op: str, world: int, m_x: int, dtype: str, shared: bool = False):
  spec = OPS[op]
  fp8 = dtype == FP8
  f = planning.figures.measure(spec, dtype, m_x, K, N, world, fp8, types=(dtype, "bfloat16") if fp8 else None,
                               scaling=scaling.TENSOR.sharing_x(shared) if fp8 else None)
  return planning.figures.in_loopback(f)


def _sustained(timed, warm):
  """timed, each call after warm() (the GPU put on its sustained clocks)."""
  def run() -> float:
    warm()
    return timed()
  return run


def row(op: str, dtype: str, world: int, m: int, sustained_ms: float, shared: bool = False) -> tuple:
  """(the row, its figures) of M = m rows per rank; each timing after sustained_ms of GEMMs. shared: a float8
  ag_matmul's x scale is every rank's (Scaling.x_shared)."""
  from jax_overlap import _native_testing as harness  # GPU builds only
  nat, spec = native.module(), OPS[op]
  total = world * m  # every rank's GEMM rows
  m_x = m if op == "ag_matmul" else total  # x's rows per rank
  shared = shared and op == "ag_matmul" and dtype == FP8
  f = _figures(op, world, m_x, dtype, shared)
  plan = pipelined.plan(spec, world, f)
  call, _buffers = bench_fp8.loopback_call(op, world, total, N, K, dtype)
  call = dict(call, stages=list(plan.stages), x_scale_shared=shared)
  opts = tuning.options()
  for pid in harness.loopback_gemm_problems(0, op, world, call):  # the loopback's own GEMMs, tuned as a call's are
    nat.tune_gemm(0, pid, **opts)
  extra = dict(w_dtype=dtype, out_dtype="bfloat16") if dtype == FP8 else {}
  gemm = lambda warmup_ms=0.0: nat.time_gemms(0, dtype, [total], N, K, w_kmajor=dtype == FP8,  # noqa: E731
                                               warmup_ms=warmup_ms, **extra, **opts)[0]
  warm = (lambda: gemm(sustained_ms)) if sustained_ms > 0 else (lambda: None)
  timers = {
      "loopback": _sustained(lambda: harness.time_loopback(0, op, world, call, 10, back_to_back=True), warm),
      "loopback_synced": _sustained(lambda: harness.time_loopback(0, op, world, call, 10), warm),
      "gemm": lambda: gemm(sustained_ms),
      "xla_dot": _sustained(_xla_dot_timer(total, dtype), warm),
  }
  t = _harness.in_turns(timers, ROUNDS)
  host = harness.time_loopback_enqueue(0, op, world, call, 10)
  stages_gemm = sum(pipelined.gemm_us(f, s) for s in plan.stages)
  xla_path = t["xla_dot_us"] + (world - 1) * f.chunk_bytes / f.local_bytes_per_us
  auto = planning.faster(plan.est_us, plan.est_xla_us)
  moved = (world if op == "ag_matmul" else world - 1) * f.chunk_bytes
  r = dict(op=op, dtype=dtype, x_scale_shared=shared, world=world, m=m, rows=total, n=N, k=K,
           stages=str(tuple(plan.stages)),
           model_us=plan.est_us, loopback_us=t["loopback_us"], model_ratio=plan.est_us / t["loopback_us"],
           loopback_synced_us=t["loopback_synced_us"], loopback_host_us=host, host_ratio=host / t["loopback_us"],
           gemm_us=t["gemm_us"], vs_gemm=t["gemm_us"] / t["loopback_us"],
           vs_gemm_synced=t["gemm_us"] / t["loopback_synced_us"], stages_gemm_us=stages_gemm,
           chunking_loss=stages_gemm / f.gemm_us[-1] - 1, xla_dot_us=t["xla_dot_us"], xla_path_us=xla_path,
           model_xla_us=plan.est_xla_us, auto=auto, auto_wrong=auto and t["loopback_us"] > xla_path,
           residual_us=t["loopback_us"] - plan.est_us, moved_mb=moved / 2**20, stage_count=len(plan.stages),
           figures=dataclasses.asdict(f))
  return r, f


# The grid the fit searches: stage and call overheads (us), and the share of a pull on the SMs the GEMMs hide.
FIT_GRID = (np.arange(0.0, 3.1, 0.5), np.arange(0.0, 10.1, 1.0), np.arange(0.0, 0.61, 0.1))
FITTED = ("stage_overhead_us", "call_overhead_us", "sm_pull_hidden")


def _stages(r: dict) -> tuple:
  return tuple(int(s) for s in r["stages"].strip("()").split(",") if s.strip())


def fit_model(rows: list, figures: list) -> dict:
  """The model's fitted figures (FITTED: planning/figures.py Figures) that leave the fewest rows off the loopback
  by more than 10% (then the least worst |model / loopback - 1|) over FIT_GRID, with the settings tied with them,
  each row's ratio with them (fit_ratio), and the count and worst before and after."""
  def ratios(values):
    fitted = dict(zip(FITTED, values))
    return [OPS[r["op"]].planning.pipelined_us(_stages(r), dataclasses.replace(f, **fitted)) / r["loopback_us"]
            for r, f in zip(rows, figures)]
  def score(values):
    x = ratios(values)
    return int(sum(abs(v - 1) > 0.10 for v in x)), round(float(max(abs(v - 1) for v in x)), 4)
  grid = [tuple(round(float(p), 2) for p in v) for v in itertools.product(*FIT_GRID)]
  scored = sorted((score(v), v) for v in grid)
  (off, worst), best = scored[0]
  for r, x in zip(rows, ratios(best)):
    r["fit_ratio"] = x
  before = [r["model_ratio"] for r in rows]
  return dict(zip(FITTED, best), rows_off_before=int(sum(abs(x - 1) > 0.10 for x in before)),
              worst_before=float(max(abs(x - 1) for x in before)), rows_off_after=off, worst_after=worst,
              tied=[dict(zip(FITTED, v)) for (o, _), v in scored if o == off])


def _recorded(paths: list) -> tuple:
  """The rows of recorded sweeps and the figures their model was given (on the SMs where a file's device is an
  NVIDIA GPU and its figures predate the field: loopback's copies within one GPU)."""
  rows, figs = [], []
  for path in paths:
    with open(path) as fh:
      recorded = json.load(fh)
    nvidia = recorded["meta"]["device"].startswith("NVIDIA")
    for r in recorded["rows"]:
      if "op" not in r:
        continue
      f = dict(r["figures"])
      f.update({k: tuple(f[k]) for k in ("gemm_us", "stage_gemm_us") if f[k] is not None})
      f.setdefault("publish_on_sms", nvidia)
      f.setdefault("pulls_on_sms", nvidia)
      figs.append(planning.figures.Figures(**{k: v for k, v in f.items() if k not in FITTED}))
      rows.append(r)
  return rows, figs


def _print_fit(fit: dict) -> None:
  print(f"fitted: stage {fit['stage_overhead_us']:.1f} us, call {fit['call_overhead_us']:.1f} us, pulls on the SMs "
        f"hidden {fit['sm_pull_hidden']:.1f}: rows off by > 10% {fit['rows_off_before']} -> {fit['rows_off_after']}, "
        f"worst |model/loopback - 1| {fit['worst_before']:.3f} -> {fit['worst_after']:.3f}; "
        f"{len(fit['tied'])} settings leave as few rows off")


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
  ap.add_argument("--rows", nargs="*", type=int, default=ROWS, help="M, rows per rank")
  ap.add_argument("--worlds", nargs="*", type=int, default=WORLDS)
  ap.add_argument("--ops", nargs="*", choices=sorted(OPS), default=sorted(OPS))
  ap.add_argument("--dtypes", nargs="*", choices=["bfloat16", FP8], default=["bfloat16", FP8])
  ap.add_argument("--budget-s", type=float, default=280.0, help="no row starts after this many seconds")
  ap.add_argument("--sustained-ms", type=float, default=planning.figures.GEMM_WARMUP_MS,
                  help="GEMMs back to back before each timing (ms; 0: none)")
  ap.add_argument("--x-scale-shared", action="store_true",
                  help="float8 ag_matmul rows with one x scale on every rank (a stage's shards in one GEMM)")
  ap.add_argument("--fit", nargs="+", metavar="JSON",
                  help="no GPU: fit the model's fixed figures to the rows of these recorded sweeps, print them")
  args = ap.parse_args(argv)
  if args.fit:
    rows, figs = _recorded(args.fit)
    fit = fit_model(rows, figs)
    now = [OPS[r["op"]].planning.pipelined_us(_stages(r), f) / r["loopback_us"] for r, f in zip(rows, figs)]
    print(f"{len(rows)} rows; the model as it is: {sum(abs(x - 1) > 0.10 for x in now)} off by > 10%, worst "
          f"{max(abs(x - 1) for x in now):.3f}")
    _print_fit(fit)
    return
  work = [(op, dtype, world, m) for m in sorted(args.rows) for world in args.worlds for op in args.ops
          for dtype in args.dtypes]
  command, rows, figures, t0 = "python " + " ".join(sys.argv), [], [], time.monotonic()
  for i, (op, dtype, world, m) in enumerate(work):
    if time.monotonic() - t0 > args.budget_s:
      _harness.note(f"budget of {args.budget_s:.0f} s spent: {len(work) - i} rows not run (from M = {m})")
      break
    _harness.progress(i, len(work), f"{op} {dtype} T={world} M={m}")
    r, f = row(op, dtype, world, m, args.sustained_ms, args.x_scale_shared)
    rows.append(r)
    figures.append(f)
    path = _harness.write_results("model_sweep", rows, args.out, command, plotted=lambda r: False,
                                  meta={"sustained_ms": args.sustained_ms})
  fit = fit_model(rows, figures) if rows else {}
  path = _harness.write_results("model_sweep", rows + ([dict(table="fit", **fit)] if fit else []), args.out,
                                command, plotted=lambda r: False, meta={"sustained_ms": args.sustained_ms})
  cols = ["op", "dtype", "world", "m", "stages", "model_us", "loopback_us", "model_ratio", "fit_ratio", "host_ratio",
          "gemm_us", "vs_gemm", "vs_gemm_synced", "chunking_loss", "xla_path_us", "auto", "auto_wrong", "residual_us", "moved_mb"]
  _harness.print_table(rows, cols)
  if fit:
    wrong = [r for r in rows if r["auto_wrong"]]
    off = [r for r in rows if abs(r["model_ratio"] - 1) > 0.10]
    low = [r for r in rows if r["m"] >= 2048 and r["vs_gemm"] < (0.93 if r["dtype"] == "bfloat16" else 0.90)]
    _print_fit(fit)
    print(f"rows: {len(rows)} of {len(work)}; model off by > 10%: {len(off)}; auto slower than XLA's path: "
          f"{len(wrong)}; below the vs_gemm target at M >= 2048: {len(low)}")
    print("chunking loss by T (median over M >= 2048): " + ", ".join(
        f"T={w}: {statistics.median([r['chunking_loss'] for r in rows if r['world'] == w and r['m'] >= 2048]):.3f}"
        for w in args.worlds if any(r["world"] == w and r["m"] >= 2048 for r in rows)))
  print(f"results: {path}.json")


if __name__ == "__main__":
  np.set_printoptions(linewidth=120)
  main()
