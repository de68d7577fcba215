// Fused all-gather + GEMM: y = all_gather(x, axis -2) @ w (+ bias), launched
// as one persistent kernel of fetcher and GEMM workgroups.
#pragma once

#include <cstdint>

#include "kernels/params.h"
#include "platform/gpu.h"

namespace jo {

struct AgMatmulLaunch {
  DType dtype;
  int tile;       // index into gemm/tile_shapes.h
  bool w_kmajor;  // w is [n, k] instead of [k, n]
  const void* x;     // [batch * m, k]
  const void* w;
  const void* bias;  // [n] or nullptr
  void* y;           // [batch, world * m, n]
  void* gathered;    // [batch, world * m, k]; unused when world == 1
  int64_t batch, m, k, n;
  Peers peers;
  uint32_t epoch;
  int workers;  // fetcher workgroups (world > 1)
  int chunk_k;  // K columns per ready flag, a multiple of the tile's BK
  Watchdog wd;
  TraceSink trace;
  LaunchLimits limits;
};

// Bytes of the symmetric region a call of this shape needs (0 when world == 1).
uint64_t ag_matmul_region_bytes(int world, int64_t rows, int64_t k, int tile, int chunk_k, int elem_bytes);

hipError_t launch_ag_matmul(const AgMatmulLaunch& launch, hipStream_t stream);

}  // namespace jo
