// The float8 cast (fp8_cast.h): eight elements per vector, read as 16 bytes
// (two 16-byte loads for float32) and written as one 8-byte word. The pass is
// bound by the loads in flight: each thread issues the loads of kUnroll
// vectors before it converts the first (as the pipelined reduction does,
// pipeline_kernels.cu). Elements past the last whole vector, or every element
// of buffers not aligned for the vectors, go one at a time.
//
// The amax variant (kAmax) keeps each thread's max |x| as the bits of a
// non-negative float, whose unsigned order is the floats' order with every NaN
// above infinity (so a NaN wins, as in XLA's max); a workgroup reduces its
// threads' in shared memory and adds one atomic max to *amax, which the launch
// zeroed first on the same stream.
#include <algorithm>
#include <type_traits>

#include "kernels/element_type.h"
#include "kernels/fp8_cast.h"

namespace jo {
namespace {

constexpr int kVec = 8;
constexpr int kUnroll = 4;
constexpr int kThreads = 256;

// |v| as the bits of a float: the sign bit cleared (a NaN stays a NaN).
__device__ __forceinline__ uint32_t abs_bits(float v) {
  uint32_t bits;
  __builtin_memcpy(&bits, &v, sizeof(bits));
  return bits & 0x7fffffffu;
}

__device__ __forceinline__ uint32_t umax(uint32_t a, uint32_t b) { return a > b ? a : b; }

// v within [-limit, limit] (kSaturate; a NaN fails both comparisons and stays NaN), v itself otherwise.
template <bool kSaturate>
__device__ __forceinline__ float saturated(float v, float limit) {
  if (!kSaturate) return v;
  return v > limit ? limit : (v < -limit ? -limit : v);
}

// The cast of a vector, and with kAmax the max of its elements' abs_bits into *amax_bits.
template <typename T, bool kE5M2, bool kAmax>
__device__ __forceinline__ uint64_t cast8(const T (&v)[kVec], float inv, float limit, uint32_t* amax_bits) {
  uint64_t packed = 0;
#pragma unroll
  for (int i = 0; i < kVec; i += 2) {
    const float lo = gpu::to_float(v[i]), hi = gpu::to_float(v[i + 1]);
    if (kAmax) *amax_bits = umax(*amax_bits, umax(abs_bits(lo), abs_bits(hi)));
    packed |= static_cast<uint64_t>(gpu::to_fp8x2<kE5M2>(saturated<kAmax>(lo * inv, limit),
                                                          saturated<kAmax>(hi * inv, limit)))
              << (8 * i);
  }
  return packed;
}

// The workgroup's max of `bits` into *amax (one atomic per workgroup). Every thread of the workgroup calls it.
__device__ __forceinline__ void reduce_amax(uint32_t bits, float* amax) {
  __shared__ uint32_t partial[kThreads];
  partial[threadIdx.x] = bits;
  __syncthreads();
#pragma unroll
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] = umax(partial[threadIdx.x], partial[threadIdx.x + stride]);
    __syncthreads();
  }
  if (threadIdx.x == 0) gpu::atomic_max_dev(reinterpret_cast<uint32_t*>(amax), partial[0]);
}

// kVectors: x 16-byte and out 8-byte aligned, vectors over the first count / kVec * kVec elements.
template <typename T, bool kE5M2, bool kVectors, bool kAmax>
__global__ void __launch_bounds__(kThreads)
    fp8_cast_kernel(const T* __restrict__ x, const float* __restrict__ scale, uint8_t* __restrict__ out,
                    int64_t count, float* __restrict__ amax, float limit) {
  // The reciprocal, then a product per element, rounded once to the format: numerics.quantize's form, exactly
  // rounded (XLA's own conversion has been seen one step off at scales that are not powers of two).
  const float inv = 1.0f / *scale;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  constexpr int kLoads = kVec * sizeof(T) / 16;  // 16-byte loads per vector
  uint32_t amax_bits = 0;
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
        reinterpret_cast<uint64_t*>(out)[v] = cast8<T, kE5M2, kAmax>(vals, inv, limit, &amax_bits);
      }
    }
    done = vectors * kVec;
  }
  for (int64_t i = done + first; i < count; i += threads) {
    const float v = gpu::to_float(x[i]);
    if (kAmax) amax_bits = umax(amax_bits, abs_bits(v));
    const float f = saturated<kAmax>(v * inv, limit);
    out[i] = static_cast<uint8_t>(gpu::to_fp8x2<kE5M2>(f, f));
  }
  if (kAmax) reduce_amax(amax_bits, amax);
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

// The largest finite value of a float8 format (jnp.finfo(dtype).max); 0 for another dtype.
float fp8_max_finite(DType dtype) {
  switch (dtype) {
    case DType::kF8E4M3FN: return 448.0f;
    case DType::kF8E4M3FNUZ: return 240.0f;
    case DType::kF8E5M2: return 57344.0f;
    case DType::kF8E5M2FNUZ: return 57344.0f;
    case DType::kBF16: return 0.0f;
    case DType::kF16: return 0.0f;
    case DType::kF32: return 0.0f;
  }
  return 0.0f;
}

}  // namespace

hipError_t launch_fp8_cast(const Fp8Cast& c, int sm_count, hipStream_t stream) {
  hipError_t e = hipErrorInvalidValue;
  const bool vectors = reinterpret_cast<uintptr_t>(c.x) % 16 == 0 && reinterpret_cast<uintptr_t>(c.out) % 8 == 0;
  const int64_t work = vectors ? (c.count / kVec + kUnroll - 1) / kUnroll + c.count % kVec : c.count;
  if (c.count < 0 || sm_count < 1) return e;
  if (c.amax != nullptr) {
    const hipError_t zeroed = hipMemsetAsync(c.amax, 0, sizeof(float), stream);
    if (zeroed != hipSuccess) return zeroed;
  }
  if (c.count == 0) return hipSuccess;
  // At most 8 workgroups per SM (a full SM's threads), each thread looping over its share.
  const int64_t grid = std::min<int64_t>((work + kThreads - 1) / kThreads, 8 * static_cast<int64_t>(sm_count));
  const float limit = fp8_max_finite(c.out_dtype);
  with_value_type(c.x_dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    with_fp8_kind(c.out_dtype, [&](auto e5m2) {
      constexpr bool kE5M2 = decltype(e5m2)::value;
      const auto* x = static_cast<const T*>(c.x);
      auto* out = static_cast<uint8_t*>(c.out);
      const auto launch = [&](auto kernel) {
        kernel<<<grid, kThreads, 0, stream>>>(x, c.scale, out, c.count, c.amax, limit);
        e = hipGetLastError();
      };
      if (c.amax != nullptr)
        vectors ? launch(fp8_cast_kernel<T, kE5M2, true, true>) : launch(fp8_cast_kernel<T, kE5M2, false, true>);
      else
        vectors ? launch(fp8_cast_kernel<T, kE5M2, true, false>) : launch(fp8_cast_kernel<T, kE5M2, false, false>);
    });
  });
  return e;
}

}  // namespace jo
