// The float8 cast (fp8_cast.h): eight elements per vector, read as 16 bytes
// (two 16-byte loads for float32) and written as one 8-byte word. The pass is
// bound by the loads in flight: each thread issues the loads of kUnroll<T>
// vectors before it converts the first. A workgroup casts kUnroll<T> * kThreads
// consecutive vectors once and exits (no loop): that ran at memcpy's rate,
// where a grid-stride loop ran about 10% slower (its last round leaves SMs
// idle; docs/performance.md).
// Elements past the last whole vector, or every element of buffers not
// aligned for the vectors, go one at a time in a strided loop.
//
// The amax variant (kAmax) keeps each thread's max |x| as the bits of a
// non-negative float, whose unsigned order is the floats' order with every NaN
// above infinity (so a NaN wins, as in XLA's max); a workgroup reduces its
// threads' (warp-wide, then its warps' in shared memory) and adds one atomic
// max to *amax, which the launch zeroed first on the same stream.
//
// The transposing variant (Fp8Cast::rows) works on tiles of 128 x 128 elements
// of x: each thread loads 8 vectors along x's rows, casts them into a shared
// tile of float8 bytes, then writes 16 of out's bytes (16 rows of x) to each of 4
// of out's rows, from 4 x 4 byte transposes of the tile's words. The tile's word
// columns are XOR-swizzled by the 16-row group, so that a warp's reads of those
// words (8 groups x 4 columns) fall in 32 different banks.
#include <algorithm>
#include <type_traits>

#include "kernels/element_type.h"
#include "kernels/fp8_cast.h"

namespace jo {
namespace {

constexpr int kVec = 8;
constexpr int kThreads = 256;

// Vectors per thread of the cast: 8 (memcpy's rate for bfloat16); 4 for float16, whose variant with amax ptxas 13.0
// compiles at 8 with a register spill.
template <typename T>
constexpr int kUnroll = std::is_same<T, gpu::fp16>::value ? 4 : 8;

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

// Element i of a vector as a float: of an array of kVec elements (the flat cast's form: read out of the loaded
// words, its bfloat16 variant with amax took 16 more registers and ran 10% slower), or of the vector as loaded
// (the transposing kernel's form).
template <typename T>
__device__ __forceinline__ float element(const T (&v)[kVec], int i) {
  return gpu::to_float(v[i]);
}
template <typename T, int kLoads>
__device__ __forceinline__ float element(const gpu::Vec16 (&raw)[kLoads], int i) {
  T v;
  __builtin_memcpy(&v, reinterpret_cast<const char*>(raw) + i * sizeof(T), sizeof(T));
  return gpu::to_float(v);
}

// The cast of a vector (either form of element()), and with kAmax the max of its elements' abs_bits into
// *amax_bits.
template <typename T, bool kE5M2, bool kAmax, class Vector>
__device__ __forceinline__ uint64_t cast8(const Vector& v, float inv, float limit, uint32_t* amax_bits) {
  uint64_t packed = 0;
#pragma unroll
  for (int i = 0; i < kVec; i += 2) {
    const float lo = element<T>(v, i), hi = element<T>(v, i + 1);
    if (kAmax) *amax_bits = umax(*amax_bits, umax(abs_bits(lo), abs_bits(hi)));
    packed |= static_cast<uint64_t>(gpu::to_fp8x2<kE5M2>(saturated<kAmax>(lo * inv, limit),
                                                          saturated<kAmax>(hi * inv, limit)))
              << (8 * i);
  }
  return packed;
}

// The workgroup's max of `bits` into *amax: one atomic per workgroup, at the end of its short life. Every thread
// of the workgroup calls it.
__device__ __forceinline__ void reduce_amax(uint32_t bits, float* amax) {
  bits = gpu::workgroup_max<kThreads>(bits);
  if (threadIdx.x == 0) gpu::atomic_max_dev(reinterpret_cast<uint32_t*>(amax), bits);
}

// kVectors: x 16-byte and out 8-byte aligned; workgroup b casts vectors [b, b + 1) * kUnroll<T> * kThreads (of the
// first count / kVec * kVec elements), and the grid's first threads the elements past them. Otherwise every
// element, in a loop strided by the grid.
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
    // Thread t of workgroup b: vectors b * kUnroll<T> * kThreads + u * kThreads + t, each load a whole warp's
    // contiguous 512 bytes.
    const int64_t v0 = static_cast<int64_t>(blockIdx.x) * kUnroll<T> * kThreads + threadIdx.x;
    gpu::Vec16 raw[kUnroll<T>][kLoads];
#pragma unroll
    for (int u = 0; u < kUnroll<T>; ++u) {
      const int64_t v = v0 + u * kThreads;
#pragma unroll
      for (int b = 0; b < kLoads; ++b)
        if (v < vectors) raw[u][b] = gpu::load16(x + v * kVec + b * (16 / sizeof(T)));
    }
#pragma unroll
    for (int u = 0; u < kUnroll<T>; ++u) {
      const int64_t v = v0 + u * kThreads;
      if (v >= vectors) break;
      T vals[kVec];
      __builtin_memcpy(vals, raw[u], sizeof(vals));
      reinterpret_cast<uint64_t*>(out)[v] = cast8<T, kE5M2, kAmax>(vals, inv, limit, &amax_bits);
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

constexpr int kTile = 128;                           // the transposing variant's tile: kTile x kTile of x
constexpr int kTileWords = kTile / 4;                // float8 words per tile row
constexpr int kGroups = kTile / 16;                  // 16-row groups of a tile: out's 16-byte stores per row
constexpr int kTileVectors = kTile * kTile / kVec / kThreads;  // vectors each thread loads
static_assert(kGroups * kTileWords == kThreads, "a thread per (16-row group, 4 columns)");

// The word column where the tile keeps x's column word `word` of row `row`.
__device__ __forceinline__ int swizzled(int word, int row) { return word ^ ((row / 16) % 8) * 4; }

// out's 4 words of column c (c = 0..3) from 4 words of rows r = 0..3 (word r, byte c: x[r][c]) -> word c, byte r.
__device__ __forceinline__ void transpose4x4(const uint32_t (&rows)[4], uint32_t (&cols)[4]) {
  const uint32_t lo01 = __byte_perm(rows[0], rows[1], 0x5140), hi01 = __byte_perm(rows[0], rows[1], 0x7362);
  const uint32_t lo23 = __byte_perm(rows[2], rows[3], 0x5140), hi23 = __byte_perm(rows[2], rows[3], 0x7362);
  cols[0] = __byte_perm(lo01, lo23, 0x5410);
  cols[1] = __byte_perm(lo01, lo23, 0x7632);
  cols[2] = __byte_perm(hi01, hi23, 0x5410);
  cols[3] = __byte_perm(hi01, hi23, 0x7632);
}

// x [rows, cols] -> out [cols, rows], saturated, with the amax; a workgroup per tile (blockIdx.x along the columns).
// rows % 16 == 0 and cols % kVec == 0 (launch_fp8_cast checks): a 16-byte store and a vector are wholly in or out.
// Two instantiations split the grid: the whole tiles (kEdge false) load unchecked, with registers capped for four
// workgroups per SM (two for float32, whose vectors take twice the registers): 14% faster than uncapped, near the
// flat cast's time (docs/performance.md). The tiles x's edges cut (kEdge) check each
// vector and take the registers that needs. Each exits at once on the other's tiles.
template <typename T, bool kE5M2, bool kEdge>
__global__ void __launch_bounds__(kThreads, kEdge ? 1 : (sizeof(T) == 4 ? 2 : 4))
    fp8_cast_transposed_kernel(const T* __restrict__ x, const float* __restrict__ scale, uint8_t* __restrict__ out,
                               int64_t rows, int64_t cols, float* __restrict__ amax, float limit) {
  __shared__ uint32_t tile[kTile * kTileWords];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile, c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  if ((r0 + kTile > rows || c0 + kTile > cols) != kEdge) return;  // the whole workgroup: no barrier skipped
  const float inv = 1.0f / *scale;
  constexpr int kLoads = kVec * sizeof(T) / 16;
  constexpr int kRowVectors = kTile / kVec;            // a tile row's vectors
  constexpr int kRowStep = kThreads / kRowVectors;     // tile rows between a thread's vectors
  // Thread t: column c of the tile, rows row + i * kRowStep (i < kTileVectors).
  const int row = threadIdx.x / kRowVectors, c = threadIdx.x % kRowVectors * kVec;
  const T* src = x + (r0 + row) * cols + c0 + c;
  // The thread's vectors inside x: those of its first rows_left rows (none where its column is outside).
  const int64_t rows_left = c0 + c < cols ? rows - r0 - row : 0;
  gpu::Vec16 raw[kTileVectors][kLoads];
#pragma unroll
  for (int i = 0; i < kTileVectors; ++i) {  // every load in flight before the first cast
#pragma unroll
    for (int b = 0; b < kLoads; ++b) {
      const T* at = src + i * kRowStep * cols + b * (16 / sizeof(T));
      if (!kEdge) {
        raw[i][b] = gpu::load16(at);
      } else {
        raw[i][b] = gpu::Vec16{{0u, 0u, 0u, 0u}};
        if (i * kRowStep < rows_left) raw[i][b] = gpu::load16(at);
      }
    }
  }
  uint32_t amax_bits = 0;  // zeros outside x leave it as it is
#pragma unroll
  for (int i = 0; i < kTileVectors; ++i) {
    const int r = row + i * kRowStep;
    const uint64_t packed = cast8<T, kE5M2, true>(raw[i], inv, limit, &amax_bits);
    *reinterpret_cast<uint64_t*>(&tile[r * kTileWords + swizzled(c / 4, r)]) = packed;  // the pair stays adjacent
  }
  __syncthreads();
  const int group = threadIdx.x % kGroups, col4 = threadIdx.x / kGroups;  // x rows 16 * group.., columns 4 * col4..
  uint32_t words[4][4];  // words[j][g]: out row 4 * col4 + j, bytes 4 * g.. of the group's 16
#pragma unroll
  for (int g = 0; g < 4; ++g) {
    uint32_t in[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int tile_row = group * 16 + g * 4 + r;
      in[r] = tile[tile_row * kTileWords + swizzled(col4, tile_row)];
    }
    uint32_t transposed[4];
    transpose4x4(in, transposed);
#pragma unroll
    for (int j = 0; j < 4; ++j) words[j][g] = transposed[j];
  }
  if (r0 + group * 16 < rows) {
    uint8_t* dst = out + (c0 + col4 * 4) * rows + r0 + group * 16;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const gpu::Vec16 v{{words[j][0], words[j][1], words[j][2], words[j][3]}};
      if (c0 + col4 * 4 + j < cols) gpu::store16(dst + j * rows, v);
    }
  }
  reduce_amax(amax_bits, amax);
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

const char* transposed_cast_declined(int64_t rows, int64_t cols) {
  if (rows % 16 != 0) return "its rows (the dims moved last) must be a multiple of 16";
  if (cols % kVec != 0) return "its columns (the dims moved first) must be a multiple of 8";
  if ((rows + kTile - 1) / kTile > 65535) return "its rows must be at most 128 * 65535";
  return nullptr;
}

hipError_t launch_fp8_cast(const Fp8Cast& c, int sm_count, hipStream_t stream) {
  hipError_t e = hipErrorInvalidValue;
  if (c.rows != 0) {
    if (c.amax == nullptr || c.rows < 0 || c.count % c.rows != 0 ||
        transposed_cast_declined(c.rows, c.count / c.rows) != nullptr ||
        reinterpret_cast<uintptr_t>(c.x) % 16 != 0 || reinterpret_cast<uintptr_t>(c.out) % 16 != 0)
      return e;
  }
  const bool vectors = reinterpret_cast<uintptr_t>(c.x) % 16 == 0 && reinterpret_cast<uintptr_t>(c.out) % 8 == 0;
  if (c.count < 0 || sm_count < 1) return e;
  if (c.amax != nullptr && !c.amax_zeroed) {
    const hipError_t zeroed = hipMemsetAsync(c.amax, 0, sizeof(float), stream);
    if (zeroed != hipSuccess) return zeroed;
  }
  if (c.count == 0) return hipSuccess;
  const float limit = fp8_max_finite(c.out_dtype);
  with_value_type(c.x_dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    // Vectors: a workgroup per kUnroll<T> * kThreads of them (at least one, for the elements past them). Else at
    // most 8 workgroups per SM (a full SM's threads), each thread looping over its share.
    constexpr int64_t kPerWorkgroup = kUnroll<T> * kThreads;
    const int64_t grid =
        vectors ? std::max<int64_t>((c.count / kVec + kPerWorkgroup - 1) / kPerWorkgroup, 1)
                : std::min<int64_t>((c.count + kThreads - 1) / kThreads, 8 * static_cast<int64_t>(sm_count));
    with_fp8_kind(c.out_dtype, [&](auto e5m2) {
      constexpr bool kE5M2 = decltype(e5m2)::value;
      const auto* x = static_cast<const T*>(c.x);
      auto* out = static_cast<uint8_t*>(c.out);
      const auto launch = [&](auto kernel) {
        kernel<<<grid, kThreads, 0, stream>>>(x, c.scale, out, c.count, c.amax, limit);
        e = hipGetLastError();
      };
      if (c.rows != 0) {
        const int64_t cols = c.count / c.rows;
        const dim3 tiles(static_cast<unsigned>((cols + kTile - 1) / kTile),
                         static_cast<unsigned>((c.rows + kTile - 1) / kTile));
        fp8_cast_transposed_kernel<T, kE5M2, false><<<tiles, kThreads, 0, stream>>>(x, c.scale, out, c.rows, cols,
                                                                                    c.amax, limit);
        e = hipGetLastError();
        if (e == hipSuccess && (c.rows % kTile != 0 || cols % kTile != 0)) {
          fp8_cast_transposed_kernel<T, kE5M2, true><<<tiles, kThreads, 0, stream>>>(x, c.scale, out, c.rows, cols,
                                                                                     c.amax, limit);
          e = hipGetLastError();
        }
      } else if (c.amax != nullptr)
        vectors ? launch(fp8_cast_kernel<T, kE5M2, true, true>) : launch(fp8_cast_kernel<T, kE5M2, false, true>);
      else
        vectors ? launch(fp8_cast_kernel<T, kE5M2, true, false>) : launch(fp8_cast_kernel<T, kE5M2, false, false>);
    });
  });
  return e;
}

}  // namespace jo
