// Fused GEMM + reduce-scatter: out = psum_scatter(x @ w, axis -2) (+ bias),
// launched as one persistent kernel of GEMM and reducer workgroups.
#pragma once

#include <cstdint>

#include "kernels/params.h"
#include "platform/gpu.h"

namespace jo {

struct MatmulRsLaunch {
  DType dtype;
  int tile;
  bool w_kmajor;
  const void* x;     // [batch, m_total, k]
  const void* w;
  const void* bias;  // [n] or nullptr, added once after the reduction
  void* out;         // [batch, m_total / world, n]
  int64_t batch, m_total, k, n;
  Peers peers;
  uint32_t epoch;
  int workers;  // reducer workgroups (world > 1)
  Watchdog wd;
  TraceSink trace;
  LaunchLimits limits;
};

uint64_t matmul_rs_region_bytes(int world, int64_t batch, int64_t m_total, int64_t n, int tile, int elem_bytes);

hipError_t launch_matmul_rs(const MatmulRsLaunch& launch, hipStream_t stream);

}  // namespace jo
