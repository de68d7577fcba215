// Host side of the sm90 GEMM's TMA copies: the tensor map of a row-major
// [rows, cols] matrix (cols contiguous) in boxes of box_rows x box_bytes with
// the swizzle of that width (64 or 128 bytes). The operands are read in boxes
// of 128 bytes per row, the 128-byte swizzle the wgmma descriptors expect;
// loads fill out-of-range elements (the M, N and K tails) with zeros, stores
// skip them.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

namespace jo::gemm::sm90 {

// cuTensorMapEncodeTiled through the runtime's driver entry point, so that the
// benchmark and the library need not link libcuda.
using TensorMapEncoder = decltype(&cuTensorMapEncodeTiled);

inline TensorMapEncoder tensor_map_encoder() {
  static TensorMapEncoder fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      p = nullptr;
    return reinterpret_cast<TensorMapEncoder>(p);
  }();
  return fn;
}

// Returns 0, or writes why not to `err` (the argument, what was expected and
// what was given) and returns -1.
inline int make_tensor_map_2d(CUtensorMap* map, const void* base, CUtensorMapDataType dtype, int elem_bytes,
                              int64_t rows, int64_t cols, int box_rows, int box_bytes, const char* what, char* err,
                              size_t err_len) {
  if ((cols * elem_bytes) % 16 != 0) {
    std::snprintf(err, err_len,
                  "sm90 gemm: the contiguous dimension of %s must span a multiple of 16 bytes for TMA, got %lld "
                  "elements of %d bytes",
                  what, static_cast<long long>(cols), elem_bytes);
    return -1;
  }
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0) {
    std::snprintf(err, err_len, "sm90 gemm: %s must be 16-byte aligned for TMA, got %p", what, base);
    return -1;
  }
  auto encode = tensor_map_encoder();
  if (encode == nullptr) {
    std::snprintf(err, err_len, "sm90 gemm: the driver has no cuTensorMapEncodeTiled (needs CUDA 12 or later)");
    return -1;
  }
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols * elem_bytes)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_bytes / elem_bytes), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUtensorMapSwizzle swizzle = box_bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
  const CUresult r = encode(map, dtype, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::snprintf(err, err_len, "sm90 gemm: cuTensorMapEncodeTiled failed (%d) for %s [%lld, %lld], box %d x %d bytes",
                  r, what, static_cast<long long>(rows), static_cast<long long>(cols), box_rows, box_bytes);
    return -1;
  }
  return 0;
}

}  // namespace jo::gemm::sm90
