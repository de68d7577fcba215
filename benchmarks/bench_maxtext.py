"""MaxText's pre-training on one GPU, stock against `python -m jax_overlap.maxtext`, step times side by side.

  python benchmarks/bench_maxtext.py [--out DIR] [--configs tiny 1b] [--recipes bf16 fp8] [--steps N] [--cpu]

Each run is a process of its own (MaxText's entry point, synthetic data, no checkpoints), the stock run and the
jax_overlap run of a row one after the other on the same GPU; a row's step time is the median of MaxText's
perf/step_time_seconds over the steps after the first three (compilation and warm-up). Writes
maxtext_<date>.json to --out (default: $OUT, else benchmarks/results) after every row and prints the table last.

Configs (decoder_block=llama2, weights float32, compute bfloat16, attention=dot_product, remat_policy=full):
  tiny  2 layers, emb 256, 4 heads of 64, mlp 512, vocab 1024, 128 tokens, batch 1 (the CI's model, at world 1)
  1b    llama2-1B-like dims with 4 layers: emb 2048, 32 heads of 64 (8 kv heads), mlp 8192, vocab 32000,
        2048 tokens, batch 4
Recipes: bf16 (quantization=""; on one GPU every dense layer keeps its dot: jax_overlap adds nothing, and the
times should agree) and fp8 (quantization=fp8: Flax's delayed scaling in XLA's fp8 form against jax_overlap's
delayed-scaling layers, whose GEMMs are the vendor's fp8 GEMM on one GPU). Columns: stock_ms, jax_overlap_ms,
speedup (stock over jax_overlap), each run's last loss, and the census line's counts of the jax_overlap run.
--cpu: 8 CPU devices and steps=3, the tiny config only: check the script itself.
"""

from __future__ import annotations

import argparse
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
CENSUS = re.compile(r"dense layers by op: ag_matmul (\d+), matmul_rs (\d+), local (\d+), dot (\d+)")
WARMUP = 3


def run(name: str, overlap: bool, args: list, out: pathlib.Path, cpu: bool) -> dict:
  """One MaxText run: its median step time (ms), last loss and census, or its error."""
  base = pathlib.Path(importlib.util.find_spec("maxtext").origin).parent / "configs" / "base.yml"
  metrics = out / f"{name}.metrics.jsonl"
  module = "jax_overlap.maxtext" if overlap else "maxtext.trainers.pre_train.train"
  env = {**os.environ, "DECOUPLE_GCLOUD": "TRUE"}
  if cpu:
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
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
  times = [s["perf/step_time_seconds"] for s in steps[WARMUP:]] or [s["perf/step_time_seconds"] for s in steps]
  found = CENSUS.findall(log)
  return {"ms": statistics.median(times) * 1e3, "loss": steps[-1]["learning/loss"],
          "census": "/".join(found[0]) if found else None}


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
  ap.add_argument("--configs", nargs="*", choices=tuple(CONFIGS), default=tuple(CONFIGS))
  ap.add_argument("--recipes", nargs="*", choices=tuple(RECIPES), default=tuple(RECIPES))
  ap.add_argument("--steps", type=int, default=12)
  ap.add_argument("--cpu", action="store_true", help="8 CPU devices, 3 steps, the tiny config: check the script")
  args = ap.parse_args(argv)
  configs, steps = (("tiny",), 3) if args.cpu else (args.configs, args.steps)
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
        for variant, overlap in (("stock", False), ("jax_overlap", True)):
          result = run(f"{config}_{recipe}_{variant}", overlap, [*CONFIGS[config], *RECIPES[recipe],
                                                                 f"steps={steps}"], out, args.cpu)
          row.update({f"{variant}_{key}": value for key, value in result.items()})
        if row.get("stock_ms") and row.get("jax_overlap_ms"):
          row["speedup"] = row["stock_ms"] / row["jax_overlap_ms"]
        rows.append(row)
        with open(path, "w") as f:
          json.dump({"meta": meta, "rows": rows}, f, indent=1)
  for row in rows:
    for key, value in row.items():
      if key.endswith("_error"):
        print(f"error: {row['config']} {row['recipe']} {key}: {value}")
  print(f"results: {path}")
  _harness.print_table(rows, ["config", "recipe", "stock_ms", "jax_overlap_ms", "speedup", "stock_loss",
                              "jax_overlap_loss", "jax_overlap_census"])


if __name__ == "__main__":
  main()
