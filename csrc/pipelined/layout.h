// Layouts of the pipelined algorithm's symmetric regions (see schedule.h).
// A region sits at the same offset in every rank's workspace; these turn
// (shape, world) into byte offsets for sizing (Python) and use (schedule.cc).
// Flags carry the low 32 bits of exact epochs and are never reset; data slots
// are double-buffered by epoch parity, and a slot is overwritten only after
// every reader released its done flag for the slot's previous use.
#pragma once

#include <cstdint>

#include "kernels/pipeline_kernels.h"
#include "kernels/region_layout.h"

namespace jo::pipelined {

// ag_matmul: each rank publishes its shard of x; every peer pulls it. With
// float8 x, the shard's x scales travel with it: a slot holds a header with
// the scales (a float, or block scales [k/128][m], at its start), then the
// shard, both under the slot's pub flag.
//   pub  [2]          owner, after copying its shard (and scales) into slot[parity]; site, then epoch
//   done [2][world]   reader q (a remote write), after pulling slot[parity]; its site, then epoch
//   slot [2][header_bytes + shard_bytes]
struct GatherRegion {
  int world;
  uint64_t shard_bytes;
  uint64_t pub, done, slots, header_bytes, slot_bytes, total;

  // header_bytes: 0 (16-bit x) or a multiple of kRegionAlign, which keeps the shard aligned.
  static GatherRegion make(int world, uint64_t shard_bytes, uint64_t header_bytes) {
    GatherRegion l{};
    l.world = world;
    l.shard_bytes = shard_bytes;
    l.pub = 0;
    l.done = align_up(2 * sizeof(PipeFlag), kRegionAlign);
    l.slots = align_up(l.done + 2 * static_cast<uint64_t>(world) * sizeof(PipeFlag), kRegionAlign);
    l.header_bytes = header_bytes;
    l.slot_bytes = l.header_bytes + align_up(shard_bytes, kRegionAlign);
    l.total = l.slots + 2 * l.slot_bytes;
    return l;
  }
  PipeFlag* pub_flag(char* region, int parity) const {
    return reinterpret_cast<PipeFlag*>(region + pub) + parity;
  }
  PipeFlag* done_flag(char* region, int parity, int reader) const {
    return reinterpret_cast<PipeFlag*>(region + done) + parity * world + reader;
  }
  char* slot(char* region, int parity) const { return region + slots + parity * slot_bytes + header_bytes; }
  float* scales(char* region, int parity) const {
    return reinterpret_cast<float*>(region + slots + parity * slot_bytes);
  }
};

// matmul_rs: each rank stages its whole partial product x @ w, [batch][m][n]
// laid out like x's rows, so row block b (of rank b) is rows [b*m/world,
// (b+1)*m/world) of every batch element; block b's owner pulls it.
//   ready [2][world]  stager, after block b is in staging[parity]; site, then epoch
//   done  [2][world]  block b's owner (a remote write), after pulling block b; its site, then epoch
//   staging [2][partial_bytes]
struct ReduceRegion {
  int world;
  uint64_t partial_bytes;
  uint64_t ready, done, staging, staging_bytes, total;

  static ReduceRegion make(int world, uint64_t partial_bytes) {
    ReduceRegion l{};
    l.world = world;
    l.partial_bytes = partial_bytes;
    const uint64_t flags = 2 * static_cast<uint64_t>(world) * sizeof(PipeFlag);
    l.ready = 0;
    l.done = align_up(flags, kRegionAlign);
    l.staging = align_up(l.done + flags, kRegionAlign);
    l.staging_bytes = align_up(partial_bytes, kRegionAlign);
    l.total = l.staging + 2 * l.staging_bytes;
    return l;
  }
  PipeFlag* ready_flag(char* region, int parity, int block) const {
    return reinterpret_cast<PipeFlag*>(region + ready) + parity * world + block;
  }
  PipeFlag* done_flag(char* region, int parity, int block) const {
    return reinterpret_cast<PipeFlag*>(region + done) + parity * world + block;
  }
  char* partial(char* region, int parity) const { return region + staging + parity * staging_bytes; }
};

}  // namespace jo::pipelined
