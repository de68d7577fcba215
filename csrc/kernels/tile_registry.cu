// The tile registry (see tile_registry.h), read from the compiled tile list.
#include "kernels/tile_registry.h"

#include "gemm/tile_scheduler.h"
#include "gemm/tile_shapes.h"
#include "platform/gpu.h"

namespace jo {

bool tile_shape_info(int index, TileShapeInfo* info) {
  return gemm::with_tile_config(index, [&](auto config) {
    using Config = decltype(config);
    using ML = gemm::MainloopOf<gpu::bf16, Config, gemm::BLayout::kNMajor>;
    *info = TileShapeInfo{ML::BM, ML::BN, ML::BK, ML::kThreads, ML::kSmemBytes, ML::kStreamK, Config::Arch::kName};
  });
}

int tile_shape_count() { return gemm::kTileCount; }

uint64_t tail_scratch_bytes(int tile, int slots) {
  TileShapeInfo info{};
  if (!tile_shape_info(tile, &info) || !info.stream_k) return 0;
  return gemm::tail_scratch_bytes(slots, info.bm * info.bn);
}

}  // namespace jo
