"""The pipelined algorithm on one GPU: a group of one against cuBLAS and XLA, and the T-chunk schedule.

  python benchmarks/bench_pipelined.py [--out benchmarks/results] [--quick] [--plans]

Two tables, all columns measured in the same run (bf16, us per call):
  group of one   jax_overlap with algorithm="pipelined" in shard_map over one GPU (the vendor GEMM as an
                 FFI call) and "xla" (XLA's dot), each 20 calls chained in one executable (wall, per call);
                 cuBLAS (torch.matmul) on the same data, each call alone and 20 back to back; `gpu_idle` is
                 the GPU's idle time per chained call (launch gaps, from the profiler), `pipelined_vs_cublas`
                 compares the chained call with cuBLAS back to back (like with like).
  schedule       the op's schedule as rank 0 of T in loopback (csrc/pipelined/schedule.h): the chunk GEMMs
                 on two compute streams and the copy stream moving (T-1)/T of x's bytes (ag_matmul) or of
                 the partials (matmul_rs) beside them, this GPU's data standing in for the peers'; against one
                 vendor GEMM of the whole [M, K] @ [K, N] (`gemm_us`, the same library and heuristic), for the
                 plan the cost model picks on this GPU (`stages`) and for one chunk per stage; the three are
                 timed in alternation, 5 rounds, medians. `model_us` is the cost model's estimate of the
                 planned schedule from the measured figures; `model_w<ms>_us` the same from GEMMs timed
                 after <ms> milliseconds of GEMMs back to back (time_gemms warmup_ms): which warm-up makes
                 the model predict the schedule. matmul_rs rows add `reduce_us`, its reduction kernel alone
                 (world blocks into one), and the HBM rate it reached (`reduce_tb_s`: bytes read and written).
  plan           (--plans) every plan of each schedule row, each timed in loopback in alternation (ROUNDS
                 rounds, medians, with the reference GEMM once per round), beside the model's estimate: whether
                 the model ranks the plans as they run.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import _harness
import jax_overlap as jo
from jax_overlap import planning
from jax_overlap.runtime import native
from jax_overlap.ops import OPS
from jax_overlap.planning import pipelined

SHAPES = [(16384, 3584, 8192), (16384, 8192, 3584), (1024, 3584, 8192)]  # M total, N, K per rank
WORLDS = [2, 4, 8]
ROUNDS = 5  # alternations of the schedule's timings with the reference GEMM's
WARMUPS_MS = (0, 300, 1000)  # GEMM warm-ups before the model's figures are timed


def group_of_one(m: int, n: int, k: int) -> dict:
  def make(algorithm):
    return lambda x, w: jax.shard_map(lambda x, w: jo.ag_matmul(x, w, axis_name="tp", algorithm=algorithm),
                                      mesh=_harness.one_gpu_mesh(), in_specs=(P("tp"), P(None, "tp")),
                                      out_specs=P(None, "tp"))(x, w)
  x, w = _harness.random_bf16((m, k), 0), _harness.random_bf16((k, n), 1) * (k ** -0.5)
  pipelined, xla = _harness.chained(make("pipelined")), _harness.chained(make("xla"))
  p_us, x_us = _harness.wall_us(pipelined, x, w), _harness.wall_us(xla, x, w)
  timeline = _harness.gpu_timeline(pipelined, x, w, kernel=_harness.vendor_gemm_kernel)
  c_us, c_b2b = _harness.cublas_us(m, n, k), _harness.cublas_us(m, n, k, back_to_back=_harness.UNROLL)
  kernel = timeline.get("kernel_us")
  return dict(table="group of one", m=m, n=n, k=k, pipelined_us=p_us, xla_us=x_us, kernel_us=kernel,
              gpu_idle_us=timeline.get("idle_us"), cublas_us=c_us, cublas_b2b_us=c_b2b,
              pipelined_vs_cublas=(c_b2b / p_us) if c_b2b else None,
              kernel_vs_cublas=(c_b2b / kernel) if c_b2b and kernel else None,
              pipelined_tflops=_harness.tflops(m, n, k, p_us), xla_tflops=_harness.tflops(m, n, k, x_us),
              cublas_tflops=_harness.tflops(m, n, k, c_us))


def schedule(op: str, world: int, m_total: int, n: int, k: int, every_plan: bool) -> list[dict]:
  """Loopback timing of the op's schedule (and with every_plan, of each of its plans); each rank's GEMM is
  [m_total, k] @ [k, n]."""
  from jax_overlap import _native_testing as harness  # GPU builds only
  nat, dev = native.module(), jax.devices()[0]
  m = m_total // world if op == "ag_matmul" else m_total  # x's rows per rank
  put = lambda a: jax.device_put(a, dev)
  x = put(_harness.random_bf16((1, m, k), 2))
  w = put(_harness.random_bf16((k, n), 3) * (k ** -0.5))
  out = put(jnp.zeros((1, world * m if op == "ag_matmul" else m // world, n), jnp.bfloat16))
  gathered = put(jnp.zeros((1, world * m, k), jnp.bfloat16)) if op == "ag_matmul" else None
  scratch = put(jnp.zeros((nat.pipelined_scratch_bytes(op, world, 1, m, n, 2, True),), jnp.uint8))
  jax.block_until_ready([x, w, out, scratch])
  spec = OPS[op]
  figures = planning.figures.measure(spec, "bfloat16", m, k, n, world, False)
  # loopback: the "link" is this GPU's copy engine
  figures = dataclasses.replace(figures, link_bytes_per_us=figures.local_bytes_per_us)
  plan = pipelined.plan(spec, world, figures)
  ptr = lambda a: a.unsafe_buffer_pointer() if a is not None else 0
  base = dict(dtype="bfloat16", x=ptr(x), w=ptr(w), bias=0, out=ptr(out), gathered=ptr(gathered),
              scratch=ptr(scratch), batch=1, m=m, k=k, n=n, w_kmajor=False)
  chunk = spec.planning.chunk_rows(m, world)
  models = {}
  for ms in WARMUPS_MS:
    warm = nat.time_gemms(0, "bfloat16", [chunk * s for s in range(1, world + 1)], n, k, warmup_ms=ms)
    models[f"model_w{ms}_us"] = pipelined.plan(spec, world, dataclasses.replace(figures, gemm_us=tuple(warm)),
                                               plan.stages).est_us
  # The GPU's clocks drift by up to 17% between minutes under this load: time the references and the
  # schedules in alternation, ROUNDS times, and compare medians.
  runs = {"planned": plan.stages, "chunks": (1,) * world}
  timed = {name: [] for name in ("gemm", *runs)}
  for _ in range(ROUNDS):
    timed["gemm"].append(nat.time_gemms(0, "bfloat16", [m_total], n, k)[0])
    for name, stages in runs.items():
      timed[name].append(harness.time_loopback(0, op, world, dict(base, stages=list(stages)), 10))
  timed = {name: float(np.median(t)) for name, t in timed.items()}
  gemm = timed["gemm"]
  row = dict(table="schedule", op=op, world=world, m=m_total, n=n, k=k, stages=str(tuple(plan.stages)),
             model_us=plan.est_us, **models, loopback_us=timed["planned"], chunks_us=timed["chunks"], gemm_us=gemm,
             gemm_vs_loopback=gemm / timed["planned"], gemm_vs_chunks=gemm / timed["chunks"])
  if op == "matmul_rs":
    reduce = nat.time_reduce(0, "bfloat16", world, chunk, n)
    row.update(reduce_us=reduce, reduce_tb_s=(world + 1) * chunk * n * 2 / reduce / 1e6)
  rows = [row]
  if every_plan:
    plans = spec.planning.stage_candidates(world)
    times, gemms = {p: [] for p in plans}, []
    for _ in range(ROUNDS):  # the reference GEMM again in each round: the clocks drift between the tables
      gemms.append(nat.time_gemms(0, "bfloat16", [m_total], n, k)[0])
      for p in plans:
        times[p].append(harness.time_loopback(0, op, world, dict(base, stages=list(p)), 10))
    plans_gemm = float(np.median(gemms))
    for p in plans:
      loop = float(np.median(times[p]))
      rows.append(dict(table="plan", op=op, world=world, m=m_total, n=n, k=k, stages=str(p),
                       model_us=pipelined.plan(spec, world, figures, p).est_us, loopback_us=loop,
                       gemm_us=plans_gemm, gemm_vs_loopback=plans_gemm / loop, planned=p == tuple(plan.stages)))
  return rows


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="benchmarks/results")
  ap.add_argument("--quick", action="store_true", help="the 16384-row shapes only")
  ap.add_argument("--plans", action="store_true", help="also time every plan of each schedule row (table `plan`)")
  args = ap.parse_args(argv)
  shapes = SHAPES[:2] if args.quick else SHAPES
  steps = len(shapes) + 2 * len(WORLDS) * 2
  rows = []
  for m, n, k in shapes:
    _harness.progress(len(rows), steps, f"group of one {m}x{n}x{k}")
    rows.append(group_of_one(m, n, k))
  done = len(rows)
  for m, n, k in shapes[:2]:
    for op in ("ag_matmul", "matmul_rs"):
      for world in WORLDS:
        _harness.progress(done, steps, f"{op} T={world} {m}x{n}x{k}")
        rows += schedule(op, world, m, n, k, args.plans)
        done += 1
  _harness.progress(done, steps, "done")
  path = _harness.write_results("pipelined", rows, args.out, "python " + " ".join(sys.argv),
                                series=(("pipelined", "#ff7f0e"), ("xla", "#1f77b4"), ("cublas", "#7f7f7f")),
                                plotted=lambda r: r["table"] == "group of one")
  _harness.print_table([r for r in rows if r["table"] == "group of one"],
                       ["m", "n", "k", "pipelined_us", "xla_us", "cublas_us", "cublas_b2b_us", "kernel_us",
                        "gpu_idle_us", "pipelined_vs_cublas", "kernel_vs_cublas"])
  _harness.print_table([r for r in rows if r["table"] == "schedule"],
                       ["op", "world", "m", "n", "k", "stages", "model_us", *(f"model_w{ms}_us" for ms in WARMUPS_MS),
                        "loopback_us", "chunks_us", "gemm_us", "gemm_vs_loopback", "gemm_vs_chunks", "reduce_us",
                        "reduce_tb_s"])
  if args.plans:
    _harness.print_table([r for r in rows if r["table"] == "plan"],
                         ["op", "world", "n", "k", "stages", "planned", "model_us", "loopback_us", "gemm_us",
                          "gemm_vs_loopback"])
  print(f"results: {path}.json, {path}.svg")


if __name__ == "__main__":
  np.set_printoptions(linewidth=120)
  main()
