// Order in which a persistent kernel walks the output tiles of one GEMM: in
// bands of `group_cols` tile columns, all rows of a band before the next, so
// the band's columns of w (group_cols * BN * K elements, sized by the host to
// half the L2) stay in L2 while every row of A streams past them.
#pragma once

#include <cstdint>

#include "platform/gpu.h"

namespace jo::gemm {

struct TileCoord {
  int row;
  int col;
};

JO_HOST_DEVICE TileCoord tile_coord(int t, int row_tiles, int col_tiles, int group_cols) {
  const int band = t / (row_tiles * group_cols);
  const int first_col = band * group_cols;
  const int cols = col_tiles - first_col < group_cols ? col_tiles - first_col : group_cols;
  const int within = t - band * row_tiles * group_cols;
  return TileCoord{within / cols, first_col + within % cols};
}

// Tile columns per band: as many as keep their slice of w within half the L2.
inline int band_columns(int col_tiles, int bn, int64_t k, int elem_bytes, int64_t l2_bytes) {
  const int64_t per_col = static_cast<int64_t>(bn) * k * elem_bytes;
  int64_t cols = per_col > 0 ? (l2_bytes / 2) / per_col : col_tiles;
  if (cols < 1) cols = 1;
  return cols > col_tiles ? col_tiles : static_cast<int>(cols);
}

// Against wave quantization, a persistent plain GEMM (gemm_tile.h plain_gemm)
// may end in a "stream-K" tail: tiles [0, dp_tiles) run whole, one per
// workgroup at a time, and the k-tiles of the remaining ones (the last full
// wave plus the partial one) are split into one contiguous range per
// workgroup. Each range is at least a tile long, so a tile is cut between at
// most two workgroups, w and w + 1: w + 1 computes the tile's tail first thing
// and publishes fp32 partial sums in its slot; w computes the head last thing,
// adds that slot to its own sums (always in this order: bitwise reproducible)
// and stores the tile. Scratch: `slots` flags, then `slots` partial tiles;
// slots >= the grid.
//
// The scratch is an XLA buffer holding whatever an earlier user left in it,
// and nothing clears it before the launch (a memset node measured 4-5 us of
// GPU idle per chained call). A flag is set when it holds kPartialReady, a
// 64-bit pattern that leftover data holds only by accident, and the one
// workgroup that waits on it clears it as it sees it: every flag a launch sets
// is cleared again within that launch, so the next launch handed the same
// scratch (after this one, in stream or graph order) finds none set. A
// per-launch tag is not an option: %gridid repeats across replays of a CUDA
// graph (benchmarks/results/NOTES.md). Waits are on co-resident workgroups of
// the same launch, whose tails are published before anything they wait for:
// a wait past timeout_ticks is a bug, and traps.
//
// Compiled for NVIDIA only: on gfx942/gfx950 the tail's code put the 256x128
// tile's accumulators in scratch memory (tools/check_isa.py), so AMD runs
// whole tiles (its tiles take plain_gemm's tile-by-tile path) and reports no
// tail scratch (tail_scratch_bytes == 0).
#if JO_PLATFORM_HIP
inline constexpr bool kTailSplitCompiled = false;
#else
inline constexpr bool kTailSplitCompiled = true;
#endif

inline constexpr uint64_t kPartialReady = 0x8F3C5D2A71E94B06ull;

struct TailSplit {
  int dp_tiles;            // == the tile count: no tail split
  uint64_t* flags;         // [slots]: slot w's partial is ready when it holds kPartialReady
  float* partials;         // [slots][tile elements]
  uint64_t timeout_ticks;  // gpu::timer_ticks
};

inline uint64_t tail_flags_bytes(int slots) { return (static_cast<uint64_t>(slots) * 8 + 15) / 16 * 16; }

inline uint64_t tail_scratch_bytes(int slots, int tile_elems) {
  return kTailSplitCompiled && slots > 0 ? tail_flags_bytes(slots) + static_cast<uint64_t>(slots) * tile_elems * 4
                                         : 0;
}

// The split of `tiles` tiles over `grid` workgroups, or none (scratch absent
// or too small, or no partial wave to even out).
inline TailSplit tail_split(int tiles, int grid, int tile_elems, void* scratch, int slots, uint64_t timeout_ticks) {
  if (!kTailSplitCompiled || scratch == nullptr || slots < grid || tiles <= grid || tiles % grid == 0)
    return {tiles, nullptr, nullptr, 0};
  char* base = static_cast<char*>(scratch);
  return {(tiles / grid - 1) * grid, reinterpret_cast<uint64_t*>(base),
          reinterpret_cast<float*>(base + tail_flags_bytes(slots)), timeout_ticks};
}

}  // namespace jo::gemm
