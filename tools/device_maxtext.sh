#!/usr/bin/env bash
# The MaxText integration on one GPU of the GPU machine (no network; Python 3.12, jax 0.11.2 and flax installed):
# MaxText's wheels from .whl_maxtext/ (tools/maxtext_wheels.py: carry that folder), the CUDA build, the GPU tests
# of the fp8 cast with its amax and of the delayed-scaling step kernel, bench_fp8_delayed.py (the delayed-scaling layer's forward against the bf16 dot) and
# bench_maxtext.py (MaxText stock against jax_overlap: the tiny config, a llama2-1B-like one in bf16 and fp8); a
# summary and the two benchmarks' tables last. About 8 minutes on an H200. Results go to $OUT (default
# /tmp/device_maxtext): logs.txt (every step's log), fp8_delayed_<date>.json, maxtext_<date>.json; the installed
# wheels and the steps' own logs stay out of it (/tmp/device_maxtext_work).
#
#   JAX_OVERLAP_COMMIT=<commit> bash tools/device_maxtext.sh [STEP ...]
#     steps: install build gpu_tests bench_delayed bench_maxtext (default: all, in this order);
#            profile_maxtext (bench_maxtext.py on the 1b config with --profile --cast-kernels: GPU time by kernel kind)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/device_maxtext}"
WORK=/tmp/device_maxtext_work
DEPS="$WORK/deps"  # the carried wheels the machine lacks, first on PYTHONPATH
mkdir -p "$OUT" "$WORK"
WITH_DEPS=(env "PYTHONPATH=$DEPS${PYTHONPATH:+:$PYTHONPATH}")
STEPS=("$@")
[[ ${#STEPS[@]} -gt 0 ]] || STEPS=(install build gpu_tests bench_delayed bench_maxtext)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 DECOUPLE_GCLOUD=TRUE
STEP_LOGS="$WORK"  # the benchmarks' logs, whose tables print last
# shellcheck source=tools/device_steps.sh
source tools/device_steps.sh

for step in "${STEPS[@]}"; do
  case "$step" in
    install)
      run install 180 python3 tools/maxtext_wheels.py install .whl_maxtext "$DEPS"
      run versions 60 "${WITH_DEPS[@]}" python3 -c "import jax, flax, maxtext, pytest; print('jax', jax.__version__, \
'flax', flax.__version__, 'maxtext', maxtext.__version__, 'pytest', pytest.__version__)" ;;
    build)
      # the installed package is what the tests and benchmarks import (tests/conftest.py keeps ./jax_overlap off)
      run build 360 env JAX_OVERLAP_PLATFORM=cuda \
        python3 -m pip install --no-build-isolation --no-deps -v -C build-dir=build/device . ;;
    gpu_tests)
      run gpu_fp8_cast 180 "${WITH_DEPS[@]}" JAX_PLATFORMS=cuda python3 -m pytest -q -rs \
        tests/gpu/test_fp8_cast_kernel.py tests/gpu/test_fp8_scales_kernel.py -s ;;
    bench_delayed)
      run bench_delayed 180 "${WITH_DEPS[@]}" python3 benchmarks/bench_fp8_delayed.py --out "$OUT" ;;
    bench_maxtext)
      run bench_maxtext 480 "${WITH_DEPS[@]}" python3 benchmarks/bench_maxtext.py --out "$OUT" ;;
    profile_maxtext)
      run bench_maxtext 540 "${WITH_DEPS[@]}" python3 benchmarks/bench_maxtext.py --out "$OUT" --configs 1b \
        --profile --cast-kernels ;;
    *) echo "unknown step $step" >&2 ;;
  esac
done

print_summary
for name in bench_delayed bench_maxtext; do
  [[ -f "$WORK/$name.log" ]] || continue
  echo "=== $name"
  sed -n '/^results:/,$p' "$WORK/$name.log"
done
