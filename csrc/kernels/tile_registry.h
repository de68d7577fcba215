// The block tiles compiled into the GEMM kernels (gemm/tile_shapes.h), as the
// host and Python see them, by index (the `tile` field of a fused call).
#pragma once

#include <cstdint>

namespace jo {

struct TileShapeInfo {
  int bm, bn, bk, threads, smem_bytes;
  bool stream_k;     // its group-of-one kernels can end in the stream-K tail (gemm/tile_scheduler.h)
  const char* arch;  // the ArchTraits it runs: "nvidia" or "amd" (gemm/arch_traits.h)
};
// False when no tile shape has this index.
bool tile_shape_info(int index, TileShapeInfo* info);
// Tile indices are 0 .. tile_shape_count() - 1.
int tile_shape_count();

// Bytes of a group-of-one call's tail scratch with `slots` workgroup slots
// for tile shape `tile` (gemm/tile_scheduler.h tail_scratch_bytes; both ops).
uint64_t tail_scratch_bytes(int tile, int slots);

}  // namespace jo
