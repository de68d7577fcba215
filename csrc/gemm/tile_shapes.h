// The block tiles compiled into the kernels, by index (the `tile` field of a
// fused call's config). From benchmarks/gemm_engine on the H200 (2026-11-29,
// 16384x3584x8192): 8-warp tiles led, 128x256x64 with pipelined fragments at
// 434 TFLOP/s and 256x128x64 at 422-424 either way; the fused kernels take
// 256x128x64 unpipelined, the only one of them that neither spills on sm_90
// next to the fused kernels' protocol state nor on gfx942 (ISA check).
// 128x128x32, 4 warps, gives small row counts more workgroups.
#pragma once

#include "gemm/tile_engine.h"
#include "kernels/params.h"

namespace jo::gemm {

//                       BM   BN   BK  WARPS_M WARPS_N STAGES PIPELINE_FRAGS
using TileShape0 = TileShape<256, 128, 64, 4, 2, 3, true>;
using TileShape1 = TileShape<128, 128, 32, 2, 2, 4, false>;

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
