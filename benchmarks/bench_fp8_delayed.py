"""The delayed-scaling fp8 layer on one GPU, forward from bf16 inputs, against XLA's bf16 dot in the same run.

  python benchmarks/bench_fp8_delayed.py [--out DIR] [--small]

Writes fp8_delayed_<date>.json to --out (default: $OUT, else benchmarks/results) and prints the tables last. All
columns are measured in the same run; us per call, each variant's calls chained in one executable (UNROLL calls,
each on an x and a w of its own so that nothing is hoisted, shared or copied), the variants compiled first and
then timed in turns, medians of REPEATS rounds.

Table `layer`, at 16384x3584x8192 (x [M, K] and w [K, N] in bfloat16), the forward pass as a training step runs
it: y, and for the delayed-scaling variants the state the step records (x's and w's amax histories and scales,
which a forward alone would leave to XLA to drop):
  bf16              the bf16 dot (XLA: cuBLAS)
  flax              flax.linen.Fp8DirectDotGeneralOp: Flax's delayed scaling in XLA's fp8 form (x / scale in
                    bf16, the fp8 dot, the dequantization), and its update_fp8_meta of x and w
  delayed           Fp8DelayedAgDotGeneral(algorithm="auto"): x cast with the step's scale and its amax taken in
                    the same pass (ops/fp8_cast.py's kernel), w cast into its K-major layout with its amax in the
                    same pass (the kernel's transposing variant), the vendor's fp8 GEMM (the group of one) with
                    fast accumulation, as Flax's forward runs
  delayed_xla_cast  the same with cast_algorithm="xla": XLA's forms of the casts and amaxes: what the one-pass
                    kernels gain
  delayed_promoted  delayed with fast_accumulation=False (the GEMM promotes its sums to float32 as the K loop goes)
  current           Fp8AgDotGeneral (current scaling: x's amax, then its cast, a second pass; fast accumulation)
  *_vs_bf16: bf16's time over the variant's. Target: delayed >= 1.6x bf16 (issue 37).
Table `kernels`: where each layer variant's GPU time goes: one chained run of it under the profiler, its span per
call and its three longest kernels (GPU us per call, names cut short), the rest summed; `all_us` in the file has
every kernel's.
Table `cast`: the cast with its amax alone, the kernel against XLA's form (UNROLL distinct inputs in one
executable), on x [M, K] and on w [K, N] into its K-major [N, K] (lead 1): wall us per cast, GPU us per cast (one
run under the profiler) and the HBM rate of the bytes read and written.
--small: tiny sizes, to check the script itself (on CPU).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import fp8_ops
from jax import lax

import _harness
import bench_fp8_layers
import jax_overlap as jo
from jax_overlap.layers import fp8 as fp8_layers, fp8_delayed
from jax_overlap.ops import fp8_cast

UNROLL = bench_fp8_layers.UNROLL  # the chained calls of bench_fp8_layers.chained
REPEATS = 5
SHAPE = (16384, 3584, 8192)  # M, N, K
SMALL_SHAPE = (256, 128, 256)
DN = (((1,), (0,)), ((), ()))
VARIANTS = ("bf16", "flax", "delayed", "delayed_xla_cast", "delayed_promoted", "current")


def _state(x, w):
  """A state as after some steps: histories holding amaxes near x's and w's, so that the scales are not 1."""
  state = nn.Fp8DirectDotGeneralOp().init(jax.random.key(0), x[:8], w, DN)[fp8_ops.OVERWRITE_WITH_GRADIENT]
  state = dict(state)
  state["input_amax_history"] = state["input_amax_history"].at[:4].set(jnp.max(jnp.abs(x)).astype(jnp.float32))
  state["kernel_amax_history"] = state["kernel_amax_history"].at[:4].set(jnp.max(jnp.abs(w)).astype(jnp.float32))
  return state


def _delayed_forward(state, e4m3, e5m2, fast_accumulation: bool = True, cast_algorithm: str = "auto"):
  """y and the new input and kernel state: the custom VJP's forward rule, as a training step runs it."""
  layer = jo.Fp8DelayedAgDotGeneral(e4m3_dtype=jnp.dtype(e4m3), e5m2_dtype=jnp.dtype(e5m2),
                                    fast_accumulation=fast_accumulation, cast_algorithm=cast_algorithm)
  meta = (state["input_scale"], state["input_amax_history"], state["kernel_scale"], state["kernel_amax_history"],
          state["output_grad_scale"], state["output_grad_amax_history"])

  def forward(x, w):
    call = fp8_layers._Fp8Call(axis_name=None, algorithm=layer.algorithm, axis=-2, out_sharding=None, e4m3=e4m3,
                               e5m2=e5m2, x_dtype="bfloat16", w_dtype="bfloat16",
                               fast_accumulation=layer.fast_accumulation, cast_algorithm=layer.cast_algorithm)
    y, residuals = fp8_delayed._ag_forward(x, w, meta, call)
    return (y, *residuals[5])  # y; the new input and kernel scales and histories
  return forward


def _flax_forward(state):
  """Flax's op: y, and the new input and kernel state its forward computes (fp8_ops.in_q's update_fp8_meta)."""
  variables = {fp8_ops.OVERWRITE_WITH_GRADIENT: state}
  op = nn.Fp8DirectDotGeneralOp()

  def forward(x, w):
    y = op.apply(variables, x, w, DN)
    return (y, *fp8_ops.update_fp8_meta(x, jnp.float8_e4m3fn, state["input_scale"], state["input_amax_history"]),
            *fp8_ops.update_fp8_meta(w, jnp.float8_e4m3fn, state["kernel_scale"], state["kernel_amax_history"]))
  return forward


def variants(x, w) -> dict:
  e4m3, e5m2 = bench_fp8_layers.fp8_formats()
  state = _state(x, w)
  current = jo.Fp8AgDotGeneral()
  return {"bf16": lambda x, w: (lax.dot_general(x, w, (DN[0], ((), ()))),),
          "flax": _flax_forward(state),
          "delayed": _delayed_forward(state, e4m3, e5m2),
          "delayed_xla_cast": _delayed_forward(state, e4m3, e5m2, cast_algorithm="xla"),
          "delayed_promoted": _delayed_forward(state, e4m3, e5m2, fast_accumulation=False),
          "current": lambda x, w: (current(x, w, DN),)}


def layer_rows(m: int, n: int, k: int) -> list:
  x, w = _harness.random_bf16((m, k), 0), _harness.random_bf16((k, n), 1) * (k ** -0.5)
  row = dict(table="layer", mode="forward", m=m, n=n, k=k)
  timers, (xs, ws) = {}, bench_fp8_layers.inputs(x, w)
  for name, f in variants(x, w).items():
    _harness.note(f"layer {name}: compiling")
    try:
      fn = bench_fp8_layers.chained(f)
      text = fn.lower(xs, ws).as_text()
      row[f"{name}_cast_kernel"] = "jax_overlap_fp8_cast_amax(" in text
      row[f"{name}_w_cast_kernel"] = "jax_overlap_fp8_cast_amax_transposed(" in text
      timers[name] = bench_fp8_layers.timer(fn, xs, ws)
    except Exception as e:  # noqa: BLE001 (a variant that cannot run here is a result, not the end)
      row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
  row.update(_harness.in_turns(timers, REPEATS))
  for name in VARIANTS[1:]:
    if row.get(f"{name}_us") and row.get("bf16_us"):
      row[f"{name}_vs_bf16"] = row["bf16_us"] / row[f"{name}_us"]
  return [row]


def _short(name: str) -> str:
  name = name.split("(")[0].split("<")[0].replace("void ", "").replace("jo::(anonymous namespace)::", "")
  return name[:44]


def kernel_rows(m: int, n: int, k: int) -> list:
  x, w = _harness.random_bf16((m, k), 0), _harness.random_bf16((k, n), 1) * (k ** -0.5)
  rows, (xs, ws) = [], bench_fp8_layers.inputs(x, w)
  for name, f in variants(x, w).items():
    fn = bench_fp8_layers.chained(f)
    jax.block_until_ready(fn(xs, ws))  # compiled and warm
    events = _harness.gpu_events(_harness.profiled_trace(lambda: jax.block_until_ready(fn(xs, ws))))
    if not events:
      continue
    per_kernel = collections.Counter()
    for e in events:
      per_kernel[_short(e["name"])] += e["dur"] / UNROLL
    row = dict(table="kernels", variant=name,
               span_us=(max(e["ts"] + e["dur"] for e in events) - events[0]["ts"]) / UNROLL)
    top = per_kernel.most_common(3)
    for i, (kernel, us) in enumerate(top, 1):
      row[f"k{i}"], row[f"k{i}_us"] = kernel, us
    row["rest_us"] = sum(per_kernel.values()) - sum(us for _, us in top)
    row["all_us"] = {kernel: round(us, 2) for kernel, us in per_kernel.most_common()}
    rows.append(row)
  return rows


def cast_rows(m: int, n: int, k: int) -> list:
  e4m3, _ = bench_fp8_layers.fp8_formats()
  rows = []
  for (r, c), lead, target in (((m, k), 0, "jax_overlap_fp8_cast_amax("), ((k, n), 1,
                                                                        "jax_overlap_fp8_cast_amax_transposed(")):
    inputs = [_harness.random_bf16((r, c), 3 + i) for i in range(UNROLL)]
    scale = jnp.max(jnp.abs(inputs[0])).astype(jnp.float32) / float(jnp.finfo(e4m3).max)
    row = dict(table="cast", shape=f"{r}x{c}", lead=lead, format=e4m3)
    cast = lambda v, s, algorithm, lead=lead: fp8_cast.cast_with_amax(v, s, e4m3, lead=lead,  # noqa: E731
                                                                      algorithm=algorithm)
    rows.append(bench_fp8_layers.timed_casts(row, cast, inputs, scale, target))
  return rows


def write(rows: list, out_dir: str, command: str) -> str:
  meta = {"formats": bench_fp8_layers.fp8_formats(), "unroll": UNROLL, "repeats": REPEATS}
  return _harness.write_results("fp8_delayed", rows, out_dir, command, plotted=lambda r: False, meta=meta) + ".json"


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
  ap.add_argument("--small", action="store_true", help="tiny sizes: check the script (CPU)")
  args = ap.parse_args(argv)
  m, n, k = SMALL_SHAPE if args.small else SHAPE
  rows = layer_rows(m, n, k) + kernel_rows(m, n, k) + cast_rows(m, n, k)
  path = write(rows, args.out, "python " + " ".join(sys.argv))
  for row in rows:
    for key, value in row.items():
      if key.endswith("_error"):
        print(f"error: {key}: {value}")
  print(f"results: {path}")
  _harness.print_table([r for r in rows if r["table"] == "cast"],
                       ["shape", "lead", "format", "auto_kernel", "auto_us", "xla_us", "xla_vs_auto", "auto_gpu_us",
                        "xla_gpu_us", "auto_tb_s", "xla_tb_s"])
  _harness.print_table([r for r in rows if r["table"] == "kernels"],
                       ["variant", "span_us", "k1", "k1_us", "k2", "k2_us", "k3", "k3_us", "rest_us"])
  _harness.print_table([r for r in rows if r["table"] == "layer"],
                       ["m", "n", "k", *(f"{v}_us" for v in VARIANTS), "delayed_cast_kernel",
                        *(f"{v}_vs_bf16" for v in VARIANTS[1:])])


if __name__ == "__main__":
  main()
