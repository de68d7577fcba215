// Fused all-gather + GEMM: y = all_gather(x, axis -2) @ w (+ bias), launched
// as one persistent kernel of fetcher and GEMM workgroups.
#pragma once

#include <cstdint>

#include "kernels/params.h"
#include "kernels/tile_registry.h"
#include "platform/gpu.h"

namespace jo {

struct AgMatmulLaunch {
  GemmOperands op;  // x [batch * m, k]; comm_workgroups: fetchers
  void* y;          // [batch, world * m, n]
  void* gathered;   // [batch, world * m, k]; unused when world == 1
  int64_t m;
  int chunk_k;  // K columns per ready flag, a multiple of the tile's BK
  CallContext ctx;
  TailScratch tail{};  // group of one only (tile_registry.h tail_scratch_bytes)
};

// Bytes of the symmetric region a call of this shape needs (0 when world == 1).
uint64_t ag_matmul_region_bytes(int world, int64_t rows, int64_t k, int tile, int chunk_k, int elem_bytes);

// The launch launch_ag_matmul makes of `launch` (its pointers unused), with
// per_sm workgroups per SM, or the kernel's occupancy on the current device
// when per_sm == 0 (kernels/launch.h gemm_geometry). region_bytes needs a
// chunk_k (0 without one).
hipError_t ag_matmul_geometry(const AgMatmulLaunch& launch, int per_sm, GemmGeometry* geometry);

hipError_t launch_ag_matmul(const AgMatmulLaunch& launch, hipStream_t stream);

}  // namespace jo
