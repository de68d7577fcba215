"""MaxText end to end on 8 CPU devices: `python -m jax_overlap.maxtext` against stock MaxText
(`python -m maxtext.trainers.pre_train.train`), the same config, seed and synthetic data, three steps each.

The config: a tiny llama2 (2 layers, emb 256, 4 heads of 64, mlp 512, vocab 1024, 128 tokens, batch 1 per device)
on ici_tensor_sequence_parallelism=4 x ici_data_parallelism=2, matmul_precision=highest. What is compared, per step:
  float32             the loss within 1e-6 relative (the ops' XLA path computes what MaxText's dot does)
  bfloat16            within 2^-8 relative (one bfloat16 rounding: the ops round each rank's partial products)
  fp8, nanoo_fp8      step 0 within 1e-6 (the scales start at 1: the same float8 operands), then within 2e-3
                      relative (the delayed-scaling layers quantize x * (1/scale) in float32 where Flax divides in
                      the compute dtype, and run the GEMMs in float8: steps 1-2 drift by 1.6e-4 and 4e-4 here; the
                      float8 recipes themselves move the loss by 4.5e-3 from bfloat16's)
  fsdp 2 x tensor_sequence 4 with remat_policy=minimal   float32 within 1e-6 (remat policies keep working)
  fp8 on one device   within 2e-3 (the fp8 layers' group of one); with jax_overlap_fp8_cast=kernels, equal
and that a mixtral-style config (MoE experts untouched) and tensor parallelism without sequence parallelism train,
the census line's counts, its warning, and the errors for a recipe or an algorithm the integration does not take.
The runs start together at the first test (as many at once as half the cores), each in a process of its own.

  python -m pip install --no-deps -r tests/maxtext/requirements.txt   (Python >= 3.12)
  python -m pytest -q tests/maxtext
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from installed import maxtext_root, requires_maxtext

pytestmark = requires_maxtext

TINY = ["model_name=default", "decoder_block=llama2", "base_num_decoder_layers=2", "base_emb_dim=256",
        "base_num_query_heads=4", "base_num_kv_heads=4", "head_dim=64", "base_mlp_dim=512", "vocab_size=1024",
        "max_target_length=128", "per_device_batch_size=1", "dataset_type=synthetic", "steps=3",
        "weight_dtype=float32", "matmul_precision=highest", "attention=dot_product", "enable_dropout=false"]
TSP = ["ici_data_parallelism=2", "ici_tensor_sequence_parallelism=4", "ici_fsdp_parallelism=1"]
QUIET = ["hardware=cpu", "skip_jax_distributed_system=true", "enable_checkpointing=false",
         "async_checkpointing=false", "enable_tensorboard=false", "enable_goodput_recording=false",
         "monitor_goodput=false", "gcs_metrics=false", "save_config_to_gcs=false", "dump_hlo=false", "log_period=1",
         "jax_cache_dir=", "log_config=false"]
MIXTRAL = ["model_name=default", "decoder_block=mixtral", "base_num_decoder_layers=2", "base_emb_dim=256",
           "base_num_query_heads=4", "base_num_kv_heads=4", "head_dim=64", "base_mlp_dim=512", "vocab_size=1024",
           "base_moe_mlp_dim=512", "num_experts=4", "num_experts_per_tok=2", "sparse_matmul=false",
           "capacity_factor=-1",
           "max_target_length=128", "per_device_batch_size=1", "dataset_type=synthetic", "steps=3",
           "weight_dtype=float32", "attention=dot_product", "enable_dropout=false", "dtype=float32"]

# name: (jax_overlap or stock, arguments[, CPU devices: 8])
RUNS = {
    "stock_f32": (False, TINY + TSP + ["dtype=float32"]),
    "jo_f32": (True, TINY + TSP + ["dtype=float32"]),
    "stock_bf16": (False, TINY + TSP + ["dtype=bfloat16"]),
    "jo_bf16": (True, TINY + TSP + ["dtype=bfloat16"]),
    "stock_fp8": (False, TINY + TSP + ["dtype=bfloat16", "quantization=fp8"]),
    "jo_fp8": (True, TINY + TSP + ["dtype=bfloat16", "quantization=fp8"]),
    "stock_nanoo": (False, TINY + TSP + ["dtype=bfloat16", "quantization=nanoo_fp8"]),
    "jo_nanoo": (True, TINY + TSP + ["dtype=bfloat16", "quantization=nanoo_fp8"]),
    "stock_fsdp": (False, TINY + ["ici_fsdp_parallelism=2", "ici_tensor_sequence_parallelism=4",
                                  "ici_data_parallelism=1", "dtype=float32", "remat_policy=minimal"]),
    "jo_fsdp": (True, TINY + ["ici_fsdp_parallelism=2", "ici_tensor_sequence_parallelism=4",
                              "ici_data_parallelism=1", "dtype=float32", "remat_policy=minimal"]),
    "jo_mixtral": (True, MIXTRAL + TSP),
    "jo_tp": (True, TINY + ["ici_data_parallelism=2", "ici_tensor_parallelism=4", "ici_fsdp_parallelism=1",
                            "dtype=float32", "steps=1"]),
    "stock_fp8_one": (False, TINY + ["dtype=bfloat16", "quantization=fp8"], 1),
    "jo_fp8_one": (True, TINY + ["dtype=bfloat16", "quantization=fp8"], 1),
    "jo_fp8_one_cast_kernels": (True, TINY + ["dtype=bfloat16", "quantization=fp8", "jax_overlap_fp8_cast=kernels"],
                                1),
    "jo_int8": (True, TINY + TSP + ["dtype=bfloat16", "quantization=int8", "steps=1"]),
    "jo_fused_fp8": (True, TINY + TSP + ["dtype=bfloat16", "quantization=fp8", "jax_overlap_algorithm=fused",
                                         "steps=1"]),
}
CENSUS = re.compile(r"dense layers by op: ag_matmul (\d+), matmul_rs (\d+), local (\d+), dot (\d+)")


class Run:
  def __init__(self, name: str, out: pathlib.Path):
    overlap, args, devices = (*RUNS[name], 8)[:3]
    base = maxtext_root() / "configs" / "base.yml"
    self.metrics = out / f"{name}.metrics.jsonl"
    module = "jax_overlap.maxtext" if overlap else "maxtext.trainers.pre_train.train"
    command = [sys.executable, "-m", module, str(base), f"run_name={name}", f"base_output_directory={out}",
               f"metrics_file={self.metrics}", *QUIET, *args]
    env = {**os.environ, "DECOUPLE_GCLOUD": "TRUE", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    done = subprocess.run(command, cwd=out, env=env, capture_output=True, text=True, timeout=900)
    self.returncode, self.log = done.returncode, done.stdout + done.stderr

  def losses(self) -> list:
    assert self.returncode == 0, self.log[-4000:]
    return [json.loads(line)["learning/loss"] for line in self.metrics.read_text().splitlines()]

  def census(self) -> tuple:
    found = CENSUS.findall(self.log)
    assert len(found) == 1, f"the census line {len(found)} times:\n{self.log[-4000:]}"
    return tuple(int(n) for n in found[0])


@pytest.fixture(scope="session")
def runs(request, tmp_path_factory):
  """The runs the selected tests read (their `runs` marks), started together (half the cores' worth at once),
  awaited by name."""
  out = tmp_path_factory.mktemp("maxtext")
  wanted = dict.fromkeys(name for item in request.session.items for mark in item.iter_markers("runs")
                         for name in mark.args)
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 2) // 2))
  futures = {name: pool.submit(Run, name, out) for name in wanted}
  yield lambda name: futures[name].result()
  pool.shutdown(wait=False, cancel_futures=True)


def assert_losses(runs, stock: str, ours: str, rtol: float, first_rtol: float | None = None):
  a, b = runs(stock).losses(), runs(ours).losses()
  assert len(a) == len(b) == 3, (a, b)
  for step, (x, y) in enumerate(zip(a, b)):
    tol = first_rtol if step == 0 and first_rtol is not None else rtol
    assert abs(y - x) <= tol * abs(x), f"step {step}: stock {x!r}, jax_overlap {y!r} (rtol {tol})"
  assert a[0] != a[-1], "the loss did not move: the runs did not train"


@pytest.mark.runs("stock_f32", "jo_f32")
def test_float32_losses_equal_stock(runs):
  assert_losses(runs, "stock_f32", "jo_f32", 1e-6)
  assert runs("jo_f32").census() == (5, 2, 0, 0)  # q, k, v, wi_0, wi_1; out, wo


@pytest.mark.runs("stock_bf16", "jo_bf16")
def test_bfloat16_losses_within_bfloat16_rounding(runs):
  assert_losses(runs, "stock_bf16", "jo_bf16", 2.0 ** -8)


@pytest.mark.runs("stock_fp8", "jo_fp8", "stock_nanoo", "jo_nanoo")
@pytest.mark.parametrize("recipe", ["fp8", "nanoo"])
def test_fp8_recipes_within_fp8_tolerance_of_maxtexts(runs, recipe):
  assert_losses(runs, f"stock_{recipe}", f"jo_{recipe}", 2e-3, first_rtol=1e-6)
  assert runs(f"jo_{recipe}").census() == (5, 2, 0, 0)


@pytest.mark.runs("stock_fp8_one", "jo_fp8_one")
def test_fp8_on_one_device_runs_the_group_of_one(runs):
  """One device: no layer gathers or scatters, and the fp8 layers run the group of one (the vendor's fp8 GEMM on a
  GPU; here the XLA path, whose float32 accumulation moves step 0 too)."""
  assert_losses(runs, "stock_fp8_one", "jo_fp8_one", 2e-3)
  assert runs("jo_fp8_one").census() == (0, 0, 7, 0)


@pytest.mark.runs("jo_fp8_one", "jo_fp8_one_cast_kernels")
def test_fp8_cast_option_keeps_the_values(runs):
  """jax_overlap_fp8_cast=kernels (the cast kernels in place of XLA's casts, the default's, which compute the same
  values) is taken out of MaxText's arguments and passes its checks: here, where both are XLA's casts (the kernels
  are GPU code), the losses are equal."""
  assert runs("jo_fp8_one_cast_kernels").losses() == runs("jo_fp8_one").losses()
  assert runs("jo_fp8_one_cast_kernels").census() == (0, 0, 7, 0)


@pytest.mark.runs("stock_fsdp", "jo_fsdp")
def test_fsdp_with_a_remat_policy_equals_stock(runs):
  assert_losses(runs, "stock_fsdp", "jo_fsdp", 1e-6)
  assert runs("jo_fsdp").census() == (5, 2, 0, 0)


@pytest.mark.runs("jo_mixtral")
def test_mixtral_trains_with_experts_untouched(runs):
  """The attention's projections on the ops; the MoE layer (router and experts) keeps MaxText's dots, so the census
  counts attention only."""
  losses = runs("jo_mixtral").losses()
  assert all(loss == loss for loss in losses) and losses[-1] < losses[0], losses
  assert runs("jo_mixtral").census() == (3, 1, 0, 0)


@pytest.mark.runs("jo_tp")
def test_tensor_parallelism_alone_warns_naming_the_setting(runs):
  run = runs("jo_tp")
  assert run.returncode == 0, run.log[-4000:]
  assert run.census() == (0, 0, 0, 7)
  warnings = [line for line in run.log.splitlines() if "no dense layer all-gathers" in line]
  assert len(warnings) == 1 and "ici_tensor_sequence_parallelism" in warnings[0]


@pytest.mark.runs("jo_int8", "jo_fused_fp8")
@pytest.mark.parametrize("name,message", [
    ("jo_int8", "quantization='int8' is not a recipe jax_overlap runs"),
    ("jo_fused_fp8", "algorithm='fused' is 16-bit only, and quantization='fp8' computes in float8"),
])
def test_what_the_integration_does_not_take_is_an_error(runs, name, message):
  run = runs(name)
  assert run.returncode != 0 and f"jax_overlap.maxtext: {message}" in run.log, run.log[-4000:]
