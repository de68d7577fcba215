"""The delayed-scaling fp8 layer on one GPU, forward from bf16 inputs, against XLA's bf16 dot in the same run.

  python benchmarks/bench_fp8_delayed.py [--out DIR] [--small]

Writes fp8_delayed_<date>.json to --out (default: $OUT, else benchmarks/results) and prints the tables last. All
columns are measured in the same run; us per call, each variant's calls chained in one executable (UNROLL calls,
each a layer of its own: an x, a w and an fp8 state of its own, the state passed in as a training step passes its
variables, so that nothing is hoisted, shared or copied), the variants compiled first and then timed in turns,
medians of REPEATS rounds. Two wall times per variant:
  us         back to back: EXECUTIONS executables dispatched before one wait, as a training loop dispatches its
             steps: the host's dispatch of one overlaps the GPU's work of the one before, and the GPU runs at the
             clocks it holds under sustained work (its power limit lowers them under long GEMMs)
  synced_us  each executable waited for alone: the GPU idles between executables while the host waits and
             dispatches (0.4-0.9 ms per executable on the H200, the same whatever its kernels)
and one GPU time, gpu_us (table `kernels`'s span per call: one profiled executable after an idle moment, at the
clocks of a short burst).

Table `layer`, at 16384x3584x8192 (x [M, K] and w [K, N] in bfloat16), the forward pass as a training step runs
it: y, and for the delayed-scaling variants the state the step records (x's and w's amax histories and scales,
which a forward alone would leave to XLA to drop):
  bf16              the bf16 dot (XLA: cuBLAS)
  flax              flax.linen.Fp8DirectDotGeneralOp: Flax's delayed scaling in XLA's fp8 form (x / scale in
                    bf16, the fp8 dot, the dequantization), and its update_fp8_meta of x and w
  delayed           Fp8DelayedAgDotGeneral(algorithm="auto"): x's and w's step scales from one kernel
                    (ops/fp8_scales.py's, which also zeroes their amaxes), x cast with its scale and its amax taken
                    in the same pass (ops/fp8_cast.py's kernel), w cast into its K-major layout with its amax in
                    the same pass (the kernel's transposing variant), the vendor's fp8 GEMM (the group of one) with
                    fast accumulation, as Flax's forward runs; the histories' update, one XLA fusion
  delayed_xla_cast  the same with cast_algorithm="xla": XLA's forms of the step scales, the casts and amaxes: what
                    the kernels gain
  delayed_promoted  delayed with fast_accumulation=False (the GEMM promotes its sums to float32 as the K loop goes)
  current           Fp8AgDotGeneral (current scaling: x's amax, then its cast, a second pass; fast accumulation)
  *_vs_bf16, *_synced_vs_bf16, *_gpu_vs_bf16: bf16's time over the variant's, by each measure. Target: delayed
  >= 1.6x bf16 (issue 37).
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
from jax_overlap.layers import fp8 as fp8_layers
from jax_overlap.quantization import recipes
from jax_overlap.ops import fp8_cast

UNROLL = bench_fp8_layers.UNROLL  # calls per executable (bench_fp8_layers.inputs gives as many x and w)
REPEATS = 5
EXECUTIONS = 4  # executables per back-to-back timing
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


def _delayed_forward(e4m3, e5m2, fast_accumulation: bool = True, cast_algorithm: str = "auto"):
  """y and the new input and kernel state: the custom VJP's forward rule, as a training step runs it."""
  layer = jo.Fp8DelayedAgDotGeneral(e4m3_dtype=jnp.dtype(e4m3), e5m2_dtype=jnp.dtype(e5m2),
                                    fast_accumulation=fast_accumulation, cast_algorithm=cast_algorithm)

  def forward(x, w, state):
    meta = (state["input_scale"], state["input_amax_history"], state["kernel_scale"], state["kernel_amax_history"],
            state["output_grad_scale"], state["output_grad_amax_history"])
    call = fp8_layers.Fp8Call(layer="Fp8DelayedAgDotGeneral", recipe=recipes.DelayedRecipe(), axis_name=None,
                              algorithm=layer.algorithm, axis=-2, out_sharding=None, e4m3=e4m3, e5m2=e5m2,
                              x_dtype="bfloat16", w_dtype="bfloat16", fast_accumulation=layer.fast_accumulation,
                              cast_algorithm=layer.cast_algorithm)
    y, residuals = fp8_layers._ag_forward(x, w, meta, call)
    return (y, *residuals[4][1])  # y; the new input and kernel scales and histories
  return forward


def _flax_forward():
  """Flax's op: y, and the new input and kernel state its forward computes (fp8_ops.in_q's update_fp8_meta)."""
  op = nn.Fp8DirectDotGeneralOp()

  def forward(x, w, state):
    y = op.apply({fp8_ops.OVERWRITE_WITH_GRADIENT: state}, x, w, DN)
    return (y, *fp8_ops.update_fp8_meta(x, jnp.float8_e4m3fn, state["input_scale"], state["input_amax_history"]),
            *fp8_ops.update_fp8_meta(w, jnp.float8_e4m3fn, state["kernel_scale"], state["kernel_amax_history"]))
  return forward


def variants() -> dict:
  """Each variant as f(x, w, state): state is the call's fp8 state (_state), which bf16 and current scaling
  ignore."""
  e4m3, e5m2 = bench_fp8_layers.fp8_formats()
  current = jo.Fp8AgDotGeneral()
  return {"bf16": lambda x, w, state: (lax.dot_general(x, w, (DN[0], ((), ()))),),
          "flax": _flax_forward(),
          "delayed": _delayed_forward(e4m3, e5m2),
          "delayed_xla_cast": _delayed_forward(e4m3, e5m2, cast_algorithm="xla"),
          "delayed_promoted": _delayed_forward(e4m3, e5m2, fast_accumulation=False),
          "current": lambda x, w, state: (current(x, w, DN),)}


def inputs(m: int, n: int, k: int) -> tuple:
  """UNROLL distinct (x, w, state) triples, one per chained call: each call is a layer of its own, its state passed
  in as a training step passes its variables (state held as constants would cost XLA a copy before each update)."""
  x, w = _harness.random_bf16((m, k), 0), _harness.random_bf16((k, n), 1) * (k ** -0.5)
  xs, ws = bench_fp8_layers.inputs(x, w)
  return xs, ws, [_state(xi, wi) for xi, wi in zip(xs, ws)]


def chained(f):
  """UNROLL calls of f in one executable, each on its own x, w and state, every result returned (nothing to hoist,
  share or update in place)."""
  return jax.jit(lambda xs, ws, states: [f(*a) for a in zip(xs, ws, states)])


def layer_rows(m: int, n: int, k: int) -> list:
  row = dict(table="layer", mode="forward", m=m, n=n, k=k)
  timers, args = {}, inputs(m, n, k)
  for name, f in variants().items():
    _harness.note(f"layer {name}: compiling")
    try:
      fn = chained(f)
      text = fn.lower(*args).as_text()
      row[f"{name}_step_kernel"] = "jax_overlap_fp8_step_scales(" in text
      row[f"{name}_cast_kernel"] = "jax_overlap_fp8_cast_amax_from(" in text
      row[f"{name}_w_cast_kernel"] = "jax_overlap_fp8_cast_amax_from_transposed(" in text
      timers[f"{name}_synced"] = _harness.synced_timer(fn, *args, calls=UNROLL)
      timers[name] = _harness.back_to_back_timer(fn, *args, calls=UNROLL, executions=EXECUTIONS)
    except Exception as e:  # noqa: BLE001 (a variant that cannot run here is a result, not the end)
      row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
  row.update(_harness.in_turns(timers, REPEATS))
  return [row]


def ratios(layer: dict, kernels: list) -> None:
  """The layer row's gpu_us (the kernel rows' spans) and every variant's ratios to bf16, by each measure."""
  for r in kernels:
    layer[f"{r['variant']}_gpu_us"] = r["span_us"]
  for measure in ("", "_synced", "_gpu"):
    base = layer.get(f"bf16{measure}_us")
    for name in VARIANTS[1:]:
      if base and layer.get(f"{name}{measure}_us"):
        layer[f"{name}{measure}_vs_bf16"] = base / layer[f"{name}{measure}_us"]


def _short(name: str) -> str:
  name = name.replace("void ", "").replace("jo::(anonymous namespace)::", "")
  return name.split("(")[0].split("<")[0][:44]


def kernel_rows(m: int, n: int, k: int) -> list:
  rows, args = [], inputs(m, n, k)
  for name, f in variants().items():
    fn = chained(f)
    jax.block_until_ready(fn(*args))  # compiled and warm
    events = _harness.gpu_events(_harness.profiled_trace(lambda: jax.block_until_ready(fn(*args))))
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
  meta = {"formats": bench_fp8_layers.fp8_formats(), "unroll": UNROLL, "repeats": REPEATS, "executions": EXECUTIONS}
  return _harness.write_results("fp8_delayed", rows, out_dir, command, plotted=lambda r: False, meta=meta) + ".json"


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
  ap.add_argument("--small", action="store_true", help="tiny sizes: check the script (CPU)")
  args = ap.parse_args(argv)
  m, n, k = SMALL_SHAPE if args.small else SHAPE
  layer, kernels = layer_rows(m, n, k), kernel_rows(m, n, k)
  ratios(layer[0], kernels)
  rows = layer + kernels + cast_rows(m, n, k)
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
  layer = [r for r in rows if r["table"] == "layer"]
  for measure in ("", "_synced", "_gpu"):
    _harness.print_table(layer, [*(f"{v}{measure}_us" for v in VARIANTS), *(f"{v}{measure}_vs_bf16"
                                                                           for v in VARIANTS[1:])])
  _harness.print_table(layer, ["m", "n", "k", "delayed_step_kernel", "delayed_cast_kernel", "delayed_w_cast_kernel"])


if __name__ == "__main__":
  main()
