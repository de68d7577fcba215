// The block tiles compiled into the kernels, by index (the `tile` field of a
// fused call's config). Chosen from benchmarks/gemm_engine on the H200:
// 128x128x64 (4 warps, 2 workgroups per SM) led at the large shapes, and
// 128x128x32 (4 stages) at odd shapes.
#pragma once

#include "gemm/tile_engine.h"
#include "kernels/params.h"

namespace jo::gemm {

//                       BM   BN   BK  WARPS_M WARPS_N STAGES
using TileShape0 = TileShape<128, 128, 64, 2, 2, 3>;
using TileShape1 = TileShape<128, 128, 32, 2, 2, 4>;

// Calls fn(ShapeType{}) for the shape with this index; false if none.
template <class Fn>
bool with_tile_shape(int index, Fn&& fn) {
  switch (index) {
    case 0: fn(TileShape0{}); return true;
    case 1: fn(TileShape1{}); return true;
  }
  return false;
}

static_assert(kTileShapeCount == 2, "kernels/params.h counts the shapes listed here");

}  // namespace jo::gemm
