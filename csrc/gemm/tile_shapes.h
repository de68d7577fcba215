// The block tiles compiled into the kernels, by index (the `tile` field of a
// fused call's config). From benchmarks/gemm_engine on the H200 (2026-11-29,
// 16384x3584x8192): 8-warp tiles with pipelined fragments led (128x256x64 at
// 420-434 TFLOP/s, 256x128x64 at 420-445 with w in either layout). Inside the
// fused kernels 256x128x64 pipelined measured 2.92 ms against 3.22 ms
// unpipelined; on gfx942 pipelining is off (gpu.h) and the shape passes the
// no-scratch ISA check, which 128x256 does not. 128x128x32, 4 warps, gives
// small row counts more workgroups.
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
