"""The fp8 layers on one GPU from bf16 inputs, quantization included, and the transformer block in fp8.

  python benchmarks/bench_fp8_layers.py [--out DIR] [--small] [--tables layer cast block] [--ops ag rs]
                                        [--modes forward train] [--variants NAME ...]

On the H200 (jax 0.11.2) a `train` row of bf16, xla_fp8 and auto takes about 2.5 minutes (xla_fp8 compiles
for about 70 s), the `forward` rows and the block seconds each. Writes
fp8_layers_<date>.json to --out (default: $OUT, else benchmarks/results) after every row and prints the tables
last. All columns are measured in the same run; us per call, each variant's calls chained in one executable
(UNROLL calls, each on an x and a w of its own so that nothing is hoisted, shared or copied), a row's variants
compiled first and then timed in turns, medians of REPEATS rounds.

Table `layer`, at 16384x3584x8192 (x [M, K] and w [K, N] in bfloat16), `forward` (y = x @ w) and `train`
(y, and dx, dW from a bfloat16 cotangent):
  bf16              the bf16 dot (XLA: cuBLAS), jax.vjp of it in `train`
  xla_fp8           XLA's best fp8 form of the same computation: current scaling of x and w (the amax, a
                    power-of-two scale, a cast to e4m3), each converted to float32 times its scale into one dot
                    (XLA's fp8 GEMM form, numerics.to_fp8 keeping the rounding); in `train` a custom
                    VJP quantizes dy to e5m2 and runs dgrad and wgrad in the same form
  auto, pipelined,  Fp8AgDotGeneral (op ag) and Fp8RsDotGeneral (op rs) with that algorithm: the same
  xla               quantization, w cast straight into its K-major layout, then the op
  auto_block        auto with scaling="block" (1x128 blocks of x and the cotangent, 128x128 tiles of w)
  auto_xla_cast     auto with cast_algorithm="xla": XLA's float8 casts in place of the project's cast kernel
                    (jax_overlap/ops/fp8_cast.py): what the kernel gains
  *_vs_xla_fp8, *_vs_bf16: the time of xla_fp8 (bf16) over the layer's. Targets: the layers >= 1.1x xla_fp8 and
  >= 1.5x bf16 (issue 27). A variant that cannot run records its error instead of a time.
Table `cast`: the float8 cast alone (current scaling's second pass, x / scale to e4m3; the cotangent's to e5m2),
the project's kernel against XLA's form of it, on x [M, K] and a cotangent [M, N] in bfloat16 (UNROLL distinct
inputs cast in one executable): wall us per cast, the GPU time of the kernels per cast (one run under the profiler)
and their HBM rate, counting the bytes read and written.
Table `block`: examples/transformer_block.py's DecoderBlock on one GPU (batch 2, seq 4096, embed 4096, 32 heads,
ffn 14336, bfloat16), one training step (loss, gradients, update): the fp8 layers (auto) against the bf16 block
on algorithm="xla", ms per step, medians of STEPS steps after the first. Target: fp8 faster.
--small: tiny sizes, to check the script itself (on CPU).
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

import _harness
import jax_overlap as jo
from jax_overlap.quantization import formats
from jax_overlap.ops import fp8_cast
from jax_overlap.quantization import numerics
from jax_overlap.runtime import workspace

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import transformer_block as example  # noqa: E402

UNROLL = 10
REPEATS = 5
STEPS = 10
SHAPE = (16384, 3584, 8192)  # M, N, K
SMALL_SHAPE = (256, 128, 256)
BLOCK = dict(batch=2, seq=4096, embed=4096, heads=32, ffn=14336)
SMALL_BLOCK = dict(batch=2, seq=64, embed=64, heads=4, ffn=128)
LAYER_ALGORITHMS = ("auto", "pipelined", "xla")
DN = (((1,), (0,)), ((), ()))


def fp8_formats() -> tuple:
  """(e4m3, e5m2) of this GPU's float8 family: fnuz on gfx942, OCP elsewhere (the layers' default)."""
  fnuz = any(formats.fp8_family_of(arch) == "fnuz" for _, arch in workspace.local_gpus())
  return formats.fp8_formats("fnuz" if fnuz else "ocp")


# --- the baselines ------------------------------------------------------------------------

def _scaled_dot(a, sa, b, sb, dims):
  """XLA's fp8 GEMM form: both float8 operands converted to float32 times their scales, one dot, bf16 out."""
  return lax.dot_general(numerics.dequantized(a, sa), numerics.dequantized(b, sb), (dims, ((), ())),
                         preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def xla_fp8_layer(e4m3: str, e5m2: str):
  """x @ w in XLA's best fp8 form from bf16 x [M, K] and w [K, N], with a custom VJP in the same form."""
  @jax.custom_vjp
  def layer(x, w):
    return forward(x, w)[0]

  def forward(x, w):
    (x8, sx), (w8, sw) = numerics.current_scaling(x, e4m3), numerics.current_scaling(w, e4m3)
    return _scaled_dot(x8, sx, w8, sw, ((1,), (0,))), (x8, sx, w8, sw)

  def backward(residuals, dy):
    x8, sx, w8, sw = residuals
    dy8, sd = numerics.current_scaling(dy, e5m2)
    return _scaled_dot(dy8, sd, w8, sw, ((1,), (1,))), _scaled_dot(x8, sx, dy8, sd, ((0,), (0,)))

  layer.defvjp(forward, backward)
  return layer


def variants(op: str) -> dict:
  e4m3, e5m2 = fp8_formats()
  out = {"bf16": lambda x, w: lax.dot_general(x, w, (DN[0], ((), ()))), "xla_fp8": xla_fp8_layer(e4m3, e5m2)}
  cls = jo.Fp8AgDotGeneral if op == "ag" else jo.Fp8RsDotGeneral
  for algorithm in LAYER_ALGORITHMS:
    out[algorithm] = functools.partial(lambda dot, x, w: dot(x, w, DN), cls(algorithm=algorithm))
  out["auto_xla_cast"] = functools.partial(lambda dot, x, w: dot(x, w, DN), cls(cast_algorithm="xla"))
  out["auto_block"] = functools.partial(lambda dot, x, w: dot(x, w, DN), cls(scaling="block"))
  return out


# --- timing ---------------------------------------------------------------------------------

def inputs(x, w) -> tuple:
  """UNROLL distinct (x, w) pairs, x's and w's values scaled a little apart: one per chained call."""
  factors = [1 + i / 64 for i in range(UNROLL)]
  return [x * jnp.asarray(f, x.dtype) for f in factors], [w * jnp.asarray(f, w.dtype) for f in factors]


def chained(f, mode: str = "forward", ct=None):
  """UNROLL calls of f (forward) or of its VJP with cotangent ct (train) in one executable, each on its own x and w
  (inputs()), every result returned: nothing to hoist, share or update in place (an in-place touch of the inputs
  cost a copy of w and an update per call)."""
  def one(x, w):
    if mode == "forward":
      return (f(x, w),)
    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(ct))

  def run(xs, ws):
    return [one(x, w) for x, w in zip(xs, ws)]
  return jax.jit(run)


def timer(fn, xs, ws):
  """A timer of one run of fn (UNROLL chained calls): wall time per call, us. Compiles and warms up first."""
  jax.block_until_ready(fn(xs, ws))

  def timed() -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(xs, ws))
    return (time.perf_counter() - t0) / UNROLL * 1e6
  return timed


def layer_rows(m: int, n: int, k: int, ops, modes, names, out) -> list:
  """The layer table, its variants of a row compiled first and then timed in turns (REPEATS rounds, medians); `out`
  is called with the rows so far after every row."""
  x, w = _harness.random_bf16((m, k), 0), _harness.random_bf16((k, n), 1) * (k ** -0.5)
  ct = _harness.random_bf16((m, n), 2)
  xs, ws = inputs(x, w)
  rows = []
  for mode in modes:
    for op in ops:
      row = dict(table="layer", op=op, mode=mode, m=m, n=n, k=k)
      timers = {}
      for name, f in variants(op).items():
        if name not in names:
          continue
        _harness.note(f"layer {op} {mode} {name}: compiling")
        try:
          timers[name] = timer(chained(f, mode, ct), xs, ws)
        except Exception as e:  # noqa: BLE001 (a variant that cannot run here is a result, not the end)
          row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
      row.update(_harness.in_turns(timers, REPEATS))
      for algorithm in (*LAYER_ALGORITHMS, "auto_xla_cast", "auto_block"):
        for base in ("xla_fp8", "bf16"):
          if row.get(f"{algorithm}_us") and row.get(f"{base}_us"):
            row[f"{algorithm}_vs_{base}"] = row[f"{base}_us"] / row[f"{algorithm}_us"]
      rows.append(row)
      out(rows)
  return rows


def cast_rows(m: int, n: int, k: int) -> list:
  """The cast table: for x [m, k] (e4m3) and a cotangent [m, n] (e5m2), UNROLL casts of as many distinct inputs in
  one executable (nothing else in it), the kernel's and XLA's compiled first, timed in turns."""
  e4m3, e5m2 = fp8_formats()
  rows = []
  for what, shape, fmt in (("x", (m, k), e4m3), ("cotangent", (m, n), e5m2)):
    inputs = [_harness.random_bf16(shape, 3 + i) for i in range(UNROLL)]
    scale = numerics.fp8_scale(jnp.max(jnp.abs(inputs[0])), fmt)
    row = dict(table="cast", operand=what, shape="x".join(map(str, shape)), format=formats.name(fmt))
    rows.append(timed_casts(row, lambda v, s, algorithm, fmt=fmt: fp8_cast.cast(v, s, fmt, algorithm=algorithm),
                            inputs, scale, "jax_overlap_fp8_cast"))
  return rows


def timed_casts(row: dict, cast, inputs: list, scale, target: str) -> dict:
  """`row` with the times of cast(v, scale, algorithm) over every input in one executable, the kernel's (auto) and
  XLA's form compiled first and timed in turns: us per cast, the GPU's us (profiler) and TB/s, whether auto
  lowered to the custom call `target`."""
  timers = {}
  for algorithm in ("auto", "xla"):
    fn = jax.jit(lambda s, *a, algorithm=algorithm: [cast(v, s, algorithm) for v in a])
    row[f"{algorithm}_kernel"] = target in fn.lower(scale, *inputs).as_text()
    jax.block_until_ready(fn(scale, *inputs))

    def timed(fn=fn) -> float:
      t0 = time.perf_counter()
      jax.block_until_ready(fn(scale, *inputs))
      return (time.perf_counter() - t0) / len(inputs) * 1e6
    timers[algorithm] = timed
  row.update(_harness.in_turns(timers, REPEATS))
  moved = inputs[0].size * (inputs[0].dtype.itemsize + 1)
  for algorithm in ("auto", "xla"):
    gpu = row[f"{algorithm}_gpu_us"] = _gpu_us(timers[algorithm])
    row[f"{algorithm}_tb_s"] = moved / gpu / 1e6 if gpu else None
  row["xla_vs_auto"] = row["xla_us"] / row["auto_us"]
  return row


def _gpu_us(timed) -> float | None:
  """The GPU time of one run of `timed` per cast (its kernels' durations under the profiler, over UNROLL); None
  where the profiler saw no GPU kernel (CPU)."""
  events = _harness.gpu_events(_harness.profiled_trace(timed))
  return sum(e["dur"] for e in events) / UNROLL if events else None


def block_rows(sizes: dict) -> list:
  """One train step of the DecoderBlock with the fp8 layers (auto) and the bf16 block on XLA, on one device."""
  x = jax.random.normal(jax.random.key(0), (sizes["batch"], sizes["seq"], sizes["embed"]), jnp.bfloat16)
  target = jax.random.normal(jax.random.key(1), x.shape, jnp.bfloat16)
  row = dict(table="block", **sizes)
  for name, algorithm, fp8 in (("fp8_auto", "auto", True), ("bf16_xla", "xla", False)):
    _harness.note(f"block {name}")
    model = example.DecoderBlock(sizes["embed"], sizes["heads"], sizes["ffn"], algorithm=algorithm,
                                 dtype=jnp.bfloat16, rngs=example.nnx.Rngs(1), fp8=fp8)
    graphdef, params = example.nnx.split(model, example.nnx.Param)
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    step = jax.jit(example.make_train_step(graphdef), donate_argnums=(0,))
    try:
      times = []
      for _ in range(STEPS + 1):
        t0 = time.perf_counter()
        loss, _, params = step(params, x, target)
        loss = float(loss)
        times.append(time.perf_counter() - t0)
      row[f"{name}_ms"] = statistics.median(times[1:]) * 1e3
      row[f"{name}_loss"] = loss
    except Exception as e:  # noqa: BLE001
      row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
  if row.get("fp8_auto_ms") and row.get("bf16_xla_ms"):
    row["fp8_vs_bf16"] = row["bf16_xla_ms"] / row["fp8_auto_ms"]
  return [row]


def write(rows: list, out_dir: str, command: str) -> str:
  meta = {"formats": fp8_formats(), "unroll": UNROLL, "repeats": REPEATS, "steps": STEPS}
  return _harness.write_results("fp8_layers", rows, out_dir, command, plotted=lambda r: False, meta=meta) + ".json"


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
  ap.add_argument("--small", action="store_true", help="tiny sizes: check the script (CPU)")
  ap.add_argument("--tables", nargs="*", choices=("layer", "cast", "block"), default=("layer", "cast", "block"))
  ap.add_argument("--ops", nargs="*", choices=("ag", "rs"), default=("ag", "rs"))
  ap.add_argument("--modes", nargs="*", choices=("forward", "train"), default=("forward", "train"))
  variant_names = ("bf16", "xla_fp8", *LAYER_ALGORITHMS, "auto_xla_cast", "auto_block")
  ap.add_argument("--variants", nargs="*", choices=variant_names, default=variant_names,
                  help="the layer table's columns")
  args = ap.parse_args(argv)
  command = "python " + " ".join(sys.argv)
  rows = []
  if "layer" in args.tables:  # written after every row: a run cut short by a time limit keeps what it measured
    rows += layer_rows(*(SMALL_SHAPE if args.small else SHAPE), args.ops, args.modes, args.variants,
                       lambda done: write(done, args.out, command))
  if "cast" in args.tables:
    rows += cast_rows(*(SMALL_SHAPE if args.small else SHAPE))
  if "block" in args.tables:
    rows += block_rows(SMALL_BLOCK if args.small else BLOCK)
  path = write(rows, args.out, command)
  errors = [(r.get("op", "block"), r.get("mode", ""), key, v) for r in rows for key, v in r.items()
            if key.endswith("_error")]
  for where in errors:
    print("error: " + " ".join(where))
  print(f"results: {path}")
  _harness.print_table([r for r in rows if r["table"] == "block"],
                       ["batch", "seq", "embed", "heads", "ffn", "fp8_auto_ms", "bf16_xla_ms", "fp8_vs_bf16"])
  _harness.print_table([r for r in rows if r["table"] == "cast"],
                       ["operand", "shape", "format", "auto_kernel", "auto_us", "xla_us", "xla_vs_auto", "auto_gpu_us",
                        "xla_gpu_us", "auto_tb_s", "xla_tb_s"])
  _harness.print_table([r for r in rows if r["table"] == "layer"],
                       ["op", "mode", "bf16_us", "xla_fp8_us", *(f"{a}_us" for a in LAYER_ALGORITHMS),
                        "auto_xla_cast_us", "auto_block_us",
                        *(f"{a}_vs_{b}" for a in ("auto", "pipelined") for b in ("xla_fp8", "bf16")),
                        "auto_xla_cast_vs_bf16", "auto_block_vs_bf16"])


if __name__ == "__main__":
  main()
