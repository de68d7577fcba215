// Launch helpers shared by the persistent kernels.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "gemm/tile_order.h"
#include "kernels/params.h"
#include "platform/gpu.h"

namespace jo {

// The largest grid that stays co-resident on this rank's share of the GPU:
// workgroups of a persistent kernel wait on each other, so all of them must
// run at once. The kernel's shared-memory limit and occupancy are set up once
// per device (they cost microseconds; this is on every call's path).
// kKernel is a template argument so that every kernel has its own cache.
template <auto kKernel>
hipError_t co_resident_grid(int threads, int smem_bytes, const LaunchLimits& limits, int* grid) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> blocks_per_sm[kMaxDevices];  // 0: not queried yet on that device
  int device = 0;
  hipError_t e = hipGetDevice(&device);
  if (e != hipSuccess) return e;
  int per_sm = device < kMaxDevices ? blocks_per_sm[device].load(std::memory_order_relaxed) : 0;
  if (per_sm == 0) {
    const void* fn = reinterpret_cast<const void*>(kKernel);
    e = hipFuncSetAttribute(fn, hipFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (e != hipSuccess) return e;
    e = hipOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, threads, static_cast<size_t>(smem_bytes));
    if (e != hipSuccess) return e;
    if (device < kMaxDevices) blocks_per_sm[device].store(per_sm, std::memory_order_relaxed);
  }
  *grid = per_sm * limits.sm_count / std::max(limits.ranks_per_gpu, 1);
  return hipSuccess;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Grid of a persistent GEMM kernel with `workers` mover workgroups in front
// of one GEMM workgroup per output tile at most, and its tile-band width
// (gemm/tile_order.h) from this rank's share of the L2.
template <auto kKernel, class Eng>
hipError_t gemm_grid(const LaunchLimits& limits, int workers, int64_t tiles, int64_t n, int64_t k, int* grid,
                     int* group_cols) {
  int cap = 0;
  const hipError_t e = co_resident_grid<kKernel>(Eng::kThreads, Eng::kSmemBytes, limits, &cap);
  if (e != hipSuccess) return e;
  *grid = static_cast<int>(std::min<int64_t>(cap, workers + tiles));
  if (*grid <= workers) return hipErrorInvalidValue;
  *group_cols = gemm::band_columns(static_cast<int>(ceil_div(n, Eng::BN)), Eng::BN, k, sizeof(typename Eng::Elem),
                                   limits.l2_bytes / std::max(limits.ranks_per_gpu, 1));
  return hipSuccess;
}

// The stream-K tail of a group-of-one launch of `grid` workgroups.
template <class Eng>
gemm::TailSplit tail_split(const TailScratch& scratch, int64_t tiles, int grid) {
  return gemm::tail_split(static_cast<int>(tiles), grid, Eng::BM * Eng::BN, scratch.data, scratch.slots,
                          scratch.timeout_ticks);
}

}  // namespace jo
