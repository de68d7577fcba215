#!/usr/bin/env bash
# ROCm compile check without AMD hardware (recipe: shared/GPU.md).
#
#   tools/hip_compile_check.sh [OUT_DIR]        (default: build/hip_check)
#
# 1. Device code: every csrc/kernels/*.cu, for each arch (gfx942, gfx950), compiled
#    with clang++-NN -x hip --cuda-device-only against Debian's ROCm device bitcode,
#    unbundled to a code object and disassembled. Per-kernel resource usage
#    (VGPRs, ScratchSize, Occupancy) comes from -Rpass-analysis=kernel-resource-usage.
#      OUT/<arch>/<name>.s         llvm-objdump -d --mcpu=<arch>
#      OUT/<arch>/<name>.res.log   compiler stderr incl. resource-usage remarks
#      OUT/<arch>/<name>.notes     llvm-readelf --notes (amdhsa.kernels metadata)
#    Bitcode linked: ockl.bc, oclc_abi_version_500.bc and (if present) hip.bc.
# 2. Host code: every csrc/**/*.cc and csrc/**/*.cu compiled host-only as HIP
#    (-x hip --cuda-host-only) against the HIP headers in /usr/include/hip, a
#    syntax/type check of the host side.  Logs: OUT/host/*.log
# tools/check_isa.py OUT_DIR then enforces the ISA rules on the results.
#
# Exits non-zero on any compile error.
#
# Environment:
#   HIP_CHECK_ARCHS     archs to compile (default "gfx942 gfx950")
#   HIP_CHECK_CLANG     clang++ to use (default: newest clang++-NN >= 20 on PATH)
#   HIP_CHECK_BITCODE   ROCm device bitcode dir (default: searched under /usr/lib)
#   HIP_CHECK_JOBS      parallel compiles (default: nproc)
#   HIP_CHECK_FLAGS     extra flags for every compile
#   PYTHON              python with jaxlib + pybind11 (default: python3)
#   JAXLIB_INCLUDE      XLA FFI include dir (default: from jaxlib)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-build/hip_check}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
ARCHS="${HIP_CHECK_ARCHS:-gfx942 gfx950}"
JOBS="${HIP_CHECK_JOBS:-$(nproc 2>/dev/null || echo 2)}"
PYTHON="${PYTHON:-python3}"

die() { echo "hip_compile_check: error: $*" >&2; exit 2; }
note() { echo "hip_compile_check: $*"; }

# ---------------------------------------------------------------- toolchain
clang_major() { "$1" --version 2>/dev/null | sed -n 's/.*clang version \([0-9][0-9]*\).*/\1/p' | head -1; }

CLANG="${HIP_CHECK_CLANG:-}"
if [[ -z "$CLANG" ]]; then
  best=0
  IFS=: read -r -a _path <<< "$PATH"
  for d in "${_path[@]}" /usr/bin; do
    for c in "$d"/clang++-[0-9]*; do
      [[ -x "$c" ]] || continue
      v="${c##*clang++-}"
      [[ "$v" =~ ^[0-9]+$ ]] || continue
      if (( v > best )); then best=$v; CLANG="$c"; fi
    done
  done
  [[ -n "$CLANG" ]] || die "no clang++-NN on PATH (apt-get install clang-22 lld-22 hipcc)"
fi
MAJOR="$(clang_major "$CLANG")"
[[ -n "$MAJOR" ]] || die "cannot read the version of $CLANG"
(( MAJOR >= 17 )) || die "$CLANG is clang $MAJOR; gfx942 needs clang >= 17 (gfx950: >= 20)"

tool() {  # tool NAME -> NAME-MAJOR on PATH, or in /usr/lib/llvm-MAJOR/bin
  local t
  for t in "$1-$MAJOR" "/usr/lib/llvm-$MAJOR/bin/$1"; do
    if command -v "$t" >/dev/null 2>&1; then command -v "$t"; return 0; fi
  done
  return 1
}
# The bundler runs llvm-objcopy from PATH: put this LLVM's bin dir first.
if [[ -d "/usr/lib/llvm-$MAJOR/bin" ]]; then export PATH="/usr/lib/llvm-$MAJOR/bin:$PATH"; fi
BUNDLER="$(tool clang-offload-bundler)" || die "clang-offload-bundler-$MAJOR not found (apt-get install clang-tools-$MAJOR)"
OBJDUMP="$(tool llvm-objdump)" || die "llvm-objdump-$MAJOR not found (apt-get install llvm-$MAJOR)"
READELF="$(tool llvm-readelf)" || READELF=""
CXXFILT="$(tool llvm-cxxfilt)" || CXXFILT="$(command -v c++filt || true)"

BC="${HIP_CHECK_BITCODE:-}"
if [[ -z "$BC" ]]; then
  for d in /usr/lib/x86_64-linux-gnu/amdgcn/bitcode /opt/rocm/amdgcn/bitcode \
           $(find /usr/lib -name oclc_abi_version_500.bc -path '*amdgcn*' -printf '%h\n' 2>/dev/null | sort -rV); do
    if [[ -f "$d/ockl.bc" && -f "$d/oclc_abi_version_500.bc" ]]; then BC="$d"; break; fi
  done
fi
[[ -n "$BC" && -f "$BC/ockl.bc" ]] || die "ROCm device bitcode (ockl.bc, oclc_abi_version_500.bc) not found (apt-get install hipcc)"
[[ -f /usr/include/hip/hip_runtime.h ]] || die "/usr/include/hip/hip_runtime.h not found (apt-get install hipcc)"
HIP_VERSION_STR="$(sed -n 's/^#define HIP_VERSION_\(MAJOR\|MINOR\|PATCH\) *\([0-9]*\).*/\2/p' /usr/include/hip/hip_version.h 2>/dev/null | paste -sd. -)"

JAXLIB_INCLUDE="${JAXLIB_INCLUDE:-$("$PYTHON" -c 'import jaxlib, os; print(os.path.join(os.path.dirname(jaxlib.__file__), "include"))' 2>/dev/null || true)}"
[[ -n "$JAXLIB_INCLUDE" && -f "$JAXLIB_INCLUDE/xla/ffi/api/ffi.h" ]] \
  || die "XLA FFI headers not found: install jaxlib for $PYTHON or set JAXLIB_INCLUDE"
PY_INCLUDES="$("$PYTHON" -m pybind11 --includes 2>/dev/null)" || die "pybind11 not importable by $PYTHON"
FFI_API="$(sed -n 's/^#define XLA_FFI_API_\(MAJOR\|MINOR\) *\([0-9]*\).*/\2/p' "$JAXLIB_INCLUDE/xla/ffi/api/c_api.h" | paste -sd. -)"

# Archs this clang can target.
DO_ARCHS=()
SKIPPED=()
for a in $ARCHS; do
  if [[ "$a" == gfx950 ]] && (( MAJOR < 20 )); then SKIPPED+=("$a"); else DO_ARCHS+=("$a"); fi
done
(( ${#DO_ARCHS[@]} > 0 )) || die "no arch left to compile"

mapfile -t KERNELS < <(find "$ROOT/csrc/kernels" -maxdepth 1 -name '*.cu' 2>/dev/null | sort)
mapfile -t HOST_SRCS < <(find "$ROOT/csrc" \( -name '*.cc' -o -name '*.cu' \) 2>/dev/null | sort)

{
  echo "clang=$CLANG"
  echo "clang_major=$MAJOR"
  echo "clang_version=$("$CLANG" --version | head -1)"
  echo "bundler=$BUNDLER"
  echo "objdump=$OBJDUMP"
  echo "readelf=$READELF"
  echo "cxxfilt=$CXXFILT"
  echo "bitcode=$BC"
  echo "hip_headers=/usr/include/hip ($HIP_VERSION_STR)"
  echo "jaxlib_include=$JAXLIB_INCLUDE"
  echo "ffi_api=$FFI_API"
  echo "archs=${DO_ARCHS[*]}"
  echo "skipped_archs=${SKIPPED[*]:-}"
  echo "kernels=${#KERNELS[@]}"
  echo "host_sources=${#HOST_SRCS[@]}"
} > "$OUT/toolchain.txt"
note "clang $MAJOR ($CLANG), bitcode $BC, HIP headers $HIP_VERSION_STR, FFI API $FFI_API"
note "archs: ${DO_ARCHS[*]}; ${#KERNELS[@]} kernel file(s), ${#HOST_SRCS[@]} host source(s); out: $OUT"
for a in "${SKIPPED[@]:-}"; do
  [[ -n "$a" ]] && echo "hip_compile_check: WARNING: $a SKIPPED: clang $MAJOR < 20 cannot target it" >&2
done

DEFS=(-DJAX_OVERLAP_HIP=1 -D__AMDGCN_WAVEFRONT_SIZE=64
      "-DJAX_OVERLAP_ARCHS=\"$(echo "${DO_ARCHS[*]}" | tr ' ' ',')\""
      "-DJAX_OVERLAP_COMPILER=\"clang $MAJOR (hip_compile_check)\""
      "-DJAX_OVERLAP_FFI_API=\"$FFI_API\"")
# shellcheck disable=SC2206
EXTRA=(${HIP_CHECK_FLAGS:-})
# Device bitcode: ockl + ABI 5 (GPU.md recipe), and hip.bc where present: the ROCm
# 5.x headers implement __syncthreads/__threadfence with __atomic_work_item_fence
# from hip.bc ("undefined hidden symbol: __atomic_work_item_fence" without it).
BCLINK=()
for b in ockl.bc oclc_abi_version_500.bc hip.bc; do
  [[ -f "$BC/$b" ]] && BCLINK+=(-Xclang -mlink-builtin-bitcode -Xclang "$BC/$b")
done
COMMON=(-x hip -std=c++17 -O3 -Werror=switch -I "$ROOT/csrc" -isystem "$JAXLIB_INCLUDE" "${DEFS[@]}" "${EXTRA[@]}")

# ---------------------------------------------------------------- jobs
device_one() {  # device_one SRC ARCH
  local src="$1" arch="$2" name d
  name="$(basename "$src" .cu)"
  d="$OUT/$arch"
  if ! "$CLANG" "${COMMON[@]}" --offload-arch="$arch" --cuda-device-only -nogpulib \
        -mcode-object-version=5 \
        "${BCLINK[@]}" \
        -Rpass-analysis=kernel-resource-usage \
        -c "$src" -o "$d/$name.o" 2> "$d/$name.res.log"; then
    echo "FAIL device $arch ${src#"$ROOT"/}" ; grep -E "error" -A3 "$d/$name.res.log" | head -40
    return 1
  fi
  "$BUNDLER" --unbundle --type=o --input="$d/$name.o" \
    --targets="hipv4-amdgcn-amd-amdhsa--$arch" --output="$d/$name.co" \
    || { echo "FAIL unbundle $arch $name"; return 1; }
  "$OBJDUMP" -d --mcpu="$arch" "$d/$name.co" > "$d/$name.s" \
    || { echo "FAIL objdump $arch $name"; return 1; }
  if [[ -n "$READELF" ]]; then "$READELF" --notes "$d/$name.co" > "$d/$name.notes" 2>&1 || true; fi
  echo "ok   device $arch ${src#"$ROOT"/} ($(grep -c 'Function Name:' "$d/$name.res.log" || true) function(s))"
}

host_one() {  # host_one SRC
  local src="$1" rel log
  rel="${src#"$ROOT"/}"
  log="$OUT/host/$(echo "$rel" | tr '/' '_').log"
  # shellcheck disable=SC2086
  if ! "$CLANG" "${COMMON[@]}" --offload-arch="${DO_ARCHS[0]}" --cuda-host-only -nogpulib \
        -D__HIP_PLATFORM_AMD__ -fPIC $PY_INCLUDES \
        -c "$src" -o "$OUT/host/$(echo "$rel" | tr '/' '_').o" > "$log" 2>&1; then
    echo "FAIL host ${rel}"; grep -E "error" -A3 "$log" | head -40
    return 1
  fi
  echo "ok   host ${rel}"
}

mkdir -p "$OUT/host"
rm -f "$OUT"/host/* "$OUT"/*/*.s "$OUT"/*/*.res.log "$OUT"/*/*.notes "$OUT"/*/*.o "$OUT"/*/*.co 2>/dev/null || true
for a in "${DO_ARCHS[@]}"; do mkdir -p "$OUT/$a"; done

start=$SECONDS
TASKS=()
for k in "${KERNELS[@]}"; do for a in "${DO_ARCHS[@]}"; do TASKS+=("device_one $(printf %q "$k") $a"); done; done
for s in "${HOST_SRCS[@]}"; do TASKS+=("host_one $(printf %q "$s")"); done

fails=0
running=0
for t in "${TASKS[@]}"; do
  if (( running >= JOBS )); then
    wait -n || fails=$((fails + 1))
    running=$((running - 1))
  fi
  eval "$t" &
  running=$((running + 1))
done
while (( running > 0 )); do
  wait -n || fails=$((fails + 1))
  running=$((running - 1))
done

if (( ${#KERNELS[@]} == 0 )); then note "no kernels (csrc/kernels/*.cu): device compile skipped"; fi
note "${#TASKS[@]} compile(s), $fails failed, $((SECONDS - start)) s"
echo "failures=$fails" >> "$OUT/toolchain.txt"
if (( fails > 0 )); then
  echo "hip_compile_check: FAILED ($fails compile error(s)); logs in $OUT" >&2
  exit 1
fi
