"""MaxText's pre-training on one GPU, stock against `python -m jax_overlap.maxtext`, step times side by side.

  python benchmarks/bench_maxtext.py [--out DIR] [--configs tiny 1b] [--recipes bf16 fp8] [--steps N] [--profile]
                                    [--cast-kernels] [--cpu]

Each run is a process of its own (MaxText's entry point, synthetic data, no checkpoints), the stock run and the
jax_overlap run of a row one after the other on the same GPU; a row's step time is the median of MaxText's
perf/step_time_seconds over the steps after the first three (compilation and warm-up; the default 30 steps: with
12, rows of the same code moved by 5%). Writes
maxtext_<date>.json to --out (default: $OUT, else benchmarks/results) after every row and prints the table last.

Configs (decoder_block=llama2, weights float32, compute bfloat16, attention=dot_product, remat_policy=full):
  tiny  2 layers, emb 256, 4 heads of 64, mlp 512, vocab 1024, 128 tokens, batch 1 (the CI's model, at world 1)
  1b    llama2-1B-like dims with 4 layers: emb 2048, 32 heads of 64 (8 kv heads), mlp 8192, vocab 32000,
        2048 tokens, batch 4
Recipes: bf16 (quantization=""; on one GPU every dense layer keeps its dot: jax_overlap adds nothing, and the
times should agree) and fp8 (quantization=fp8: Flax's delayed scaling in XLA's fp8 form against jax_overlap's
delayed-scaling layers, whose GEMMs are the vendor's fp8 GEMM on one GPU, with XLA's casts, the integration's
default). Columns: stock_ms, jax_overlap_ms, speedup (stock over jax_overlap), each run's last loss, and the
census line's counts of the jax_overlap run.
--profile: each run also profiles PROFILE_STEPS steps after those it times (MaxText's profiler=xplane) and the row
records the GPU time per step of its kernels by kind (`{variant}_kernels`, ms per step: GEMMs, jax_overlap's
kernels, XLA's fusions, the rest) and its ten largest kernels; the kinds print as a second table.
--cast-kernels: a third run per fp8 row, jax_overlap's layers with the cast kernels in place of XLA's casts
(`jax_overlap_fp8_cast=kernels`; `cast_kernels_ms`), which XLA can fuse into the operations that produce the
layers' operands.
--cpu: 8 CPU devices and steps=3, the tiny config only: check the script itself.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import importlib.util
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

import _harness

QUIET = ["skip_jax_distributed_system=true", "enable_checkpointing=false", "async_checkpointing=false",
         "enable_tensorboard=false", "enable_goodput_recording=false", "monitor_goodput=false", "gcs_metrics=false",
         "save_config_to_gcs=false", "dump_hlo=false", "log_period=1", "jax_cache_dir=", "log_config=false",
         "dataset_type=synthetic", "enable_dropout=false", "model_name=default", "decoder_block=llama2",
         "weight_dtype=float32", "dtype=bfloat16", "attention=dot_product", "remat_policy=full"]
CONFIGS = {
    "tiny": ["base_num_decoder_layers=2", "base_emb_dim=256", "base_num_query_heads=4", "base_num_kv_heads=4",
             "head_dim=64", "base_mlp_dim=512", "vocab_size=1024", "max_target_length=128",
             "per_device_batch_size=1"],
    "1b": ["base_num_decoder_layers=4", "base_emb_dim=2048", "base_num_query_heads=32", "base_num_kv_heads=8",
           "head_dim=64", "base_mlp_dim=8192", "vocab_size=32000", "max_target_length=2048",
           "per_device_batch_size=4"],
}
RECIPES = {"bf16": [], "fp8": ["quantization=fp8"]}
PROFILE_STEPS = 3
CENSUS = re.compile(r"dense layers by op: ag_matmul (\d+), matmul_rs (\d+), local (\d+), dot (\d+)")
WARMUP = 3


def kernel_kind(name: str) -> str:
  """The kind of a GPU kernel, by its (demangled) name: jax_overlap's are in namespace jo ("void jo::...")."""
  low = name.lower()
  if "jo::" in low:
    return "jax_overlap"
  if any(key in low for key in ("nvjet", "gemm", "xmma", "cutlass", "cublas")):
    return "gemm"
  if any(low.startswith(key) for key in ("input_", "loop_", "fusion", "wrapped_", "triton", "copy", "transpose",
                                         "reduce", "concatenate", "dynamic")):
    return "xla"
  return "other"


def profile_summary(run_dir: pathlib.Path) -> dict | None:
  """GPU time per profiled step by kernel kind (ms) and the ten largest kernels (ms per step), from the trace MaxText
  wrote under run_dir; None where it wrote none."""
  events = []
  for path in sorted(run_dir.rglob("*.trace.json.gz")):
    events = _harness.gpu_events(_harness.trace_events(str(path.parent)))
  if not events:
    return None
  kinds, names = collections.Counter(), collections.Counter()
  for e in events:
    kinds[kernel_kind(e["name"])] += e["dur"]
    names[e["name"][:80]] += e["dur"]
  per_step = lambda us: round(us / PROFILE_STEPS / 1e3, 3)  # noqa: E731
  span = max(e["ts"] + e["dur"] for e in events) - events[0]["ts"]
  return {"span_ms": per_step(span), "busy_ms": per_step(sum(kinds.values())),
          **{kind: per_step(us) for kind, us in sorted(kinds.items())},
          "top": [[name, per_step(us)] for name, us in names.most_common(10)]}


def run(name: str, variant: str, args: list, steps: int, out: pathlib.Path, cpu: bool, profile: bool = False) -> dict:
  """One MaxText run of `steps` steps (variant: stock, jax_overlap or cast_kernels): its median step time (ms), last
  loss and census, its profile summary where asked for, or its error."""
  base = pathlib.Path(importlib.util.find_spec("maxtext").origin).parent / "configs" / "base.yml"
  metrics = out / f"{name}.metrics.jsonl"
  module = "maxtext.trainers.pre_train.train" if variant == "stock" else "jax_overlap.maxtext"
  env = {**os.environ, "DECOUPLE_GCLOUD": "TRUE"}
  if cpu:
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
  first_profiled = max(steps - PROFILE_STEPS - 1, WARMUP + 1) if profile else steps
  args = [*args, f"steps={steps}"]
  if profile:  # the last steps but one: the step times are the earlier ones'
    args = [*args, "profiler=xplane", f"skip_first_n_steps_for_profiler={first_profiled}",
            f"profiler_steps={PROFILE_STEPS}"]
  if variant == "cast_kernels":
    args = [*args, "jax_overlap_fp8_cast=kernels"]
  command = [sys.executable, "-m", module, str(base), f"run_name={name}", f"base_output_directory={out}",
             f"metrics_file={metrics}", f"hardware={'cpu' if cpu else 'gpu'}", *QUIET, *args]
  _harness.note(f"maxtext {name}")
  done = subprocess.run(command, cwd=out, env=env, capture_output=True, text=True, timeout=600)
  log = done.stdout + done.stderr
  (out / f"{name}.log").write_text(log)
  if done.returncode != 0 or not metrics.exists():
    tail = [line for line in log.splitlines() if line.strip()][-3:]
    return {"error": f"rc {done.returncode}: {' | '.join(tail)[:300]}"}
  steps = [json.loads(line) for line in metrics.read_text().splitlines()]
  times = [s["perf/step_time_seconds"] for s in steps[WARMUP:first_profiled]] or \
      [s["perf/step_time_seconds"] for s in steps]
  found = CENSUS.findall(log)
  result = {"ms": statistics.median(times) * 1e3, "loss": steps[-1]["learning/loss"],
            "census": "/".join(found[0]) if found else None}
  if profile:
    result["kernels"] = profile_summary(out / name)
  return result


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
  ap.add_argument("--configs", nargs="*", choices=tuple(CONFIGS), default=tuple(CONFIGS))
  ap.add_argument("--recipes", nargs="*", choices=tuple(RECIPES), default=tuple(RECIPES))
  ap.add_argument("--steps", type=int, default=30)
  ap.add_argument("--profile", action="store_true", help="GPU time per step by kernel kind, from a profile")
  ap.add_argument("--cast-kernels", action="store_true",
                  help="fp8 rows: also jax_overlap's layers with the cast kernels")
  ap.add_argument("--cpu", action="store_true", help="8 CPU devices, 3 steps, the tiny config: check the script")
  args = ap.parse_args(argv)
  configs, steps = (("tiny",), 3) if args.cpu else (args.configs, args.steps)
  if args.profile:  # timed steps after the warm-up, then the profiled ones and a last one
    steps = max(steps, WARMUP + 1 + PROFILE_STEPS + 1)
  os.makedirs(args.out, exist_ok=True)
  stamp = datetime.date.today().isoformat()
  path = os.path.join(args.out, f"maxtext_{stamp}.json")
  meta = {"date": stamp, "commit": _harness.git_commit(), "command": "python " + " ".join(sys.argv),
          "steps": steps, "warmup": WARMUP}
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    out = pathlib.Path(tmp)
    for config in configs:
      for recipe in args.recipes:
        if config == "tiny" and recipe == "fp8":
          continue  # the tiny model's GEMMs are too small for the fp8 recipe to say anything
        row = {"config": config, "recipe": recipe}
        variants = ("stock", "jax_overlap", *(("cast_kernels",) if args.cast_kernels and recipe == "fp8" else ()))
        for variant in variants:
          result = run(f"{config}_{recipe}_{variant}", variant, [*CONFIGS[config], *RECIPES[recipe]], steps, out,
                       args.cpu, args.profile)
          row.update({f"{variant}_{key}": value for key, value in result.items()})
        for variant in variants[1:]:
          if row.get("stock_ms") and row.get(f"{variant}_ms"):
            row["speedup" if variant == "jax_overlap" else f"{variant}_speedup"] = \
                row["stock_ms"] / row[f"{variant}_ms"]
        rows.append(row)
        with open(path, "w") as f:
          json.dump({"meta": meta, "rows": rows}, f, indent=1)
  for row in rows:
    for key, value in row.items():
      if key.endswith("_error"):
        print(f"error: {row['config']} {row['recipe']} {key}: {value}")
  print(f"results: {path}")
  _harness.print_table(rows, ["config", "recipe", "stock_ms", "jax_overlap_ms", "speedup", "cast_kernels_ms",
                              "cast_kernels_speedup", "stock_loss", "jax_overlap_loss", "jax_overlap_census"])
  if args.profile:
    kinds = [{"config": row["config"], "recipe": row["recipe"], "variant": variant, **{
        key: value for key, value in (row.get(f"{variant}_kernels") or {}).items() if key != "top"}}
        for row in rows for variant in ("stock", "jax_overlap", "cast_kernels") if f"{variant}_ms" in row]
    _harness.print_table(kinds, ["config", "recipe", "variant", "span_ms", "busy_ms", "gemm", "jax_overlap", "xla",
                                 "other"])


if __name__ == "__main__":
  main()
