// The pipelined schedule's core as its op files use it (see schedule.h): the
// pieces every op's schedule is made of, and the per-op parts the core calls
// with a switch over OpKind. Internal to pipelined/schedule.cc,
// pipelined/ag_matmul.cc and pipelined/matmul_rs.cc.
#pragma once

#include <cstdint>

#include "kernels/pipeline_kernels.h"
#include "pipelined/schedule.h"

namespace jo::pipelined {

// Rows [first, first + count) of each batch element of a [batch, rows_per_batch, cols] tensor.
struct RowRange {
  char* base;
  int64_t rows_per_batch;
  int64_t cols;
  int elem_bytes;
  char* at(int64_t first) const { return base + first * cols * elem_bytes; }
  int64_t batch_stride() const { return rows_per_batch * cols; }  // elements
};

// A stage's units (shards or row blocks) as at most two ranges of consecutive
// units: ring position p is unit (first_unit + p) % world, so a stage that
// wraps past the last unit splits; a stage of all `world` units is the one
// range [0, world).
struct UnitRanges {
  int first[2];
  int count[2];
  int n;
};
UnitRanges stage_units(int first_unit, int position, int size, int world);

// This rank's place in ctx's call: the world, its rank, and the parity of the
// call's epoch (which slots it uses).
struct RingPlace {
  int world;
  int rank;
  int parity;
};
inline RingPlace ring_place(const Context& ctx) {
  return {ctx.peers.world, ctx.peers.rank, static_cast<int>(ctx.epoch & 1u)};
}

// What a call's enqueue has put on its streams so far, for abandon().
struct Progress {
  StreamSet forked = 0;   // the side streams that wait on the origin stream (joined back by abandon)
  uint32_t released = 0;  // bit i: this rank's flag i (ag: the pub flag; rs: the ready flag of block i) released
  bool verified = false;  // the check after the pulls is enqueued: it releases the done flags
};

// Fault "pipelined_pause_pull=<ms>": this process's pipelined calls hold their
// copy stream for <ms> ms once the wait for their first peer's data matched,
// before pulling it (a reader stalled across its peers' watchdog,
// tests/gpu/scenarios/overwrite.py).
Status pause_if_asked(hipStream_t stream);

// Fault "pipelined_fail_after_release[=rank]": the call fails to enqueue right
// after its first release to its peers, as a failed launch would.
Status fail_after_release_if_asked(int rank);

// Marks `flag` kSiteRewriting before the data it released is overwritten
// (pipeline_kernels.h PipeFlag): the stream's next operation, the rewrite,
// starts after this write was performed, so a reader whose pull met any byte
// of the rewrite finds the mark, or a later release, when it verifies.
Status mark_rewriting(PipeFlag* flag, hipStream_t stream);

// Releases `flag` (marked rewriting) for (the low bits of) `epoch` and this
// call's site: the epoch, then the site, which a reader acquires last (each
// stream write is preceded by a memory fence, so the data written before on
// the stream is visible first).
Status release(PipeFlag* flag, uint64_t epoch, uint32_t site, hipStream_t stream);

// After the pulls of this call on `stream`: checks that every flag they
// relied on still holds this release, and releases this rank's done flags
// in the peers' regions (pipeline_kernels.h FlagVerify).
Status verify_and_release(const Context& ctx, const PipeFlag* const* flags, PipeFlag* const* done,
                          const uint32_t* peers, int count, hipStream_t stream);

// A wait on `count` flags of this call for (the low bits of) `epoch`; `site` 0
// (any) for readers' done flags.
Status wait_flags(const Context& ctx, const PipeFlag* const* flags, const uint32_t* peers, int count, uint64_t epoch,
                  uint32_t site, WaitOn what, hipStream_t stream);

// What one chunk GEMM takes besides its rows: whether it adds the bias, and
// the x scale of its rows (scaled calls; block scales: its rows' [k/128][rows]).
struct ChunkPart {
  bool bias;
  const float* x_scale;
};

// The x scales of each unit of a stage whose units have scales of their own:
// unit u's at first + u * stride. ag_matmul's gathered float8 shards (each
// with its own rank's scales: tensor scales on slots blas::kScaleSlot floats
// apart, block scales m * k/128 floats apart) and matmul_rs's block-scaled
// row blocks ((m / world) * k/128 floats apart).
struct UnitScales {
  const float* first = nullptr;  // nullptr: the units share op.x_scale
  int64_t stride = 0;            // floats
  const float* of(int unit) const { return first + unit * stride; }
};

// The GEMMs of one stage on compute stream `stream_index`: for each range of
// `units`, its rows of `x` (unit u: rows [u * unit_rows, (u + 1) * unit_rows)
// of every batch element) @ w into the same rows of `out`, with the bias when
// `bias`. Each is one vendor GEMM over the range's rows, scaled by op.x_scale;
// with `scales` of their own, one GEMM per unit u instead, with scales.of(u).
// The batch elements go into one strided-batched GEMM (w shared: stride 0) when
// the vendor has an algorithm for it, else one GEMM each. With `enqueue`
// false it only makes the plans it would run (a plan is made once per problem
// and alignment and kept: enqueuing after that finds it, and cannot fail on it).
Status stage_gemms(const Operands& op, const Context& ctx, const RowRange& x, const RowRange& out, int64_t unit_rows,
                   const UnitRanges& units, bool bias, const UnitScales& scales, int stream_index,
                   bool enqueue = true);

// One GEMM of `rows` rows per batch element, as stage_gemms runs them, over `part`'s columns.
Status chunk_gemm(const Operands& op, const Context& ctx, const RowRange& x, int64_t x_first, const RowRange& out,
                  int64_t out_first, int64_t rows, const ChunkPart& part, int stream_index, bool enqueue = true);

// The wait an abandon makes for the readers of a slot it is about to mark
// (FlagAbandon::readers_done): none when the slot was not used two calls ago.
void wait_readers_before_marking(const Context& ctx, const PipeFlag* done, int reader, FlagAbandon* a);

// An abandon's release of this rank's done flag `done` in `peer`'s region,
// once the peer's flag `after` for this rank (its pub or ready flag) reads the
// epoch (FlagAbandon says why).
void release_done_after(PipeFlag* done, const PipeFlag* after, int peer, FlagAbandon* a);

// Each op's part, in its own file. make_plans: the plans of every GEMM the
// op's enqueue runs, with the same operands (ctx.epoch is the epoch the call
// will take). enqueue: the call on the side streams (forked from `origin`
// already), joined back into `origin`. abandon_flags: the flags of ctx's epoch this rank owes its peers,
// given what the enqueue did (pipeline_kernels.h FlagAbandon's own, released,
// done and readers). check_stages: the op's own rule on a stage plan whose
// sizes are positive and sum to the world size.
namespace ag_matmul {
// The scratch beyond the compute streams' vendor workspaces: the gathered
// float8 tensor scales' slots its GEMMs read (blas::kScaleSlot floats apart;
// unused with block scales, which its GEMMs read from gathered_scales).
inline constexpr uint64_t kScaleSlotsBytes = kMaxWorld * blas::kScaleAlign;
uint64_t region_bytes(int world, int64_t batch, int64_t m, int64_t k, int x_bytes, bool scaled, bool blocks);
Status check_stages(const int64_t* stages);
Status make_plans(const Operands& op, const Context& ctx);
Status enqueue(const Operands& op, const Context& ctx, Progress* progress, hipStream_t origin);
void abandon_flags(const Operands& op, const Context& ctx, const Progress& progress, FlagAbandon* a);
}  // namespace ag_matmul

namespace matmul_rs {
uint64_t region_bytes(int world, int64_t batch, int64_t m, int64_t n, int partial_bytes);
// The scratch beyond the compute streams' vendor workspaces.
uint64_t receive_bytes(int world, int64_t batch, int64_t m, int64_t n, int partial_bytes, bool loopback);
// compute[1] only with two stages or more.
StreamSet streams_used(const Operands& op);
Status make_plans(const Operands& op, const Context& ctx);
Status enqueue(const Operands& op, const Context& ctx, Progress* progress, hipStream_t origin);
void abandon_flags(const Operands& op, const Context& ctx, const Progress& progress, FlagAbandon* a);
}  // namespace matmul_rs

}  // namespace jo::pipelined
