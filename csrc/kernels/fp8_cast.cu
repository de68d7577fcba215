// The float8 cast (fp8_cast.h): eight elements per vector, read as 16 bytes
// (two 16-byte loads for float32) and written as one 8-byte word. The pass is
// bound by the loads in flight: each thread issues the loads of kUnroll
// vectors before it converts the first (as the pipelined reduction does,
// pipeline_kernels.cu). Elements past the last whole vector, or every element
// of buffers not aligned for the vectors, go one at a time.
#include <algorithm>
#include <type_traits>

#include "kernels/element_type.h"
#include "kernels/fp8_cast.h"

namespace jo {
namespace {

constexpr int kVec = 8;
constexpr int kUnroll = 4;
constexpr int kThreads = 256;

template <typename T, bool kE5M2>
__device__ __forceinline__ uint64_t cast8(const T (&v)[kVec], float inv) {
  uint64_t packed = 0;
#pragma unroll
  for (int i = 0; i < kVec; i += 2)
    packed |= static_cast<uint64_t>(gpu::to_fp8x2<kE5M2>(gpu::to_float(v[i]) * inv, gpu::to_float(v[i + 1]) * inv))
              << (8 * i);
  return packed;
}

// kVectors: x 16-byte and out 8-byte aligned, vectors over the first count / kVec * kVec elements.
template <typename T, bool kE5M2, bool kVectors>
__global__ void fp8_cast_kernel(const T* __restrict__ x, const float* __restrict__ scale, uint8_t* __restrict__ out,
                                int64_t count) {
  // The reciprocal, then a product per element: XLA's form (numerics.quantize), bit for bit; with a power-of-two
  // scale both are exact.
  const float inv = 1.0f / *scale;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  constexpr int kLoads = kVec * sizeof(T) / 16;  // 16-byte loads per vector
  int64_t done = 0;
  if (kVectors) {
    const int64_t vectors = count / kVec;
    // Thread t takes vectors t + (i * kUnroll + u) * threads: each of its kUnroll loads in a round is a whole
    // warp's contiguous 512 bytes.
    for (int64_t v0 = first; v0 < vectors; v0 += kUnroll * threads) {
      gpu::Vec16 raw[kUnroll][kLoads];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + u * threads;
#pragma unroll
        for (int b = 0; b < kLoads; ++b)
          if (v < vectors) raw[u][b] = gpu::load16(x + v * kVec + b * (16 / sizeof(T)));
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + u * threads;
        if (v >= vectors) break;
        T vals[kVec];
        __builtin_memcpy(vals, raw[u], sizeof(vals));
        reinterpret_cast<uint64_t*>(out)[v] = cast8<T, kE5M2>(vals, inv);
      }
    }
    done = vectors * kVec;
  }
  for (int64_t i = done + first; i < count; i += threads) {
    const float f = gpu::to_float(x[i]) * inv;
    out[i] = static_cast<uint8_t>(gpu::to_fp8x2<kE5M2>(f, f));
  }
}

// fn(bool_constant e5m2) for a float8 format; false for another dtype.
template <class Fn>
bool with_fp8_kind(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF8E4M3FN: fn(std::false_type{}); return true;
    case DType::kF8E4M3FNUZ: fn(std::false_type{}); return true;
    case DType::kF8E5M2: fn(std::true_type{}); return true;
    case DType::kF8E5M2FNUZ: fn(std::true_type{}); return true;
    case DType::kBF16: return false;
    case DType::kF16: return false;
    case DType::kF32: return false;
  }
  return false;
}

}  // namespace

hipError_t launch_fp8_cast(const Fp8Cast& c, int sm_count, hipStream_t stream) {
  hipError_t e = hipErrorInvalidValue;
  const bool vectors = reinterpret_cast<uintptr_t>(c.x) % 16 == 0 && reinterpret_cast<uintptr_t>(c.out) % 8 == 0;
  const int64_t work = vectors ? (c.count / kVec + kUnroll - 1) / kUnroll + c.count % kVec : c.count;
  if (c.count < 0 || sm_count < 1) return e;
  if (c.count == 0) return hipSuccess;
  // At most 8 workgroups per SM (a full SM's threads), each thread looping over its share.
  const int64_t grid = std::min<int64_t>((work + kThreads - 1) / kThreads, 8 * static_cast<int64_t>(sm_count));
  with_value_type(c.x_dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    with_fp8_kind(c.out_dtype, [&](auto e5m2) {
      const auto* x = static_cast<const T*>(c.x);
      auto* out = static_cast<uint8_t*>(c.out);
      if (vectors)
        fp8_cast_kernel<T, decltype(e5m2)::value, true><<<grid, kThreads, 0, stream>>>(x, c.scale, out, c.count);
      else
        fp8_cast_kernel<T, decltype(e5m2)::value, false><<<grid, kThreads, 0, stream>>>(x, c.scale, out, c.count);
      e = hipGetLastError();
    });
  });
  return e;
}

}  // namespace jo
