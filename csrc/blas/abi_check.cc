// Compile-time check of blas/cublaslt_api.h against NVIDIA's own headers, in
// every build that finds them (the GPU machine's CUDA toolkit has them; CI's
// does not, and this file is then empty). A mismatch fails the build.
#include "platform/gpu.h"

#if JO_PLATFORM_CUDA && __has_include(<cublasLt.h>)
#include <cublasLt.h>

#include <cstddef>

#include "blas/api.h"

namespace jo::blas {

static_assert(kSuccess == CUBLAS_STATUS_SUCCESS);
static_assert(kDataF32 == CUDA_R_32F && kDataF16 == CUDA_R_16F && kDataBF16 == CUDA_R_16BF);
static_assert(kDataF8E4M3 == CUDA_R_8F_E4M3 && kDataF8E5M2 == CUDA_R_8F_E5M2);
static_assert(kComputeF32 == CUBLAS_COMPUTE_32F && kOpN == CUBLAS_OP_N && kOpT == CUBLAS_OP_T);
static_assert(kDescTransA == CUBLASLT_MATMUL_DESC_TRANSA && kDescTransB == CUBLASLT_MATMUL_DESC_TRANSB);
static_assert(kDescEpilogue == CUBLASLT_MATMUL_DESC_EPILOGUE && kDescBiasPointer == CUBLASLT_MATMUL_DESC_BIAS_POINTER);
static_assert(kEpilogueDefault == CUBLASLT_EPILOGUE_DEFAULT && kEpilogueBias == CUBLASLT_EPILOGUE_BIAS);
static_assert(kDescAScalePointer == CUBLASLT_MATMUL_DESC_A_SCALE_POINTER &&
              kDescBScalePointer == CUBLASLT_MATMUL_DESC_B_SCALE_POINTER);
static_assert(kDescFastAccum == CUBLASLT_MATMUL_DESC_FAST_ACCUM &&
              kDescBiasDataType == CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE);
static_assert(kDescSmCountTarget == CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET);
#if CUBLAS_VERSION >= 120900  // the block scale modes came with cuBLAS 12.9
static_assert(kDescAScaleMode == CUBLASLT_MATMUL_DESC_A_SCALE_MODE &&
              kDescBScaleMode == CUBLASLT_MATMUL_DESC_B_SCALE_MODE);
static_assert(kScaleModeBlk128x128 == CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F &&
              kScaleModeVec128 == CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F);
#endif
static_assert(kLayoutBatchCount == CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT);
static_assert(kLayoutBatchStride == CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET);
static_assert(kPrefMaxWorkspaceBytes == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES);
static_assert(kPrefMinAlignmentA == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES &&
              kPrefMinAlignmentA + 3 == CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES);
static_assert(sizeof(Algo) == sizeof(cublasLtMatmulAlgo_t));
static_assert(sizeof(HeuristicResult) == sizeof(cublasLtMatmulHeuristicResult_t));
static_assert(offsetof(HeuristicResult, workspace_size) == offsetof(cublasLtMatmulHeuristicResult_t, workspaceSize));
static_assert(offsetof(HeuristicResult, state) == offsetof(cublasLtMatmulHeuristicResult_t, state));

// Each entry point's parameter list, with the opaque pointer types and enums
// spelled as the real header spells them.
static_assert(sizeof(&cublasLtMatmul) == sizeof(Api::matmul));
using RealMatmul = cublasStatus_t (*)(cublasLtHandle_t, cublasLtMatmulDesc_t, const void*, const void*,
                                      cublasLtMatrixLayout_t, const void*, cublasLtMatrixLayout_t, const void*,
                                      const void*, cublasLtMatrixLayout_t, void*, cublasLtMatrixLayout_t,
                                      const cublasLtMatmulAlgo_t*, void*, size_t, cudaStream_t);
static_assert(std::is_same_v<decltype(&cublasLtMatmul), RealMatmul>);

}  // namespace jo::blas

#endif
