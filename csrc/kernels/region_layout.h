// Layouts of the symmetric regions the collective kernels use. A region sits
// at the same offset in every rank's workspace; these structs turn (shape,
// world) into byte offsets identically on host (sizing) and device (use).
// Flags are uint32 flag_values (epoch and call site, below), never reset; a
// wait matches its exact epoch.
#pragma once

#include <cstdint>

#include "platform/gpu.h"

namespace jo {

inline constexpr uint64_t kRegionAlign = 256;

JO_HOST_DEVICE uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// A flag's value: the low 16 bits of the epoch of the call that released it
// and that call's site above them (jax_overlap/runtime/workspace.py numbers the call
// sites sharing a region from 1; at most 65535). 16 bits of epoch are exact:
// every flag of a region is rewritten every call or two, so a value is never
// more than two epochs old, never 65536 (params.h EpochCounter).
JO_HOST_DEVICE uint32_t flag_value(uint32_t epoch, uint32_t site) { return site << 16 | (epoch & 0xFFFFu); }

enum class Match { kNo, kYes, kOtherSite };

// A wait accepts only its exact epoch: a stale value (a peer one call behind,
// or left from before clear_errors()) is never a pass, it waits and times out.
// Every flag's writer is itself held back by the readers' done flags, so it
// cannot run ahead past the value a reader waits for. A wait whose expected
// value names a site (nonzero) and finds its epoch released by another site
// has met a peer that ran the region's calls in another order: kOtherSite.
// Every release carries its call site (>= 1), so a value with no site is no
// release: a flag still zero since the workspace was zeroed never matches,
// also when the epoch waited for has low bits 0 (every 65536th call, or a
// region's first call from an origin such as 2^32).
JO_HOST_DEVICE Match match(uint32_t value, uint32_t expected) {
  if (((value ^ expected) & 0xFFFFu) != 0 || (value >> 16) == 0) return Match::kNo;
  return (expected >> 16) == 0 || (value >> 16) == (expected >> 16) ? Match::kYes : Match::kOtherSite;
}

// Gathers (ag_matmul, all_gather): each rank publishes its [rows, row_bytes]
// shard in chunks of chunk_rows x chunk_bytes; peers pull every chunk.
//   pub_flags    [2][chunks]         owner: release(sys) after filling the chunk
//   done_flags   [2][world][chunks]  reader q, remotely: release(sys) after copying
//   staged_flags [world][chunks]     own fetchers: release(dev) after staging
//   pub_data     [2][rows * row_bytes]
// Slots are double-buffered by epoch parity.
struct GatherLayout {
  int64_t rows;
  int64_t row_bytes;
  int chunk_rows;
  int64_t chunk_bytes;
  int row_chunks;
  int col_chunks;
  int world;
  uint64_t pub_flags;
  uint64_t done_flags;
  uint64_t staged_flags;
  uint64_t pub_data;
  uint64_t slot_bytes;
  uint64_t total;

  static JO_HOST_DEVICE GatherLayout make(int world, int64_t rows, int64_t row_bytes, int chunk_rows,
                                          int64_t chunk_bytes) {
    GatherLayout l{};
    l.rows = rows;
    l.row_bytes = row_bytes;
    l.chunk_rows = chunk_rows;
    l.chunk_bytes = chunk_bytes;
    l.row_chunks = static_cast<int>((rows + chunk_rows - 1) / chunk_rows);
    l.col_chunks = static_cast<int>((row_bytes + chunk_bytes - 1) / chunk_bytes);
    l.world = world;
    const uint64_t c = static_cast<uint64_t>(l.chunks());
    l.pub_flags = 0;
    l.done_flags = align_up(l.pub_flags + 2 * c * 4, kRegionAlign);
    l.staged_flags = align_up(l.done_flags + 2 * static_cast<uint64_t>(world) * c * 4, kRegionAlign);
    l.pub_data = align_up(l.staged_flags + static_cast<uint64_t>(world) * c * 4, kRegionAlign);
    l.slot_bytes = align_up(static_cast<uint64_t>(rows) * row_bytes, kRegionAlign);
    l.total = l.pub_data + 2 * l.slot_bytes;
    return l;
  }
  JO_HOST_DEVICE int chunks() const { return row_chunks * col_chunks; }
  JO_HOST_DEVICE uint32_t* pub_flag(char* region, int parity, int chunk) const {
    return reinterpret_cast<uint32_t*>(region + pub_flags) + parity * chunks() + chunk;
  }
  JO_HOST_DEVICE uint32_t* done_flag(char* region, int parity, int reader, int chunk) const {
    return reinterpret_cast<uint32_t*>(region + done_flags) + (parity * world + reader) * chunks() + chunk;
  }
  JO_HOST_DEVICE uint32_t* staged_flag(char* region, int shard, int chunk) const {
    return reinterpret_cast<uint32_t*>(region + staged_flags) + shard * chunks() + chunk;
  }
  JO_HOST_DEVICE char* slot(char* region, int parity) const { return region + pub_data + parity * slot_bytes; }
};

// Reduce-scatter (matmul_rs): rank p stages its partial product of every
// rank q's row block; rank q sums the T partials of its block.
//   ready_flags [2][world][tiles]  owner: release(sys) after staging tile t of block q
//   done_flags  [2][world][tiles]  reader q, remotely: release(sys) after summing tile t
//   data        [2][world][block_rows * n]
struct ReduceLayout {
  int64_t block_rows;
  int64_t n;
  int tiles;
  int world;
  int elem_bytes;
  uint64_t ready_flags;
  uint64_t done_flags;
  uint64_t data;
  uint64_t slot_bytes;
  uint64_t total;

  static JO_HOST_DEVICE ReduceLayout make(int world, int64_t block_rows, int64_t n, int tiles, int elem_bytes) {
    ReduceLayout l{};
    l.block_rows = block_rows;
    l.n = n;
    l.tiles = tiles;
    l.world = world;
    l.elem_bytes = elem_bytes;
    const uint64_t f = 2 * static_cast<uint64_t>(world) * tiles * 4;
    l.ready_flags = 0;
    l.done_flags = align_up(f, kRegionAlign);
    l.data = align_up(l.done_flags + f, kRegionAlign);
    l.slot_bytes = align_up(static_cast<uint64_t>(world) * block_rows * n * elem_bytes, kRegionAlign);
    l.total = l.data + 2 * l.slot_bytes;
    return l;
  }
  JO_HOST_DEVICE uint32_t* ready_flag(char* region, int parity, int block, int tile) const {
    return reinterpret_cast<uint32_t*>(region + ready_flags) + (parity * world + block) * tiles + tile;
  }
  JO_HOST_DEVICE uint32_t* done_flag(char* region, int parity, int block, int tile) const {
    return reinterpret_cast<uint32_t*>(region + done_flags) + (parity * world + block) * tiles + tile;
  }
  // Start of block `block`'s staged partial rows in a slot.
  JO_HOST_DEVICE char* block_data(char* region, int parity, int block) const {
    return region + data + parity * slot_bytes +
           static_cast<uint64_t>(block) * block_rows * n * elem_bytes;
  }
};

}  // namespace jo
