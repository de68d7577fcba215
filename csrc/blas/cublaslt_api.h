// The part of NVIDIA's cuBLASLt C API this project calls, declared here so the
// build needs no cuBLASLt headers or libraries: the library is resolved at run
// time (blas/library.cc). Values and layouts are those of cublasLt.h /
// cublas_api.h / library_types.h (CUDA 12 and 13 agree on all of them);
// blas/abi_check.cc compares them with the real headers in every build that
// finds those (the GPU machine's CUDA toolkit has them).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/dtype.h"

namespace jo::blas {

inline constexpr const char* kLibraryName = "cuBLASLt";
// JAX's CUDA plugin loads the first (nvidia-cublas wheel, CUDA 13); the second
// serves a CUDA 12 installation.
inline constexpr const char* kSonames[] = {"libcublasLt.so.13", "libcublasLt.so.12"};

using LtStatus = int;  // cublasStatus_t
inline constexpr LtStatus kSuccess = 0;

// cudaDataType_t / cublasComputeType_t / cublasOperation_t. No type is gfx942's float8 (fnuz) formats.
inline constexpr int kNoDataType = -1;
inline constexpr int kDataF32 = 0;
inline constexpr int kDataF16 = 2;
inline constexpr int kDataBF16 = 14;
inline constexpr int kDataF8E4M3 = 28;
inline constexpr int kDataF8E5M2 = 29;
inline constexpr int kDataF8E4M3Fnuz = kNoDataType;
inline constexpr int kDataF8E5M2Fnuz = kNoDataType;
inline constexpr int kComputeF32 = 68;
inline constexpr int kOpN = 0;
inline constexpr int kOpT = 1;

// cublasLtMatmulDescAttributes_t: TRANSA/B int32, EPILOGUE uint32, BIAS_POINTER const void*.
inline constexpr int kDescTransA = 3;
inline constexpr int kDescTransB = 4;
inline constexpr int kDescEpilogue = 7;
inline constexpr int kDescBiasPointer = 8;
// A/B_SCALE_POINTER const void* (a device float each), FAST_ACCUM int8, BIAS_DATA_TYPE int32 (cudaDataType_t).
inline constexpr int kDescAScalePointer = 17;
inline constexpr int kDescBScalePointer = 18;
inline constexpr int kDescFastAccum = 25;
inline constexpr int kDescBiasDataType = 26;
// SM_COUNT_TARGET int32: the SMs the kernel is sized for (0: the device's).
inline constexpr int kDescSmCountTarget = 15;
// A/B_SCALE_MODE int32 (cublasLtMatmulMatrixScale_t): float8 block scales (core/block_scales.h), w (A) per
// 128 x 128 block (BLK128x128_32F), x (B) per 1 x 128 block of a row (VEC128_32F); cuBLAS 12.9 and later, sm_90.
inline constexpr int kDescAScaleMode = 31;
inline constexpr int kDescBScaleMode = 32;
inline constexpr int32_t kScaleModeBlk128x128 = 5;
inline constexpr int32_t kScaleModeVec128 = 4;
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

// float8 GEMMs (cuBLAS's cublasLtMatmul, "FP8" type table; Ada and Hopper):
// - the formats float8_e4m3fn and float8_e5m2, not both e5m2, on sm_89 and later;
// - A transposed and B not ("TN"): w K-major ([n, k]) in this project's view, where A is w and B is x;
// - the bias in D's type for a 16-bit D (bfloat16 for a float32 D, which this project does not use): never
//   float32 (torch._scaled_mm has the same rules);
// - fast accumulation off (FAST_ACCUM 0): the accumulator is promoted to full fp32 as the K loop goes, as
//   torch._scaled_mm does by default (use_fast_accum=False).
inline constexpr bool kFp8TransposedWOnly = true;
inline bool fp8_bias_type_ok(DType out, DType bias) { return bias == out && out != DType::kF32; }

// Whether the GPU of architecture `arch` ("sm_90") runs float8 GEMMs of format `t`.
inline bool runs_fp8(DType t, const std::string& arch) {
  if (t != DType::kF8E4M3FN && t != DType::kF8E5M2) return false;
  if (arch.rfind("sm_", 0) != 0 || arch.size() == 3) return false;
  int version = 0;  // major * 10 + minor, as gpu::arch_name spells it
  for (size_t i = 3; i < arch.size(); ++i) {
    if (arch[i] < '0' || arch[i] > '9') return false;
    version = version * 10 + (arch[i] - '0');
  }
  return version >= 89;
}

// cublasLtMatmulAlgo_t, passed by value.
struct Algo {
  uint64_t data[8];
};

// Optional entry points (the library loads without them): the library's version, for the tuning cache's
// header (blas/tuning.cc). size_t cublasLtGetVersion(void).
inline constexpr const char* kVersionSymbol = "cublasLtGetVersion";
inline int64_t library_version(void* fn, void* /*handle*/) {
  return fn != nullptr ? static_cast<int64_t>(reinterpret_cast<size_t (*)()>(fn)()) : 0;
}

// The entry points blas/api.h's Api holds, in its order.
inline constexpr const char* kApiSymbols[] = {
    "cublasLtCreate",
    "cublasLtDestroy",
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
