#!/usr/bin/env bash
# The sm90 (Hopper) GEMM's variants (csrc/gemm/sm90; hopper_variants.h lists them) against cuBLASLt and CUTLASS on
# one GPU, in one call: builds hopper_bench (its three variant tables compile in parallel), prints ptxas's registers
# and spills and the SASS facts of every kernel, runs one hopper_bench process per dtype and cluster shape (a
# variant that wedges its context takes only its own process down; each runs under a timeout), CUTLASS's GEMM after
# the one-CTA variants, and prints one table last (sm90_table.py): per dtype and shape, per variant, us, TFLOP/s,
# x cuBLASLt, x CUTLASS. The timeouts (6 x 70 s, 40 s, each followed by SIGKILL 5 s after its SIGTERM, for a process
# that a wedged context keeps from exiting) keep even a run whose every process hangs inside one 10-minute device
# command; a healthy one should take some 20 s a process.
#
#   [CUTLASS_BENCH=BIN | CUTLASS_INCLUDE=DIR] bash benchmarks/gemm_engine/run_sm90.sh [OUT]
#   CUTLASS_INCLUDE=DIR bash benchmarks/gemm_engine/run_sm90.sh --build-cutlass BIN
#
# OUT (default /tmp/jo_sm90) receives build.txt (ptxas, SASS), bench.log (every process's output) and table.txt.
# CUTLASS_BENCH names a cutlass_sm90_bench built beforehand, off the GPU machine (--build-cutlass: 2.5 minutes on
# two cores, 2026-12-07; it links only the CUDA runtime); CUTLASS_INCLUDE (pip's nvidia-cutlass: cutlass_library/source/include)
# builds it here instead, in the background while the GPU runs hopper_bench. cuBLASLt's header and library come from
# CUDA_HOME, else from pip's nvidia-cublas.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cuda=${CUDA_HOME:-/usr/local/cuda}
nvcc=$(command -v nvcc || echo "$cuda/bin/nvcc")
# wgmma and setmaxnreg exist only on sm_90a; the -arch=sm_90a shorthand would
# also run a plain sm_90 pass that rejects them.
flags=(-O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I"$root/csrc" -I"$here")
# -DNDEBUG: CUTLASS's device asserts are calls, across which ptxas serializes
# the wgmmas (warning C7510).
build_cutlass() {  # build_cutlass BIN
  "$nvcc" "${flags[@]}" -DNDEBUG --expt-relaxed-constexpr -I"$CUTLASS_INCLUDE" \
    -I"$CUTLASS_INCLUDE/../tools/util/include" "$here/cutlass_sm90_bench.cu" -o "$1"
}
if [[ "${1:-}" == --build-cutlass ]]; then
  [[ -n "${CUTLASS_INCLUDE:-}" && -n "${2:-}" ]] || { echo "usage: CUTLASS_INCLUDE=DIR $0 --build-cutlass BIN" >&2; exit 2; }
  mkdir -p "$(dirname "$2")" && build_cutlass "$2"
  exit
fi

out=${1:-/tmp/jo_sm90}
build=$(mktemp -d /tmp/jo_sm90_build.XXXXXX)
mkdir -p "$out"
: > "$out/bench.log"
if [[ -z "${CUTLASS_BENCH:-}" && -n "${CUTLASS_INCLUDE:-}" ]]; then
  CUTLASS_BENCH="$build/cutlass_sm90_bench"
  build_cutlass "$CUTLASS_BENCH" > "$build/cutlass_build.txt" 2>&1 &
  cutlass_pid=$!
fi

# cuBLASLt: the toolkit's, else pip's nvidia-cublas (nvidia/cu13/{include,lib}).
if [[ -f "$cuda/include/cublasLt.h" ]] && compgen -G "$cuda/lib64/libcublasLt.so*" > /dev/null; then
  blas_inc=(-I"$cuda/include") blas_lib=(-L"$cuda/lib64" -lcublasLt -Xlinker -rpath="$cuda/lib64")
else
  wheel=$(python3 -c 'import nvidia, os
for p in nvidia.__path__:
    if os.path.exists(os.path.join(p, "cu13", "include", "cublasLt.h")): print(os.path.join(p, "cu13"))' 2>/dev/null |
    head -1)
  [[ -n "$wheel" ]] || { echo "run_sm90: no cuBLASLt (neither $cuda nor pip's nvidia-cublas)" >&2; exit 1; }
  blas_inc=(-I"$wheel/include") blas_lib=(-L"$wheel/lib" -l:libcublasLt.so.13 -Xlinker -rpath="$wheel/lib")
fi

{
  # In parallel where there are cores for it (the GPU machines have 16), one at a time on a small machine.
  srcs=(hopper_bench hopper_variants_bf16_bf16 hopper_variants_bf16_f32 hopper_variants_fp8_bf16)
  compile() {  # compile SRC: 0, or its ptxas output and 1
    "$nvcc" "${flags[@]}" "${blas_inc[@]}" -Xptxas -v -c "$here/$1.cu" -o "$build/$1.o" 2> "$build/$1.ptxas.txt" ||
      { cat "$build/$1.ptxas.txt"; echo "run_sm90: $1.cu did not build"; return 1; }
  }
  pids=()
  for s in "${srcs[@]}"; do
    if [[ $(nproc) -ge 8 ]]; then compile "$s" & pids+=($!); else compile "$s" || exit 1; fi
  done
  for pid in "${pids[@]}"; do wait "$pid" || exit 1; done
  objs=("${srcs[@]/#/$build/}")
  "$nvcc" -gencode=arch=compute_90a,code=sm_90a "${objs[@]/%/.o}" -o "$build/hopper_bench" "${blas_lib[@]}" \
    || { echo "run_sm90: hopper_bench did not link"; exit 1; }
} 2>&1 | tee "$out/build.txt"
[[ -x "$build/hopper_bench" ]] || exit 1
bench="$build/hopper_bench"
{
  echo "ptxas (every kernel of the three variant tables; 168 is the cap of 384 threads at one block per SM):"
  cat "$build"/hopper_variants_*.ptxas.txt | grep -E "registers|spill" | sed 's/ptxas info *: //' | sort | uniq -c
  grep -h -i "warning" "$build"/*.ptxas.txt | sort | uniq -c
  echo "SASS per kernel <in, out, BN, stages, cluster M, cluster N, epilogue, wgmma depth, schedule>: highest" \
    "register, counts:"
  "$(command -v cuobjdump || echo "$cuda/bin/cuobjdump")" -sass "$bench" | awk -f "$here/sass_stats.awk" |
    "$(command -v c++filt || echo cat)" |
    sed -E 's/void jo::gemm::sm90::gemm_kernel<//; s/jo::gemm::sm90::Variant<//; s/\(jo::gemm::sm90::Epilogue\)0/direct/;
            s/\(jo::gemm::sm90::Epilogue\)1/tma/; s/\(jo::gemm::sm90::Schedule\)0/coop/;
            s/\(jo::gemm::sm90::Schedule\)1/pp/; s/>\(CUtensorMap_st, [^)]*\)//; s/__nv_//g' | sort
} 2>&1 | tee -a "$out/build.txt"

status=0
results=()
run() {  # run TAG ARGS...: one hopper_bench process, bounded
  local tag=$1 rc=0
  shift
  echo "=== hopper_bench $* --tag $tag" | tee -a "$out/bench.log"
  timeout -k 5 70 "$bench" "$@" --tag "$tag" 2>&1 | tee -a "$out/bench.log" || rc=$?
  local why=
  [[ $rc == 124 || $rc == 137 ]] && why=', timed out'
  results+=("$tag: $([[ $rc == 0 ]] && echo PASS || echo "FAIL (rc $rc$why)")")
  [[ $rc == 0 ]] || status=1
}
run bf16-c1 --dtype bf16 --only c1
run fp8-c1 --dtype fp8 --only c1
if [[ -n "${cutlass_pid:-}" ]]; then
  wait "$cutlass_pid" || { cat "$build/cutlass_build.txt"; CUTLASS_BENCH=; results+=("cutlass: did not build"); }
fi
if [[ -n "${CUTLASS_BENCH:-}" ]]; then
  echo "=== $CUTLASS_BENCH" | tee -a "$out/bench.log"
  rc=0
  timeout -k 5 40 "$CUTLASS_BENCH" 2>&1 | tee -a "$out/bench.log" || rc=$?
  results+=("cutlass: $([[ $rc == 0 ]] && echo PASS || echo "FAIL (rc $rc)")")
else
  results+=("cutlass: not run (set CUTLASS_BENCH or CUTLASS_INCLUDE)")
fi
# Clusters of two last: a protocol bug there (a multicast barrier that never
# completes) drains through the bounded waits, or at worst ends at the timeout.
run bf16-c2m --dtype bf16 --only c2m
run fp8-c2m --dtype fp8 --only c2m
run bf16-c2n --dtype bf16 --only c2n
run fp8-c2n --dtype fp8 --only c2n

python3 "$here/sm90_table.py" "$out/bench.log" | tee "$out/table.txt"
printf '%s\n' "" "processes:" "${results[@]}" | tee -a "$out/table.txt"
exit "$status"
