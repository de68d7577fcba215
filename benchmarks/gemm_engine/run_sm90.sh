#!/usr/bin/env bash
# Builds and runs the sm90 (Hopper) persistent GEMM benchmark against cuBLASLt,
# after checking that its SASS issues HGMMA (wgmma), not HMMA.
#
#   bash benchmarks/gemm_engine/run_sm90.sh [OUT]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${1:-/tmp/jo_sm90_bench}
cuda=${CUDA_HOME:-/usr/local/cuda}
# wgmma and setmaxnreg exist only on sm_90a; the -arch=sm_90a shorthand would
# also run a plain sm_90 pass that rejects them.
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I"$root/csrc" -Xptxas -v "$here/hopper_bench.cu" \
  -L"$cuda/lib64" -lcublasLt -o "$out" 2> "$out.ptxas.txt" || { cat "$out.ptxas.txt"; exit 1; }
grep -E "spill|registers" "$out.ptxas.txt" | sort | uniq -c
"$cuda/bin/cuobjdump" -sass "$out" > "$out.sass"
echo "SASS: HGMMA $(grep -c 'HGMMA' "$out.sass"), HMMA $(grep -c ' HMMA' "$out.sass" || true)," \
  "UTMALDG $(grep -c 'UTMALDG' "$out.sass"), USETMAXREG $(grep -c 'USETMAXREG' "$out.sass")," \
  "local memory $(grep -cE ' (LDL|STL)' "$out.sass" || true)"
timeout 240 "$out"
