#!/usr/bin/env bash
# One run on the GPU machine: build, GPU tests, several JAX processes on one GPU
# under MPS, the CPU test suite on this machine's JAX, the GEMM-engine variants
# and the op benchmarks; a summary table last. Logs and results go to $OUT
# (default /tmp/device_check).
#
#   JAX_OVERLAP_COMMIT=<commit> bash tools/device_check.sh [STEP ...]
#     (the commit the results files record: the machine's copy of the tree
#     does not know it)
#     steps: build gpu_tests multiprocess examples bench bench_pipelined gemm_engine cpu_tests
#            (default: all of these); gpu_new gpu_old example_block (parts of gpu_tests, examples);
#            gpu_all (every tests/gpu/test_*.py, one pytest each; GPU_TESTS="f1 f2" narrows it);
#            gemm_sm90 (the sm90 GEMM engine beside cuBLASLt and CUTLASS: benchmarks/gemm_engine/run_sm90.sh);
#            gemm_engine_ab (two commits' GEMM engines from .gemm_objs/{base,head}: run.sh --objects)
#            bench_plans (bench_pipelined with --plans: every plan of each schedule row)
#            per_gpu bench_multi                                               (machines with 2+ GPUs)
#
# The machine has no network: pytest comes from wheels in .whl/ when missing,
# and the build uses the preinstalled scikit-build-core (--no-build-isolation).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/device_check}"
mkdir -p "$OUT"
STEPS=("$@")
[[ ${#STEPS[@]} -gt 0 ]] || STEPS=(build gpu_tests multiprocess examples bench bench_pipelined gemm_engine cpu_tests)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0  # NVLink multicast stays off (device KINDS.md)
# shellcheck source=tools/device_steps.sh
source tools/device_steps.sh
install_carried_tools

for step in "${STEPS[@]}"; do
  case "$step" in
    build)
      # A build directory in the tree: a later call on the same (warm) machine rebuilds what changed only.
      # The tests, examples and benchmarks import the installed package (tests/conftest.py keeps the
      # repository root off sys.path), never ./jax_overlap.
      run build 300 env JAX_OVERLAP_PLATFORM=cuda \
        python3 -m pip install --no-build-isolation --no-deps -v -C build-dir=build/device . ;;
    gpu_tests)
      # One pytest per file: a crash in one cannot hide the other's results.
      run gpu_pipelined 240 env JAX_PLATFORMS=cuda python3 -m pytest -q -rs tests/gpu/test_pipelined.py
      run gpu_world1 200 env JAX_PLATFORMS=cuda python3 -m pytest -q -rs tests/gpu/test_world1.py
      run gpu_sim_group 200 env JAX_PLATFORMS=cuda python3 -m pytest -q -rs tests/gpu/test_sim_group.py
      run gpu_amd_path 240 env JAX_PLATFORMS=cuda python3 -m pytest -q -rs tests/gpu/test_amd_path.py
      run gpu_multi_gpu 200 env JAX_PLATFORMS=cuda python3 -m pytest -q -rs tests/gpu/test_multi_gpu.py ;;
    gpu_all)
      # One pytest per file: a crash in one cannot hide the others' results.
      for f in ${GPU_TESTS:-tests/gpu/test_*.py}; do
        name="$(basename "$f" .py)"
        run "gpu_${name#test_}" 300 env JAX_PLATFORMS=cuda python3 -m pytest -q -rfEs --tb=short \
          -o faulthandler_timeout=150 "$f"
      done ;;
    gemm_sm90)
      # A whole device command of its own (its timeouts keep it inside 10 minutes); CUTLASS_BENCH: run_sm90.sh.
      run gemm_sm90 590 bash benchmarks/gemm_engine/run_sm90.sh "$OUT" ;;
    gpu_new)
      run gpu_pipelined 400 env JAX_PLATFORMS=cuda python3 -m pytest -q -rfEs --tb=short --durations=8 \
        -o faulthandler_timeout=150 tests/gpu/test_pipelined.py ;;
    gpu_old)
      run gpu_world1 200 env JAX_PLATFORMS=cuda python3 -m pytest -q -rs tests/gpu/test_world1.py
      run gpu_sim_group 200 env JAX_PLATFORMS=cuda python3 -m pytest -q -rs tests/gpu/test_sim_group.py
      run gpu_amd_path 240 env JAX_PLATFORMS=cuda python3 -m pytest -q -rs tests/gpu/test_amd_path.py ;;
    multiprocess)
      run multiprocess 300 python3 tests/gpu/multiprocess.py --worlds 2 4 8 ;;
    per_gpu)
      run per_gpu 200 python3 tests/gpu/multiprocess.py --per-gpu ;;
    bench_multi)
      run bench_multi 500 python3 benchmarks/bench_multi_gpu.py --out "$OUT" ;;
    cpu_tests)
      run cpu_tests 300 env JAX_PLATFORMS=cpu python3 -m pytest -q -rfE --tb=line -n 8 tests --ignore=tests/gpu ;;
    example_block)
      run example_block 180 python3 examples/transformer_block.py ;;
    examples)
      run example_block 180 python3 examples/transformer_block.py
      run example_shard_map 120 python3 examples/mlp_shard_map.py --batch 4 --seq 2048 --hidden 4096 --ffn 14336
      run example_jit 120 python3 examples/mlp_jit.py --batch 4 --seq 2048 --hidden 4096 --ffn 14336 ;;
    gemm_engine)
      run gemm_engine 120 bash benchmarks/gemm_engine/run.sh ;;
    gemm_engine_ab)
      # Two commits' engines, objects compiled off the device into .gemm_objs/{base,head} (run.sh --objects),
      # run alternately twice: base, head, base, head.
      for i in 1 2; do
        for which in base head; do
          run "gemm_engine_${which}_$i" 150 bash benchmarks/gemm_engine/run.sh --objects ".gemm_objs/$which" \
            "/tmp/jo_gemm_$which"
        done
      done ;;
    bench)
      run bench_ag 200 python3 benchmarks/bench_ag_matmul.py --out "$OUT"
      run bench_rs 200 python3 benchmarks/bench_matmul_rs.py --out "$OUT" ;;
    bench_pipelined)
      run bench_pipelined 300 python3 benchmarks/bench_pipelined.py --out "$OUT" ;;
    bench_plans)
      run bench_plans 420 python3 benchmarks/bench_pipelined.py --out "$OUT" --plans ;;
    *) echo "unknown step $step" >&2 ;;
  esac
done

print_summary
