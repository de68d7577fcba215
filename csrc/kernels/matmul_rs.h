// Fused GEMM + reduce-scatter: out = psum_scatter(x @ w, axis -2) (+ bias),
// launched as one persistent kernel of GEMM and reducer workgroups.
#pragma once

#include <cstdint>

#include "kernels/params.h"
#include "platform/gpu.h"

namespace jo {

struct MatmulRsLaunch {
  GemmOperands op;  // x [batch, m_total, k]; bias added once after the reduction; comm_workgroups: reducers
  void* out;        // [batch, m_total / world, n]
  int64_t m_total;
  CallContext ctx;
  TailScratch tail{};  // group of one only
};

uint64_t matmul_rs_region_bytes(int world, int64_t batch, int64_t m_total, int64_t n, int tile, int elem_bytes);

// The launch launch_matmul_rs makes of `launch` (its pointers unused), with
// per_sm workgroups per SM, or the kernel's occupancy on the current device
// when per_sm == 0 (kernels/launch.h gemm_geometry).
hipError_t matmul_rs_geometry(const MatmulRsLaunch& launch, int per_sm, GemmGeometry* geometry);

hipError_t launch_matmul_rs(const MatmulRsLaunch& launch, hipStream_t stream);

}  // namespace jo
