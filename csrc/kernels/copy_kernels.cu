#include "kernels/copy_kernels.h"

#include <algorithm>

namespace jo {
namespace {

// The copy kernel runs beside the chunk GEMMs on the SMs they would use, so it
// takes few: 16 workgroups of 512 threads, each thread with 4 16-byte loads in
// flight before its stores, hold 512 KiB in flight, about a microsecond of a
// peer link's bytes at a few hundred GB/s (the latency a pull must cover).
// Its rate is what time_copy measures on the chosen path, so the cost model
// plans with it (benchmarks/bench_copy_split.py times it beside the engines).
constexpr int kCopyWorkgroups = 16;
constexpr int kCopyThreads = 512;
constexpr int kCopyUnroll = 4;

struct Copy2D {
  char* dst;
  const char* src;
  uint64_t dst_pitch, src_pitch, width, height;
};

// Every address, pitch and the width a multiple of 16. Full rounds of
// kCopyUnroll vectors per thread issue all their loads before any store; the
// rest goes one vector at a time (no conditional loads into the round's
// registers, which the AMDGPU backend would keep in scratch memory).
__global__ void __launch_bounds__(kCopyThreads) copy_2d_vec_kernel(Copy2D c) {
  const uint64_t vecs = c.width / 16;
  const uint64_t threads = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const uint64_t first = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (uint64_t row = 0; row < c.height; ++row) {
    const char* src = c.src + row * c.src_pitch;
    char* dst = c.dst + row * c.dst_pitch;
    uint64_t v = first;
    for (; v + (kCopyUnroll - 1) * threads < vecs; v += kCopyUnroll * threads) {
      gpu::Vec16 r[kCopyUnroll];
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) r[u] = gpu::load16_uncached(src + (v + u * threads) * 16);
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) gpu::store16(dst + (v + u * threads) * 16, r[u]);
    }
    for (; v < vecs; v += threads) gpu::store16(dst + v * 16, gpu::load16_uncached(src + v * 16));
  }
}

// Any alignment: one byte at a time (no copy of the schedule takes this; it keeps the kernel a copy of
// anything the copy engines would take).
__global__ void __launch_bounds__(kCopyThreads) copy_2d_byte_kernel(Copy2D c) {
  const uint64_t threads = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const uint64_t first = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (uint64_t row = 0; row < c.height; ++row)
    for (uint64_t i = first; i < c.width; i += threads) c.dst[row * c.dst_pitch + i] = c.src[row * c.src_pitch + i];
}

// A hash of (seed, word index), odd (so that it never equals a poison word).
__device__ __forceinline__ uint32_t pattern_word(uint32_t seed, uint64_t index) {
  uint32_t h = static_cast<uint32_t>(index) * 0x9E3779B1u ^ static_cast<uint32_t>(index >> 32) ^
               (seed * 0x85EBCA6Bu + 0x27D4EB2Fu);  // murmur3 finalizer below
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h | 1u;
}

__global__ void fill_pattern_kernel(uint32_t* area, uint64_t words, uint32_t seed) {
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < words; i += step)
    area[i] = pattern_word(seed, i);
}

__global__ void check_pattern_kernel(PatternCheck c, uint32_t* wrong_words) {
  constexpr uint32_t kPoisonWord = 0x01010101u * kPatternPoison;
  const uint32_t* dst = static_cast<const uint32_t*>(c.dst);
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  uint32_t wrong = 0;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < c.span / 4; i += step) {
    const uint64_t row = i * 4 / c.dst_pitch, col = i * 4 % c.dst_pitch;
    const bool copied = row < c.height && col < c.width;
    const uint32_t want = copied ? pattern_word(c.seed, (c.src_offset + row * c.src_pitch + col) / 4) : kPoisonWord;
    wrong += dst[i] != want ? 1u : 0u;
  }
  if (wrong != 0) gpu::atomic_add_dev(wrong_words, wrong);
}

int grid_for(uint64_t items, int threads, int most) {
  return static_cast<int>(std::clamp<uint64_t>((items + threads - 1) / threads, 1, static_cast<uint64_t>(most)));
}

}  // namespace

hipError_t launch_copy_2d(void* dst, uint64_t dst_pitch, const void* src, uint64_t src_pitch, uint64_t width,
                          uint64_t height, hipStream_t stream) {
  if (width == 0 || height == 0) return hipSuccess;
  const Copy2D c{static_cast<char*>(dst), static_cast<const char*>(src), dst_pitch, src_pitch, width, height};
  const uintptr_t bits = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                         (height > 1 ? dst_pitch | src_pitch : 0) | width;
  // The grid covers one row (each thread then takes the rows in turn): the schedule's rows are batch
  // elements, few and long.
  if (bits % 16 == 0) {
    const uint64_t rounds = (width / 16 + kCopyUnroll - 1) / kCopyUnroll;
    copy_2d_vec_kernel<<<grid_for(rounds, kCopyThreads, kCopyWorkgroups), kCopyThreads, 0, stream>>>(c);
  } else {
    copy_2d_byte_kernel<<<grid_for(width, kCopyThreads, kCopyWorkgroups), kCopyThreads, 0, stream>>>(c);
  }
  return hipGetLastError();
}

hipError_t launch_fill_pattern(void* area, uint64_t bytes, uint32_t seed, hipStream_t stream) {
  constexpr int kThreads = 256;
  fill_pattern_kernel<<<grid_for(bytes / 4, kThreads, 64), kThreads, 0, stream>>>(static_cast<uint32_t*>(area),
                                                                                  bytes / 4, seed);
  return hipGetLastError();
}

hipError_t launch_check_pattern(const PatternCheck& check, uint32_t* wrong_words, hipStream_t stream) {
  constexpr int kThreads = 256;
  if (check.dst_pitch == 0) return hipErrorInvalidValue;
  check_pattern_kernel<<<grid_for(check.span / 4, kThreads, 64), kThreads, 0, stream>>>(check, wrong_words);
  return hipGetLastError();
}

}  // namespace jo
