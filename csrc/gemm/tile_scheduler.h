// Tile schedulers: which units of output (whole tiles, or a range of one
// tile's k-tiles) a persistent GEMM workgroup computes, and in what order.
// Each has next(work), false when the workgroup is done; a scheduler with
// kHasFixup also has fixup(acc, work), run between the mainloop and the
// epilogue, that merges a tile's pieces computed by different workgroups (the
// shape CUTLASS gave its stream-K schedulers). Tile coordinates come from the
// band order (gemm/tile_order.h).
#pragma once

#include <cstdint>

#include "gemm/tile_order.h"
#include "platform/gpu.h"

namespace jo::gemm {

// ---------------------------------------------------------------------------
// The world's groups of tiles: `groups` GEMMs of row_tiles x col_tiles tiles
// each (ag_matmul: one per shard of the gathered rows; matmul_rs: one per
// rank's row block), units first, first + stride, ... of all groups' tiles,
// group by group from first_group on.
// ---------------------------------------------------------------------------
struct GroupWork {
  int unit;        // index in the walk (first, first + stride, ...)
  int group;       // shard or row block
  TileCoord coord;  // tile within the group, band order
};

struct GroupScheduler {
  static constexpr bool kHasFixup = false;
  int unit;  // the last unit handed out (first - stride before the first)
  int stride;
  int first_group;
  int groups;
  int row_tiles;
  int col_tiles;
  int group_cols;

  JO_DEVICE int per_group() const { return row_tiles * col_tiles; }
  // Advancing before the test, not after handing a unit out, keeps one live
  // counter in the loop (as a plain for loop has).
  JO_DEVICE bool next(GroupWork& w) {
    unit += stride;
    if (unit >= per_group() * groups) return false;
    w.unit = unit;
    w.group = (first_group + unit / per_group()) % groups;
    w.coord = tile_coord(unit % per_group(), row_tiles, col_tiles, group_cols);
    return true;
  }
};

// ag_matmul: shards in arrival order, the own shard first (read straight from
// x, nothing to wait for), then rank + 1, rank + 2, ... so that the ranks read
// different peers at a time.
JO_DEVICE GroupScheduler shard_ordered(int gemm_index, int gemm_workgroups, int rank, int world, int row_tiles,
                                       int col_tiles, int group_cols) {
  return GroupScheduler{gemm_index - gemm_workgroups, gemm_workgroups, rank, world, row_tiles, col_tiles, group_cols};
}

// matmul_rs: row blocks rank + 1, rank + 2, ..., rank: the own block last, so
// that its peers' blocks are staged early and their owners start reducing.
JO_DEVICE GroupScheduler block_ordered(int gemm_index, int gemm_workgroups, int rank, int world, int row_tiles,
                                       int col_tiles, int group_cols) {
  return GroupScheduler{gemm_index - gemm_workgroups, gemm_workgroups, rank + 1, world, row_tiles, col_tiles,
                        group_cols};
}

// ---------------------------------------------------------------------------
// A group of one, whole tiles: tiles first, first + stride, ... in band order.
// ---------------------------------------------------------------------------
struct BandScheduler {
  static constexpr bool kHasFixup = false;
  int tile;  // the last tile handed out (first - stride before the first)
  int stride;
  int tiles;

  JO_DEVICE static BandScheduler starting_at(int first, int stride, int tiles) {
    return BandScheduler{first - stride, stride, tiles};
  }
  JO_DEVICE bool next(int& t) {
    tile += stride;
    t = tile;
    return tile < tiles;
  }
};

// ---------------------------------------------------------------------------
// A group of one with a stream-K tail. Against wave quantization, tiles
// [0, dp_tiles) run whole, one per workgroup at a time, and the k-tiles of
// the remaining ones (the last full wave plus the partial one) are split into
// one contiguous range per workgroup. Each range is at least a tile long, so a
// tile is cut between at most two workgroups, w and w + 1: w + 1 computes the
// tile's tail first thing and publishes fp32 partial sums in its scratch slot;
// w computes the head last thing, adds that slot to its own sums (always in
// this order: bitwise reproducible) and stores the tile. Scratch: `slots`
// flags, then `slots` partial tiles, one slot per workgroup (slots >= grid).
//
// The scratch is an XLA buffer holding whatever an earlier user left in it,
// and nothing clears it before the launch (a memset node cost 4-5 us of GPU
// idle per chained call). A flag is set when it holds kPartialReady, a 64-bit
// pattern leftover data holds only by accident, and the one workgroup that
// waits on it clears it as it sees it: every flag a launch sets is cleared
// within that launch, so the next launch on the same scratch finds none set.
// A per-launch tag is no option: %gridid repeats across replays of a CUDA
// graph (docs/performance.md). Waits are on co-resident workgroups of the
// same launch, whose tails are published before anything they wait for: a
// wait past timeout_ticks is a bug (or a GPU shared past co-residency). It is
// not a trap, which would end the process's GPU context: on_stall reports it,
// the call's output is poisoned and the runtime refuses further calls on this
// GPU (the late tail may still set its flag in this scratch).
//
// Only where ArchTraits::kStreamK (NVIDIA) and Mainloop::kStreamK.
// ---------------------------------------------------------------------------
inline constexpr uint64_t kPartialReady = 0x8F3C5D2A71E94B06ull;

struct TailSplit {
  int dp_tiles;            // == the tile count: no tail
  uint64_t* flags;         // [slots]: slot w's partial is ready when it holds kPartialReady
  float* partials;         // [slots][tile elements]
  uint64_t timeout_ticks;  // gpu::timer_ticks
};

inline uint64_t tail_flags_bytes(int slots) { return (static_cast<uint64_t>(slots) * 8 + 15) / 16 * 16; }

inline uint64_t tail_scratch_bytes(int slots, int tile_elems) {
  return slots > 0 ? tail_flags_bytes(slots) + static_cast<uint64_t>(slots) * tile_elems * 4 : 0;
}

// The split of `tiles` tiles over `grid` workgroups, or none (no scratch, too
// few slots, or no partial wave to even out).
inline TailSplit tail_split(int tiles, int grid, void* scratch, int slots, uint64_t timeout_ticks) {
  if (scratch == nullptr || slots < grid || tiles <= grid || tiles % grid == 0) return {tiles, nullptr, nullptr, 0};
  char* base = static_cast<char*>(scratch);
  return {(tiles / grid - 1) * grid, reinterpret_cast<uint64_t*>(base),
          reinterpret_cast<float*>(base + tail_flags_bytes(slots)), timeout_ticks};
}

// A unit of a stream-K walk: output tile `tile` over k-tiles [kb, ke). Whole
// tiles have kb == 0 and ke == the k-tile count.
struct TileRange {
  int tile;
  int kb;
  int ke;
};

template <class ML>
struct StreamKScheduler {
  static constexpr bool kHasFixup = true;
  static constexpr int kVecs = ML::MI * ML::NI;  // 16-byte accumulator groups per thread

  const TailSplit& split;
  int slot;    // this workgroup's index: its scratch slot
  int stride;  // the grid
  int k_tiles;
  int whole;   // next whole tile
  int64_t sk;  // this workgroup's range [sk, sk_end) of the tail's k-tiles (empty without a tail)
  int64_t sk_end;

  JO_DEVICE StreamKScheduler(const TailSplit& s, int first, int grid, int tiles, int k_tiles_per_tile)
      : split(s), slot(first), stride(grid), k_tiles(k_tiles_per_tile), whole(first) {
    const int64_t tail_k_tiles = static_cast<int64_t>(tiles - split.dp_tiles) * k_tiles;
    sk = tail_k_tiles * first / stride;
    sk_end = tail_k_tiles * (first + 1) / stride;
  }

  JO_DEVICE bool next(TileRange& u) {
    if (whole < split.dp_tiles) {
      u = TileRange{whole, 0, k_tiles};
      whole += stride;
      return true;
    }
    if (!ML::kStreamK || sk >= sk_end) return false;
    const int kb = static_cast<int>(sk % k_tiles);
    u = TileRange{split.dp_tiles + static_cast<int>(sk / k_tiles), kb,
                  sk_end - sk < k_tiles - kb ? kb + static_cast<int>(sk_end - sk) : k_tiles};
    sk += u.ke - u.kb;
    return true;
  }

  // Publishes the partial sums of a tile's tail (then false: nothing to
  // store), or adds the tail's published sums to its head (then true); true
  // for whole tiles. A head whose tail is not published within timeout_ticks
  // calls on_stall(waited_ticks) once (thread 0) and adds whatever the slot
  // holds: the stall's record makes the call poison its output (a NaN fill
  // here costs the 128x256 tile ~600 bytes more of spills).
  template <class OnStall>
  JO_DEVICE bool fixup(typename ML::Acc& acc, const TileRange& u, OnStall&& on_stall) {
    if constexpr (ML::kStreamK) {
      if (u.kb > 0) {
        // Slot `slot`, laid out so that a warp's stores are contiguous.
        gpu::Vec16* dst = reinterpret_cast<gpu::Vec16*>(split.partials + int64_t(slot) * ML::BM * ML::BN);
#pragma unroll
        for (int q = 0; q < kVecs; ++q) {
          gpu::Vec16 v;
          __builtin_memcpy(&v, acc.c[q / ML::NI][q % ML::NI].r, sizeof(v));
          gpu::store16(&dst[q * ML::kThreads + threadIdx.x], v);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
          __threadfence();
          gpu::store_release_dev(&split.flags[slot], kPartialReady);
        }
        return false;
      }
      if (u.ke < k_tiles) {
        // The head, this workgroup's last unit: workgroup slot + 1 computed
        // the tail as its first. Nothing else reads the flag, and the next
        // launch starts after this one ends: it is cleared as soon as seen.
        if (threadIdx.x == 0) {
          const uint64_t w0 = gpu::timer_ticks();
          while (gpu::load_acquire_dev(&split.flags[slot + 1]) != kPartialReady) {
            const uint64_t waited = gpu::timer_ticks() - w0;
            if (waited > split.timeout_ticks) {
              on_stall(waited);
              break;
            }
            gpu::backoff();
          }
          split.flags[slot + 1] = 0;
        }
        __syncthreads();
        const gpu::Vec16* src =
            reinterpret_cast<const gpu::Vec16*>(split.partials + int64_t(slot + 1) * ML::BM * ML::BN);
#pragma unroll
        for (int q = 0; q < kVecs; ++q) {
          const gpu::Vec16 v = gpu::load16_uncached(&src[q * ML::kThreads + threadIdx.x]);
          float tail[4];
          __builtin_memcpy(tail, &v, sizeof(tail));
          float* r = acc.c[q / ML::NI][q % ML::NI].r;
#pragma unroll
          for (int e = 0; e < 4; ++e) r[e] += tail[e];
        }
      }
    }
    return true;
  }
};

}  // namespace jo::gemm
