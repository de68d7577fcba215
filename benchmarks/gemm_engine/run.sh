#!/usr/bin/env bash
# Builds and runs the mma.sync ceiling and the tile-engine benchmark, which
# also launches the fused kernels (NVIDIA: nvcc + cuBLAS).
#
#   bash benchmarks/gemm_engine/run.sh [OUT]
#   bash benchmarks/gemm_engine/run.sh --objects DIR [OUT]
#     links every DIR/*.o: bench.o, ag_matmul.o, matmul_rs.o and, from commits
#     that have it, tile_registry.o, compiled elsewhere (the -c commands below;
#     any commit, compiled on a machine without a GPU) and
#     runs the engine benchmark only: two commits' engines in one run, on one
#     GPU, by calling this once per commit, alternately.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
objects=""
if [[ "${1:-}" == "--objects" ]]; then objects=$(cd "$2" && pwd); shift 2; fi
out=${1:-/tmp/jo_gemm_engine_bench}
cuda=${CUDA_HOME:-/usr/local/cuda}
flags=(-O3 -std=c++17 -arch=sm_90 -I"$root/csrc" -DJAX_OVERLAP_CUDA=1)
if [[ -n "$objects" ]]; then
  nvcc -arch=sm_90 "$objects"/*.o -L"$cuda/lib64" -lcublas -o "$out"
  "$out"
  exit
fi
pids=()
nvcc "${flags[@]}" "$here/mma_peak.cu" -o "$out.mma_peak" & pids+=($!)
for src in "$here/bench.cu" "$root/csrc/kernels/ag_matmul.cu" "$root/csrc/kernels/matmul_rs.cu" \
           "$root/csrc/kernels/tile_registry.cu"; do
  nvcc "${flags[@]}" -c "$src" -o "$out.$(basename "$src" .cu).o" & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
nvcc -arch=sm_90 "$out.bench.o" "$out.ag_matmul.o" "$out.matmul_rs.o" "$out.tile_registry.o" -L"$cuda/lib64" \
  -lcublas -o "$out"
"$out.mma_peak"
"$out"
