#!/usr/bin/env bash
# Builds and runs the tile-engine benchmark (NVIDIA: nvcc + cuBLAS).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${1:-/tmp/jo_gemm_engine_bench}
cuda=${CUDA_HOME:-/usr/local/cuda}
nvcc -O3 -std=c++17 -arch=sm_90 -I"$root/csrc" -DJAX_OVERLAP_CUDA=1 \
  "$here/bench.cu" -L"$cuda/lib64" -lcublas -o "$out"
"$out"
