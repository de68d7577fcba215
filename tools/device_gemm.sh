#!/usr/bin/env bash
# Issue 39 on the GPU machine, in one run of at most 9 minutes on one H200: the build, the GPU tests of the
# GEMM tuning, the group of one's per-call path, the cross-stream edges and the fallbacks under fault
# injection; the world-1 table (benchmarks/bench_gemm_ab.py) and the cost model's sweep in loopback
# (benchmarks/bench_model_sweep.py, given the time that is left); a short table last. Results (JSON) and one
# log file go to $OUT (default /tmp/device_gemm).
#
#   JAX_OVERLAP_COMMIT=<commit> OUT=<dir> bash tools/device_gemm.sh [STEP ...]
#     steps: build tests ab sweep summary (default: all, in this order)
#
# The machine has no network: pytest comes from wheels in .whl/ when missing, and the build uses the
# preinstalled scikit-build-core (--no-build-isolation).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/device_gemm}"
mkdir -p "$OUT"
STEPS=("$@")
[[ ${#STEPS[@]} -gt 0 ]] || STEPS=(build tests ab sweep summary)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 JAX_PLATFORMS=cuda OUT
TOTAL_S=540  # the run's budget: the sweep gets what the steps before it left
# shellcheck source=tools/device_steps.sh
source tools/device_steps.sh
install_carried_tools

for step in "${STEPS[@]}"; do
  case "$step" in
    build)
      # A build directory in the tree: a later call on the same (warm) machine rebuilds what changed only. The
      # tests and benchmarks import the installed package (tests/conftest.py keeps the repository root off sys.path).
      run build 240 env JAX_OVERLAP_PLATFORM=cuda \
        python3 -m pip install --no-build-isolation --no-deps -v -C build-dir=build/device . ;;
    tests)
      # The new tests whole; of the changed paths, the group of one (command buffers included), the loopback, the
      # timings the model is fed with, bits across ranks, the capture check's fallback.
      run tests 150 python3 -m pytest -q -rfEs --tb=short -o faulthandler_timeout=120 \
        tests/gpu/test_vendor_gemm.py \
        "tests/gpu/test_pipelined.py::test_group_of_one_is_the_vendor_gemm" \
        "tests/gpu/test_pipelined.py::test_vendor_gemm_calls_sit_in_a_command_buffer_and_replay_right" \
        "tests/gpu/test_pipelined.py::test_loopback_schedule_computes_the_op" \
        "tests/gpu/test_pipelined.py::test_matmul_rs_bits_repeat" \
        "tests/gpu/test_pipelined.py::test_gemm_timings_for_the_cost_model" \
        "tests/gpu/test_fp8_world1.py::test_fp8_vendor_gemm_calls_sit_in_a_command_buffer_and_replay_right" \
        "tests/gpu/test_copy_paths.py::test_the_vendor_gemm_passes_its_capture_check_here" \
        "tests/gpu/test_copy_paths.py::test_a_failed_capture_check_keeps_the_vendor_gemm_out_of_command_buffers" ;;
    ab)
      run ab 240 python3 benchmarks/bench_gemm_ab.py --out "$OUT" ;;
    sweep)
      left=$((TOTAL_S - (SECONDS - T0) - 60))
      (( left > 60 )) || left=60
      run sweep $((left + 90)) python3 benchmarks/bench_model_sweep.py --out "$OUT" --budget-s "$left" ;;
    summary)
      python3 - "$OUT" <<'EOF'
import glob, json, sys
out = sys.argv[1]
def rows(name):
  files = sorted(glob.glob(f"{out}/{name}_*.json"))
  return json.load(open(files[-1]))["rows"] if files else []
print("\n=== world 1 (us per call; in turns: op, xla, torch, tunable; profiled in turns: gpu spans, GEMM kernels, "
      "other kernels; gpu_r: GPU time against XLA's and the tuned algorithm's; ratio, in turns: bf16 >= 0.98 of "
      "min(xla, torch, tunable), fp8 >= 0.97 of torch)")
print(f"{'dtype':>14} {'M x N x K':>18} {'op':>8} {'xla':>8} {'torch':>8} {'tunable':>8} {'op_gpu':>8} {'xla_gpu':>8} "
      f"{'op_gemm':>8} {'xla_gemm':>8} {'op_oth':>7} {'xla_oth':>7} {'gpu_r':>6} {'ratio':>6}")
f = lambda v: "-" if v is None else f"{v:.1f}"
for r in rows("gemm_ab"):
  if r["table"] == "gemm":
    target = 0.97 if r["dtype"] != "bfloat16" else 0.98
    ok = "ok" if r.get("best_ratio") and r["best_ratio"] >= target else "LOW"
    print(f"{r['dtype']:>14} {r['m']:>6}x{r['n']}x{r['k']:<5} "
          + " ".join(f"{f(r.get(c)):>8}" for c in ("op_us", "xla_us", "torch_us", "torch_tuned_us", "op_gpu_us",
                                                    "xla_gpu_us", "op_kernel_us", "xla_kernel_us"))
          + f" {f(r.get('op_other_us')):>7} {f(r.get('xla_other_us')):>7} {r.get('gpu_ratio') or 0:>6.3f}"
          + f" {r.get('best_ratio') or 0:>6.3f} {ok}")
  elif r["table"] == "host":
    print(f"host cost, command buffers off, 128^3: op {r['op_us']:.1f} us/call, XLA's dot {r['xla_us']:.1f}: "
          f"+{r['extra_us']:.1f} us")
sweep = [r for r in rows("model_sweep") if r.get("table") != "fit"]
fit = [r for r in rows("model_sweep") if r.get("table") == "fit"]
if sweep:
  off = [r for r in sweep if abs(r["model_ratio"] - 1) > 0.1]
  wrong = [r for r in sweep if r["auto_wrong"]]
  low = [r for r in sweep if r["m"] >= 2048 and r["vs_gemm"] < (0.93 if r["dtype"] == "bfloat16" else 0.90)]
  print(f"\n=== model sweep: {len(sweep)} rows; model off > 10%: {len(off)}; auto slower than XLA: {len(wrong)}; "
        f"vs one GEMM below target (M >= 2048): {len(low)}")
  for r in off + wrong + low:
    print(f"  {r['op']:>9} {r['dtype']:>13} T={r['world']} M={r['m']:<5} {r['stages']:>16} model/loop "
          f"{r['model_ratio']:.3f} vs_gemm {r['vs_gemm']:.3f} (synced {r['vs_gemm_synced']:.3f}) "
          f"loop {r['loopback_us']:.0f} xla {r['xla_path_us']:.0f} "
          f"auto {r['auto']}")
  if fit:
    print(f"  fitted overheads: stage {fit[0]['stage_overhead_us']} us, call {fit[0]['call_overhead_us']} us; worst "
          f"{fit[0]['worst_before']:.3f} -> {fit[0]['worst_after']:.3f}")
EOF
      ;;
    *) echo "unknown step $step" >&2 ;;
  esac
done

print_summary
