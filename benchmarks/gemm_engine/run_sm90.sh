#!/usr/bin/env bash
# Builds and runs the sm90 (Hopper) persistent GEMM benchmark against cuBLASLt,
# after checking that its SASS issues HGMMA (wgmma), not HMMA.
#
#   [CUTLASS_INCLUDE=DIR | CUTLASS_BENCH=BIN] bash benchmarks/gemm_engine/run_sm90.sh [OUT]
set -euo pipefail
status=0
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
timeout 240 "$out" || status=$?
# CUTLASS's sm90 GEMM beside it, where CUTLASS_INCLUDE names CUTLASS's include
# folder (pip's nvidia-cutlass: cutlass_library/source/include) or CUTLASS_BENCH a
# binary built from cutlass_sm90_bench.cu elsewhere (about 8 minutes of compile
# on two cores). -DNDEBUG: CUTLASS's device asserts are calls, across which
# ptxas serializes the wgmmas (warning C7510).
if [[ -n "${CUTLASS_INCLUDE:-}" ]]; then
  nvcc -O3 -DNDEBUG -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -I"$root/csrc" \
    -I"$here" -I"$CUTLASS_INCLUDE" -I"$CUTLASS_INCLUDE/../tools/util/include" "$here/cutlass_sm90_bench.cu" \
    -o "$out.cutlass"
  CUTLASS_BENCH="$out.cutlass"
fi
if [[ -n "${CUTLASS_BENCH:-}" ]]; then timeout 120 "$CUTLASS_BENCH"; fi
exit "$status"
