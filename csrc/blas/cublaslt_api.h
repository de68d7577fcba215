// The part of NVIDIA's cuBLASLt C API this project calls, declared here so the
// build needs no cuBLASLt headers or libraries: the library is resolved at run
// time (blas/library.cc). Values and layouts are those of cublasLt.h /
// cublas_api.h / library_types.h (CUDA 12 and 13 agree on all of them);
// blas/abi_check.cc compares them with the real headers in every build that
// finds those (the GPU machine's CUDA toolkit has them).
#pragma once

#include <cstddef>
#include <cstdint>

namespace jo::blas {

inline constexpr const char* kLibraryName = "cuBLASLt";
// JAX's CUDA plugin loads the first (nvidia-cublas wheel, CUDA 13); the second
// serves a CUDA 12 installation.
inline constexpr const char* kSonames[] = {"libcublasLt.so.13", "libcublasLt.so.12"};

using LtStatus = int;  // cublasStatus_t
inline constexpr LtStatus kSuccess = 0;

// cudaDataType_t / cublasComputeType_t / cublasOperation_t
inline constexpr int kDataF32 = 0;
inline constexpr int kDataF16 = 2;
inline constexpr int kDataBF16 = 14;
inline constexpr int kComputeF32 = 68;
inline constexpr int kOpN = 0;
inline constexpr int kOpT = 1;

// cublasLtMatmulDescAttributes_t: TRANSA/B int32, EPILOGUE uint32, BIAS_POINTER const void*.
inline constexpr int kDescTransA = 3;
inline constexpr int kDescTransB = 4;
inline constexpr int kDescEpilogue = 7;
inline constexpr int kDescBiasPointer = 8;
// cublasLtEpilogue_t
inline constexpr uint32_t kEpilogueDefault = 1;
inline constexpr uint32_t kEpilogueBias = 4;
// cublasLtMatrixLayoutAttribute_t: BATCH_COUNT int32, STRIDED_BATCH_OFFSET int64.
inline constexpr int kLayoutBatchCount = 5;
inline constexpr int kLayoutBatchStride = 6;
// cublasLtMatmulPreferenceAttributes_t: MAX_WORKSPACE_BYTES uint64, MIN_ALIGNMENT_*_BYTES uint32.
inline constexpr int kPrefMaxWorkspaceBytes = 1;
inline constexpr bool kHasAlignmentPreferences = true;
inline constexpr int kPrefMinAlignmentA = 5;  // then B, C, D: 6, 7, 8

// cublasLtMatmulAlgo_t, passed by value.
struct Algo {
  uint64_t data[8];
};

// The entry points blas/api.h's Api holds, in its order.
inline constexpr const char* kApiSymbols[] = {
    "cublasLtCreate",
    "cublasLtMatmulDescCreate",
    "cublasLtMatmulDescDestroy",
    "cublasLtMatmulDescSetAttribute",
    "cublasLtMatrixLayoutCreate",
    "cublasLtMatrixLayoutDestroy",
    "cublasLtMatrixLayoutSetAttribute",
    "cublasLtMatmulPreferenceCreate",
    "cublasLtMatmulPreferenceDestroy",
    "cublasLtMatmulPreferenceSetAttribute",
    "cublasLtMatmulAlgoGetHeuristic",
    "cublasLtMatmul",
};

}  // namespace jo::blas
