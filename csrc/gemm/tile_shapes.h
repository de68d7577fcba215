// The block tiles compiled into the kernels, by index (the `tile` field of a
// fused call's config). The large tile is 8 warps of 64x64 with pipelined
// fragments. On NVIDIA it is 128x256x64, 3 stages: in benchmarks/gemm_engine on
// the H200 (2026-11-29, 16384x3584x8192) it runs 2.04 ms, inside the fused
// kernels too; 4 stages measured the same (2.04) or slower (spill reloads in
// the k-loop); 256x128 moved between 2.29 and 2.67 ms with the loader's
// register use. On AMD it is 256x128x64 (fragments not pipelined
// there, gpu.h), which passes the no-scratch ISA check that 128x256 does not.
// 128x128x32, 4 warps, gives small row counts more workgroups and fits a
// 64 KiB LDS (gfx942).
#pragma once

#include "gemm/tile_engine.h"
#include "kernels/params.h"

namespace jo::gemm {

//                       BM   BN   BK  WARPS_M WARPS_N STAGES PIPELINE_FRAGS
#if JO_PLATFORM_HIP
using TileShape0 = TileShape<256, 128, 64, 4, 2, 3, true>;
#else
using TileShape0 = TileShape<128, 256, 64, 2, 4, 3, true>;
#endif
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
