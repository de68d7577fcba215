// The part of AMD's hipBLASLt C API this project calls, declared here because
// neither Debian nor the package registries carry hipBLASLt headers; the
// library is resolved at run time (blas/library.cc). Values and layouts are
// those of hipblaslt.h, hipblas-common.h and hip/library_types.h (hipBLASLt
// 0.6-1.x, ROCm 6 and 7). Compile-checked only: no AMD GPU has run this.
#pragma once

#include <cstddef>
#include <cstdint>

namespace jo::blas {

inline constexpr const char* kLibraryName = "hipBLASLt";
// JAX's ROCm plugin loads .so.1 on ROCm 7 and .so.0 on ROCm 6.
inline constexpr const char* kSonames[] = {"libhipblaslt.so.1", "libhipblaslt.so.0"};

using LtStatus = int;  // hipblasStatus_t
inline constexpr LtStatus kSuccess = 0;

// hipDataType / hipblasComputeType_t / hipblasOperation_t
inline constexpr int kDataF32 = 0;
inline constexpr int kDataF16 = 2;
inline constexpr int kDataBF16 = 14;
inline constexpr int kComputeF32 = 2;
inline constexpr int kOpN = 111;
inline constexpr int kOpT = 112;

// hipblasLtMatmulDescAttributes_t: TRANSA/B int32, EPILOGUE uint32, BIAS_POINTER const void*.
inline constexpr int kDescTransA = 0;
inline constexpr int kDescTransB = 1;
inline constexpr int kDescEpilogue = 2;
inline constexpr int kDescBiasPointer = 3;
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

// hipblasLtMatmulAlgo_t, passed by value.
struct Algo {
  uint8_t data[16];
  size_t max_workspace_bytes;
};

// The entry points blas/api.h's Api holds, in its order.
inline constexpr const char* kApiSymbols[] = {
    "hipblasLtCreate",
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
