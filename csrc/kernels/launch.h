// Launch helpers shared by the persistent kernels.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/params.h"
#include "platform/gpu.h"

namespace jo {

// Raises the kernel's dynamic shared-memory limit and returns the largest
// grid that stays co-resident on this rank's share of the GPU: workgroups of
// a persistent kernel wait on each other, so all of them must run at once.
template <class Kernel>
hipError_t co_resident_grid(Kernel kernel, int threads, int smem_bytes, const LaunchLimits& limits, int* grid) {
  const void* fn = reinterpret_cast<const void*>(kernel);
  hipError_t e = hipFuncSetAttribute(fn, hipFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (e != hipSuccess) return e;
  int per_sm = 0;
  e = hipOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, threads, static_cast<size_t>(smem_bytes));
  if (e != hipSuccess) return e;
  *grid = per_sm * limits.sm_count / std::max(limits.ranks_per_gpu, 1);
  return hipSuccess;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace jo
