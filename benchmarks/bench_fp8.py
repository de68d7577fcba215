"""Float8 ag_matmul / matmul_rs on one GPU: the op's vendor float8 GEMM against torch._scaled_mm and XLA's fp8
forms, and the T-chunk schedule in loopback.

  python benchmarks/bench_fp8.py [--out DIR] [--quick] [--tables T ...] [--shapes M,N,K ...] [--worlds T ...]

(DIR: $OUT when set, else benchmarks/results.) On the H200 the world-1 table takes about 3 minutes (XLA
autotunes its float8 dots when it compiles them), the loopback tables seconds. The results file is
rewritten after every row.

Three tables, every column measured in the same run (us per call, medians; e4m3 x and w, bfloat16 out):
  world 1    per M x N x K: jax_overlap.ag_matmul with algorithm="pipelined" in shard_map over one GPU (the vendor
             float8 GEMM as an FFI call), w K-major (`op_kmajor_us`) and w given [K, N] (`op_kn_us`: the lowering
             transposes w in each call, as XLA's forms do); XLA's direct f8 dot (`xla_f8_us`) and its
             f32-dequantized form (`xla_dq_us`), both with w [K, N], and XLA's bf16 dot; each 20 calls chained in
             one executable (wall time per call, the executable's launch and wait included). torch._scaled_mm
             (`torch_us`: cuBLASLt, K-major w, fast accumulation off as by default) and torch's bf16 matmul, 20
             calls back to back between CUDA events (GPU time). Every column takes its turn in each of ROUNDS
             rounds (medians). `op_kmajor_gpu_us`: the op's GPU time per chained call from the profiler, as
             torch's events count theirs; `op_kmajor_kernel_us` its GEMM kernel alone.
             Against issue 27's targets: torch_vs_op_gpu (torch / the op's GPU time; torch_vs_op with its wall
             time) >= 0.95; xla_best_vs_op_kn (XLA's best [K, N] form / op_kn) >= 1.0; xla_f8_vs_op (XLA's
             direct f8 dot / op) >= 1.5 at 4096 rows.
  blocks     per M x N x K: the op (a group of one, w K-major) with block scales (1x128 for x, 128x128 for w:
             cuBLASLt's block-scaled GEMM) against the op with one scale per operand (`op_tensor_us`), XLA's form of
             block scales (each operand times its scales repeated over their blocks, into a float32 dot:
             `xla_blocks_us`) and XLA's bf16 dot, chained and timed in turns as above.
  schedule   the op's schedule as rank 0 of T in loopback (csrc/pipelined/schedule.h): its chunk GEMMs (ag_matmul:
             one per shard, each with its shard's scale) on two compute streams beside the copy stream's traffic,
             this GPU's data standing in for the peers', with the stages the cost model plans, against one float8
             GEMM of the whole [M, K] @ [K, N] (`gemm_us`), timed in alternation (ROUNDS rounds); target
             gemm_vs_loopback >= 0.90. `model_us`: the cost model's estimate. `scales`: tensor (one per
             operand), or blocks (1x128 x 128x128: one GEMM per chunk, each with its own scales, against one
             block-scaled GEMM; the first shape only).
Results: DIR/fp8_<date>.json (with date, device, commit, command); the tables print last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU with JAX here

import jax  # noqa: E402  (after the environment above)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import _harness  # noqa: E402
import jax_overlap as jo  # noqa: E402
from jax_overlap import planning  # noqa: E402
from jax_overlap.runtime import native  # noqa: E402
from jax_overlap.ops import OPS  # noqa: E402
from jax_overlap.planning import pipelined  # noqa: E402
from jax_overlap.quantization import scaling  # noqa: E402
from jax_overlap.runtime import settings  # noqa: E402

SHAPES = [(16384, 3584, 8192), (16384, 8192, 3584), (4096, 3584, 8192)]  # M, N, K
WORLDS = [2, 4, 8]
ROUNDS = 7
CALLS = 20  # calls per timing, chained (JAX) or back to back (torch)
E4M3 = jnp.float8_e4m3fn
FP8 = "float8_e4m3fn"


def _chain(op):
  """CALLS calls of op(x, w, sx, sw) in one executable, each call's x depending on the previous output."""
  def run(x, w, sx, sw):
    for _ in range(CALLS):
      y = op(x, w, sx, sw)
      x = x.at[(0,) * x.ndim].set(y[(0,) * y.ndim].astype(x.dtype))
    return x
  return jax.jit(run)


def _jax_timer(fn, *args):
  """A timer of one run of fn(*args) (CALLS chained calls): wall time per call, us. Compiles and warms up first."""
  return _harness.synced_timer(fn, *args, calls=CALLS)


def _torch_timer(fn):
  """A timer of CALLS calls of fn back to back between CUDA events: GPU time per call, us."""
  import torch
  for _ in range(3):
    fn()

  def timed() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(CALLS):
      fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / CALLS
  return timed


def _torch_timers(m: int, n: int, k: int) -> dict:
  try:
    import torch
  except ImportError:
    return {}
  x = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
  w = torch.randn(n, k, device="cuda").mul(k ** -0.5).to(torch.float8_e4m3fn).t()  # K-major: column-major [K, N]
  scale = torch.tensor(1.0, device="cuda")
  xb, wb = torch.randn(m, k, device="cuda", dtype=torch.bfloat16), torch.randn(k, n, device="cuda",
                                                                                dtype=torch.bfloat16)
  return {"torch": _torch_timer(lambda: torch._scaled_mm(x, w, scale_a=scale, scale_b=scale,
                                                         out_dtype=torch.bfloat16)),
          "torch_bf16": _torch_timer(lambda: xb @ wb)}


def world_one(m: int, n: int, k: int) -> dict:
  # Drawn on the GPU: at these sizes NumPy's draw and float8 cast on the host take longer than the timings.
  kx, kw = jax.random.split(jax.random.key(m + n + k))
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(E4M3)
  w_kn = jax.random.normal(kw, (k, n), jnp.float32).astype(E4M3)
  w_nk = jax.device_put(jnp.asarray(w_kn).T.copy())
  sx, sw = jnp.float32(0.5), jnp.float32(0.5 / k ** 0.5)

  def op(w_kmajor):
    def call(x, w, sx, sw):
      return jax.shard_map(
          lambda x, w, sx, sw: jo.ag_matmul(x, w, x_scale=sx, w_scale=sw, out_dtype=jnp.bfloat16, w_kmajor=w_kmajor,
                                            axis_name="tp", algorithm="pipelined"),
          mesh=_harness.one_gpu_mesh(), in_specs=(P("tp"), P("tp", None) if w_kmajor else P(None, "tp"), P(), P()),
          out_specs=P(None, "tp"))(x, w, sx, sw)
    return call

  def xla_f8(x, w, sx, sw):
    del sx, sw  # the scales XLA's own scaled form takes are the dequantized form's
    return jnp.dot(x, w, preferred_element_type=jnp.bfloat16)

  def xla_dq(x, w, sx, sw):
    return jnp.dot(x.astype(jnp.float32) * sx, w.astype(jnp.float32) * sw,
                   preferred_element_type=jnp.float32).astype(jnp.bfloat16)

  def bf16(x, w, sx, sw):
    del sx, sw
    return jnp.dot(x, w)

  xb, wb = x.astype(jnp.bfloat16), w_kn.astype(jnp.bfloat16)
  chains = {"op_kmajor": (_chain(op(True)), x, w_nk), "op_kn": (_chain(op(False)), x, w_kn),
            "xla_f8": (_chain(xla_f8), x, w_kn), "xla_dq": (_chain(xla_dq), x, w_kn),
            "xla_bf16": (_chain(bf16), xb, wb)}
  timers = {}
  for name, (fn, a, b) in chains.items():
    _harness.note(f"  compiling {name}")
    timers[name] = _jax_timer(fn, a, b, sx, sw)
  timers.update(_torch_timers(m, n, k))
  row = dict(table="world 1", m=m, n=n, k=k, **_harness.in_turns(timers, ROUNDS))
  # The op's GPU time per call, as torch's events see theirs (the wall times above include the executable's launch).
  fn, a, b = chains["op_kmajor"]
  timeline = _harness.gpu_timeline(fn, a, b, sx, sw, unroll=CALLS, kernel=_harness.vendor_gemm_kernel)
  row.update(op_kmajor_gpu_us=timeline.get("call_us"), op_kmajor_kernel_us=timeline.get("kernel_us"))
  best_kn = min(row["xla_f8_us"], row["xla_dq_us"])
  row.update(**{f"{name}_tflops": _harness.tflops(m, n, k, row.get(f"{name}_us"))
                for name in ("op_kmajor", "xla_dq", "torch")},
             torch_vs_op=row["torch_us"] / row["op_kmajor_us"] if row.get("torch_us") else None,
             torch_vs_op_gpu=row["torch_us"] / row["op_kmajor_gpu_us"] if row.get("torch_us") and
             row.get("op_kmajor_gpu_us") else None,
             xla_best_vs_op_kn=best_kn / row["op_kn_us"], xla_f8_vs_op=row["xla_f8_us"] / row["op_kmajor_us"])
  return row


def world_one_blocks(m: int, n: int, k: int) -> dict:
  """The op with block scales (1x128 x 128x128) against the op with one scale per operand, XLA's form of block
  scales (the operands dequantized block by block into a float32 dot) and XLA's bf16 dot."""
  kx, kw, ks = jax.random.split(jax.random.key(m + n + k), 3)
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(E4M3)
  w_kn = jax.random.normal(kw, (k, n), jnp.float32).astype(E4M3)
  w_nk = jax.device_put(jnp.asarray(w_kn).T.copy())
  sx_blocks = jax.random.uniform(ks, (m, k // 128), jnp.float32, 0.3, 0.9)
  sw_blocks = jnp.full((n // 128, k // 128), 0.5 / k ** 0.5, jnp.float32)  # K-major, as w_nk
  sx, sw = jnp.float32(0.5), jnp.float32(0.5 / k ** 0.5)

  def op(x, w, sx, sw):
    return jo.ag_matmul(x, w, x_scale=sx, w_scale=sw, w_kmajor=True, algorithm="pipelined")

  def xla_blocks(x, w, sx, sw):  # w [N, K], its scales [N/128, K/128]: the form numerics.dequantized writes
    xs, ws = jnp.repeat(sx, 128, axis=1), jnp.repeat(jnp.repeat(sw, 128, axis=0), 128, axis=1)
    return jnp.dot(x.astype(jnp.float32) * xs, (w.astype(jnp.float32) * ws).T,
                   preferred_element_type=jnp.float32).astype(jnp.bfloat16)

  def bf16(x, w, sx, sw):
    del sx, sw
    return jnp.dot(x, w)

  chains = {"op_tensor": (_chain(op), x, w_nk, sx, sw), "op_blocks": (_chain(op), x, w_nk, sx_blocks, sw_blocks),
            "xla_blocks": (_chain(xla_blocks), x, w_nk, sx_blocks, sw_blocks),
            "xla_bf16": (_chain(bf16), x.astype(jnp.bfloat16), w_kn.astype(jnp.bfloat16), sx, sw)}
  timers = {}
  for name, (fn, *args) in chains.items():
    _harness.note(f"  compiling {name}")
    timers[name] = _jax_timer(fn, *args)
  row = dict(table="blocks", m=m, n=n, k=k, **_harness.in_turns(timers, ROUNDS))
  row.update(**{f"{name}_tflops": _harness.tflops(m, n, k, row[f"{name}_us"]) for name in timers},
             blocks_vs_tensor=row["op_tensor_us"] / row["op_blocks_us"],
             xla_blocks_vs_op=row["xla_blocks_us"] / row["op_blocks_us"],
             bf16_vs_op_blocks=row["xla_bf16_us"] / row["op_blocks_us"])
  return row


def loopback_call(op: str, world: int, m_total: int, n: int, k: int, dtype: str, blocks: bool = False) -> tuple:
  """(the loopback call dict, its device buffers) of rank 0 of `world`; each rank's GEMM [m_total, k] @ [k, n]
  (blocks: with block scales, in the layouts the schedule reads: csrc/core/block_scales.h)."""
  nat, dev = native.module(), jax.devices()[0]
  scaled = dtype == FP8
  m = m_total // world if op == "ag_matmul" else m_total  # x's rows per rank
  kx, kw = jax.random.split(jax.random.key(world))  # drawn on the GPU, as in world_one
  put = lambda a: jax.device_put(a, dev)
  x = put(jax.random.normal(kx, (1, m, k), jnp.float32).astype(dtype))
  w = put(jax.random.normal(kw, (n, k) if scaled else (k, n), jnp.float32).astype(dtype))  # float8: K-major
  out = put(jnp.zeros((1, world * m if op == "ag_matmul" else m // world, n), jnp.bfloat16))
  gathered = put(jnp.zeros((1, world * m, k), dtype)) if op == "ag_matmul" else None
  # x_scale, w_scale and ag_matmul's gathered scales, 16 bytes apart: the vendor GEMM takes 16-byte aligned scales
  scales = put(jnp.ones((8 + world,), jnp.float32))
  scratch = put(jnp.zeros((nat.pipelined_scratch_bytes(op, world, 1, m, n, 2, True),), jnp.uint8))
  buffers = [x, w, out, gathered, scales, scratch]
  jax.block_until_ready([b for b in buffers if b is not None])
  ptr = lambda a: a.unsafe_buffer_pointer() if a is not None else 0
  call = dict(dtype=dtype, out_dtype="bfloat16", x=ptr(x), w=ptr(w), bias=0, out=ptr(out), gathered=ptr(gathered),
              scratch=ptr(scratch), batch=1, m=m, k=k, n=n, w_kmajor=scaled)
  if blocks:
    kb = k // 128
    ones = lambda count: put(jnp.full((count,), 0.5, jnp.float32))  # noqa: E731
    block_scales = [ones(m * kb), ones(n // 128 * -(-kb // 4) * 4), ones(world * m * kb)]
    buffers += block_scales
    call.update(blocks=True, x_scale=ptr(block_scales[0]), w_scale=ptr(block_scales[1]),
                gathered_scales=ptr(block_scales[2]) if op == "ag_matmul" else 0)
  elif scaled:
    base = ptr(scales)
    call.update(x_scale=base, w_scale=base + 16, gathered_scales=base + 32 if op == "ag_matmul" else 0)
  return call, buffers


def planned(op: str, world: int, m_total: int, n: int, k: int, dtype: str, blocks: bool = False):
  """The cost model's plan for the loopback: the figures with this GPU's copy engine as the "link"; its stages
  pinned as a call's are by JAX_OVERLAP_PIPELINE_STAGES (settings.PIPELINE_STAGES) where that names this T."""
  spec = OPS[op]
  m = m_total // world if op == "ag_matmul" else m_total
  types = (dtype, "bfloat16") if dtype == FP8 else None
  f = planning.figures.measure(spec, dtype, m, k, n, world, dtype == FP8, types=types,
                              scaling=(scaling.BLOCK if blocks else scaling.TENSOR) if dtype == FP8 else None)
  f = planning.figures.in_loopback(f)
  pinned = os.environ.get(settings.PIPELINE_STAGES)
  return pipelined.plan(spec, world, f, pipelined.parse_stages(pinned, spec, world) if pinned else None)


def _gemm_us(m: int, n: int, k: int, dtype: str, blocks: bool = False) -> float:
  extra = dict(w_dtype=dtype, out_dtype="bfloat16", blocks=blocks) if dtype == FP8 else {}
  return native.module().time_gemms(0, dtype, [m], n, k, w_kmajor=dtype == FP8, **extra)[0]


def schedule(op: str, world: int, m_total: int, n: int, k: int, blocks: bool = False) -> dict:
  from jax_overlap import _native_testing  # the harness module: GPU builds only
  call, _buffers = loopback_call(op, world, m_total, n, k, FP8, blocks)
  plan = planned(op, world, m_total, n, k, FP8, blocks)
  gemms, loops = [], []
  for _ in range(ROUNDS):  # the clocks drift between minutes: alternate, then compare medians
    gemms.append(_gemm_us(m_total, n, k, FP8, blocks))
    loops.append(_native_testing.time_loopback(0, op, world, dict(call, stages=list(plan.stages)), 10))
  gemm, loop = statistics.median(gemms), statistics.median(loops)
  return dict(table="schedule", op=op, scales="blocks" if blocks else "tensor", world=world, m=m_total, n=n, k=k,
              stages=str(tuple(plan.stages)), model_us=plan.est_us, loopback_us=loop, gemm_us=gemm,
              gemm_vs_loopback=gemm / loop)


TABLES = ("world1", "blocks", "schedule")


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
  ap.add_argument("--quick", action="store_true", help="the first shape and T = 4 only")
  ap.add_argument("--tables", nargs="*", choices=TABLES, default=TABLES)
  ap.add_argument("--shapes", nargs="*", help="M,N,K per shape (default: all three)")
  ap.add_argument("--worlds", nargs="*", type=int, help="T of the loopback tables (default: 2 4 8)")
  args = ap.parse_args(argv)
  shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
  worlds = args.worlds or WORLDS
  if args.quick:
    shapes, worlds = shapes[:1], [4]
  work = [("world1", (m, n, k)) for m, n, k in shapes]
  work += [("blocks", (m, n, k)) for m, n, k in shapes]
  work += [("schedule", (op, world, *shape, blocks)) for blocks in (False, True)
           for shape in (shapes[:2] if not blocks else shapes[:1]) for op in ("ag_matmul", "matmul_rs")
           for world in worlds]
  work = [(table, a) for table, a in work if table in args.tables]
  run = {"world1": world_one, "blocks": world_one_blocks, "schedule": schedule}
  command, rows = "python " + " ".join(sys.argv), []
  for table, a in work:
    _harness.progress(len(rows), len(work), f"{table} {a}")
    rows.append(run[table](*a))
    # Written after every row: a run cut short by a time limit keeps what it measured.
    path = _harness.write_results("fp8", rows, args.out, command,
                                  series=(("op_kmajor", "#ff7f0e"), ("xla_dq", "#1f77b4"), ("torch", "#7f7f7f")),
                                  plotted=lambda r: r["table"] == "world 1")
  _harness.progress(len(rows), len(work), "done")
  print(f"results: {path}.json, {path}.svg")
  _harness.print_table([r for r in rows if r["table"] == "world 1"],
                       ["m", "n", "k", "op_kmajor_us", "op_kmajor_gpu_us", "op_kmajor_kernel_us", "op_kn_us",
                        "torch_us", "xla_f8_us", "xla_dq_us", "xla_bf16_us", "torch_bf16_us", "op_kmajor_tflops",
                        "torch_vs_op", "torch_vs_op_gpu", "xla_best_vs_op_kn", "xla_f8_vs_op"])
  _harness.print_table([r for r in rows if r["table"] == "blocks"],
                       ["m", "n", "k", "op_tensor_us", "op_blocks_us", "xla_blocks_us", "xla_bf16_us",
                        "op_blocks_tflops", "blocks_vs_tensor", "xla_blocks_vs_op", "bf16_vs_op_blocks"])
  _harness.print_table([r for r in rows if r["table"] == "schedule"],
                       ["op", "scales", "world", "m", "n", "k", "stages", "model_us", "loopback_us", "gemm_us",
                        "gemm_vs_loopback"])


if __name__ == "__main__":
  np.set_printoptions(linewidth=120)
  main()
