// Epilogue stores: kVec fp32 accumulators -> kVec consecutive elements of T in
// one store (4 bytes for a pair of 16-bit values).
#pragma once

#include "platform/gpu.h"

namespace jo::gemm {

template <typename T, int kVec>
struct alignas(kVec * sizeof(T)) PackedT {
  T v[kVec];
};

// dst[i] = v[i] + bias[i], converted to T.
template <typename T, int kVec>
__device__ __forceinline__ void store_vec(T* dst, const float* v, const float* bias) {
  PackedT<T, kVec> out;
#pragma unroll
  for (int i = 0; i < kVec; ++i) out.v[i] = gpu::from_float<T>(v[i] + bias[i]);
  *reinterpret_cast<PackedT<T, kVec>*>(dst) = out;
}

}  // namespace jo::gemm
