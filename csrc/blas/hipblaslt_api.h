// The part of AMD's hipBLASLt C API this project calls, declared here because
// neither Debian nor the package registries carry hipBLASLt headers; the
// library is resolved at run time (blas/library.cc). Values and layouts are
// those of hipblaslt.h, hipblas-common.h and hip/library_types.h (hipBLASLt
// 0.6-1.x, ROCm 6 and 7). Compile-checked only: no AMD GPU has run this.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/dtype.h"

namespace jo::blas {

inline constexpr const char* kLibraryName = "hipBLASLt";
// JAX's ROCm plugin loads .so.1 on ROCm 7 and .so.0 on ROCm 6.
inline constexpr const char* kSonames[] = {"libhipblaslt.so.1", "libhipblaslt.so.0"};

using LtStatus = int;  // hipblasStatus_t
inline constexpr LtStatus kSuccess = 0;

// hipDataType / hipblasComputeType_t / hipblasOperation_t; the float8 types as ROCm >= 6.2 numbers them (OCP
// e4m3/e5m2 28 and 29 as CUDA's, gfx942's fnuz formats 1000 and 1001).
inline constexpr int kNoDataType = -1;
inline constexpr int kDataF32 = 0;
inline constexpr int kDataF16 = 2;
inline constexpr int kDataBF16 = 14;
inline constexpr int kDataF8E4M3 = 28;
inline constexpr int kDataF8E5M2 = 29;
inline constexpr int kDataF8E4M3Fnuz = 1000;
inline constexpr int kDataF8E5M2Fnuz = 1001;
inline constexpr int kComputeF32 = 2;
inline constexpr int kOpN = 111;
inline constexpr int kOpT = 112;

// hipblasLtMatmulDescAttributes_t: TRANSA/B int32, EPILOGUE uint32, BIAS_POINTER const void*.
inline constexpr int kDescTransA = 0;
inline constexpr int kDescTransB = 1;
inline constexpr int kDescEpilogue = 2;
inline constexpr int kDescBiasPointer = 3;
// BIAS_DATA_TYPE int32 (hipDataType), A/B_SCALE_POINTER const void* (a device float each). No fast-accumulation
// switch: the MFMA float8 instructions accumulate in fp32.
inline constexpr int kDescBiasDataType = 4;
inline constexpr int kDescAScalePointer = 5;
inline constexpr int kDescBScalePointer = 6;
inline constexpr int kDescFastAccum = -1;
// Newer hipBLASLt releases have SM_COUNT_TARGET; its number is not checked against a header here, so the CU count
// is not passed (GemmProblem::sm_count is ignored on ROCm).
inline constexpr int kDescSmCountTarget = -1;
// float8 block scales (core/block_scales.h) are not built for hipBLASLt: its scale-mode numbers are not checked
// against a header here and no AMD GPU ran them, so plan() refuses block-scaled problems.
inline constexpr int kDescAScaleMode = -1;
inline constexpr int kDescBScaleMode = -1;
inline constexpr int32_t kScaleModeBlk128x128 = -1;
inline constexpr int32_t kScaleModeVec128 = -1;
// hipblasLtEpilogue_t
inline constexpr uint32_t kEpilogueDefault = 1;
inline constexpr uint32_t kEpilogueBias = 4;
// hipblasLtMatrixLayoutAttribute_t: BATCH_COUNT int32, STRIDED_BATCH_OFFSET int64.
inline constexpr int kLayoutBatchCount = 0;
inline constexpr int kLayoutBatchStride = 1;
// hipblasLtMatmulPreferenceAttributes_t: MAX_WORKSPACE_BYTES uint64; no alignment preferences.
inline constexpr int kPrefMaxWorkspaceBytes = 1;
inline constexpr bool kHasAlignmentPreferences = false;
inline constexpr int kPrefMinAlignmentA = -1;

// float8 GEMMs (hipBLASLt's data-type support page): the fnuz formats on gfx942, the OCP ones on gfx950; the
// bias in D's type or float32. Its heuristic finds no algorithm for scaled operands, or for a bias epilogue,
// unless the scale and bias pointers are set first (XLA's ROCm GEMM sets stand-ins too; blas/gemm.cc does on
// both vendors). Which layouts its float8 kernels take is not known here: w is given K-major, as on NVIDIA.
inline constexpr bool kFp8TransposedWOnly = true;
inline bool fp8_bias_type_ok(DType out, DType bias) { return bias == out || bias == DType::kF32; }

// Whether the GPU of architecture `arch` ("gfx942") runs float8 GEMMs of format `t`.
inline bool runs_fp8(DType t, const std::string& arch) {
  if (arch == "gfx942") return t == DType::kF8E4M3FNUZ || t == DType::kF8E5M2FNUZ;
  if (arch == "gfx950") return t == DType::kF8E4M3FN || t == DType::kF8E5M2;
  return false;
}

// hipblasLtMatmulAlgo_t, passed by value.
struct Algo {
  uint8_t data[16];
  size_t max_workspace_bytes;
};

// Optional entry points (the library loads without them): the library's version, for the tuning cache's
// header (blas/tuning.cc). hipblasStatus_t hipblasLtGetVersion(hipblasLtHandle_t, int*).
inline constexpr const char* kVersionSymbol = "hipblasLtGetVersion";
inline int64_t library_version(void* fn, void* handle) {
  int version = 0;
  if (fn == nullptr || reinterpret_cast<LtStatus (*)(void*, int*)>(fn)(handle, &version) != kSuccess) return 0;
  return version;
}

// The entry points blas/api.h's Api holds, in its order.
inline constexpr const char* kApiSymbols[] = {
    "hipblasLtCreate",
    "hipblasLtDestroy",
    "hipblasLtMatmulDescCreate",
    "hipblasLtMatmulDescDestroy",
    "hipblasLtMatmulDescSetAttribute",
    "hipblasLtMatrixLayoutCreate",
    "hipblasLtMatrixLayoutDestroy",
    "hipblasLtMatrixLayoutSetAttribute",
    "hipblasLtMatmulPreferenceCreate",
    "hipblasLtMatmulPreferenceDestroy",
    "hipblasLtMatmulPreferenceSetAttribute",
    "hipblasLtMatmulAlgoGetHeuristic",
    "hipblasLtMatmul",
};

}  // namespace jo::blas
