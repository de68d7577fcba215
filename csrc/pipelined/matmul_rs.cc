// matmul_rs's part of the pipelined schedule (schedule.h): its stages' GEMMs
// staged block by block for their owners, its own block pulled from every
// peer, then the fixed-order reduction.
#include "core/block_scales.h"
#include "pipelined/layout.h"
#include "pipelined/schedule_core.h"

namespace jo::pipelined::matmul_rs {
namespace {

// The operands' tensors as row ranges, and the call's region in every rank's workspace.
struct RsCall {
  int partial_bytes;  // the partials' element: partial_dtype(y's dtype)
  int64_t block_rows;
  uint64_t block_bytes;
  ReduceRegion region;
  RowRange x, partial;
  char* received;  // the peers' partials of my block, q != rank, in rank order
  // Block scales: each row block's x scales, [world][k/128][m / world] (one GEMM per block); else none (the
  // blocks share op.x_scale).
  UnitScales block_scales;

  RsCall(const Operands& op, const Context& ctx)
      : partial_bytes(element_bytes(partial_dtype(op.gemm.types.out))),
        block_rows(op.gemm.rows / ctx.peers.world),
        block_bytes(static_cast<uint64_t>(op.gemm.batch) * block_rows * op.gemm.n * partial_bytes),
        region(ReduceRegion::make(ctx.peers.world,
                                  static_cast<uint64_t>(op.gemm.batch) * op.gemm.rows * op.gemm.n * partial_bytes)),
        x{static_cast<char*>(const_cast<void*>(op.x)), op.gemm.rows, op.gemm.k, element_bytes(op.gemm.types.x)},
        partial{nullptr, op.gemm.rows, op.gemm.n, partial_bytes},
        received(static_cast<char*>(op.scratch) + 2 * blas::kWorkspaceBytes),
        block_scales(op.gemm.types.blocks ? UnitScales{op.x_scale, x_block_scales(block_rows, op.gemm.k)}
                                          : UnitScales{}) {
    const int world = ctx.peers.world;
    // Loopback: a stand-in staging slot after the receive area, in the scratch.
    partial.base = ctx.loopback ? received + (world - 1) * block_bytes
                                : region.partial(ctx.peers.regions[ctx.peers.rank], static_cast<int>(ctx.epoch & 1u));
  }
  char* received_block(int q, int rank) const { return received + (q < rank ? q : q - 1) * block_bytes; }
};

// Stage j's GEMMs on compute stream j % 2 (with `enqueue` false: only their plans): x's rows into the partials,
// which are of partial_dtype(y's dtype) (core/dtype.h), so their GEMMs write that type.
Status stage_gemms_of(const Operands& op, const Context& ctx, const RsCall& c, int j, int position, bool enqueue) {
  const UnitRanges units = stage_units(ctx.peers.rank + 1, position, static_cast<int>(op.stages[j]), ctx.peers.world);
  Operands staged = op;
  staged.gemm.types.out = partial_dtype(op.gemm.types.out);
  return stage_gemms(staged, ctx, c.x, c.partial, c.block_rows, units, /*bias=*/false, c.block_scales, j % 2,
                     enqueue);
}

// The reduction of my block on `stream`.
Status reduce(const Operands& op, const Context& ctx, const RsCall& c, hipStream_t stream) {
  const int world = ctx.peers.world, rank = ctx.peers.rank;
  ReduceArgs r{};
  r.dtype = op.gemm.types.out;
  r.bias_dtype = op.gemm.types.bias;
  for (int q = 0; q < world; ++q) {
    r.partials[q] = q == rank ? c.partial.at(rank * c.block_rows) : c.received_block(q, rank);
    r.partial_batch_stride[q] = q == rank ? c.partial.batch_stride() : c.block_rows * op.gemm.n;
  }
  r.count = world;
  r.bias = op.bias;
  r.out = op.out;
  r.batch = op.gemm.batch;
  r.rows = c.block_rows;
  r.n = op.gemm.n;
  r.abort = ctx.wd.abort;
  JO_RETURN_IF_HIP_ERROR(launch_reduce(r, ctx.sm_count, stream));
  return {};
}

}  // namespace

uint64_t region_bytes(int world, int64_t batch, int64_t m, int64_t n, int partial_bytes) {
  return ReduceRegion::make(world, static_cast<uint64_t>(batch) * m * n * partial_bytes).total;
}

uint64_t receive_bytes(int world, int64_t batch, int64_t m, int64_t n, int partial_bytes, bool loopback) {
  const uint64_t block = static_cast<uint64_t>(batch) * (m / world) * n * partial_bytes;
  uint64_t bytes = (world - 1) * block;  // the peers' partials of my block
  if (loopback) bytes += static_cast<uint64_t>(batch) * m * n * partial_bytes;  // stand-in staging
  return bytes;
}

StreamSet streams_used(const Operands& op) { return kCopy | kCompute0 | (op.stage_count > 1 ? kCompute1 : 0); }

Status make_plans(const Operands& op, const Context& ctx) {
  const RsCall c(op, ctx);
  for (int j = 0, position = 0; j < op.stage_count; position += static_cast<int>(op.stages[j]), ++j)
    JO_RETURN_IF_ERROR(stage_gemms_of(op, ctx, c, j, position, /*enqueue=*/false));
  return {};
}

void abandon_flags(const Operands& op, const Context& ctx, const Progress& progress, FlagAbandon* a) {
  const ReduceRegion region = RsCall(op, ctx).region;
  const auto [world, rank, parity] = ring_place(ctx);
  char* mine = ctx.peers.regions[rank];
  for (int b = 0; b < world; ++b) {
    if (b == rank) continue;
    if (progress.released >> b & 1u) {
      a->released |= 1u << a->own_count;
    } else {
      wait_readers_before_marking(ctx, region.done_flag(mine, parity, b), b, a);
    }
    a->own[a->own_count++] = region.ready_flag(mine, parity, b);
    if (!progress.verified)
      release_done_after(region.done_flag(ctx.peers.regions[b], parity, rank),
                         region.ready_flag(ctx.peers.regions[b], parity, rank), b, a);
  }
}

Status enqueue(const Operands& op, const Context& ctx, Progress* progress, hipStream_t origin) {
  SideStreams& s = *ctx.streams;
  const auto [world, rank, parity] = ring_place(ctx);
  const int64_t n = op.gemm.n;
  const RsCall c(op, ctx);

  // Compute streams: ring position p is row block (rank + 1 + p) % world, my own last.
  for (int j = 0, position = 0; j < op.stage_count; position += static_cast<int>(op.stages[j]), ++j) {
    const hipStream_t stream = s.compute[j % 2];
    const UnitRanges units = stage_units(rank + 1, position, static_cast<int>(op.stages[j]), world);
    int blocks[kMaxWorld];  // the peers' blocks among the stage's (its GEMMs write my own block's rows too)
    int count = 0;
    for (int u = 0; u < units.n; ++u)
      for (int b = units.first[u]; b < units.first[u] + units.count[u]; ++b)
        if (b != rank) blocks[count++] = b;
    if (!ctx.loopback) {
      char* mine = ctx.peers.regions[rank];
      const PipeFlag* flags[kMaxWorld];
      uint32_t owners[kMaxWorld];
      for (int i = 0; i < count; ++i)
        flags[i] = c.region.done_flag(mine, parity, blocks[i]), owners[i] = static_cast<uint32_t>(blocks[i]);
      if (ctx.slot_used)  // the blocks' owners pulled this slot two calls ago
        JO_RETURN_IF_ERROR(wait_flags(ctx, flags, owners, count, ctx.epoch - 2, 0, WaitOn::kReadersDone, stream));
      for (int i = 0; i < count; ++i)
        JO_RETURN_IF_ERROR(mark_rewriting(c.region.ready_flag(mine, parity, blocks[i]), stream));
    }
    JO_RETURN_IF_ERROR(stage_gemms_of(op, ctx, c, j, position, /*enqueue=*/true));
    for (int i = 0; i < count && !ctx.loopback; ++i) {
      JO_RETURN_IF_ERROR(release(c.region.ready_flag(ctx.peers.regions[rank], parity, blocks[i]), ctx.epoch,
                                 ctx.site, stream));
      progress->released |= 1u << blocks[i];
      JO_RETURN_IF_ERROR(fail_after_release_if_asked(rank));
    }
  }

  // Copy stream: my block from each peer, in the order they compute it.
  const PipeFlag* pulled[kMaxWorld];
  PipeFlag* done[kMaxWorld];
  uint32_t stagers[kMaxWorld];
  for (int i = 1; i < world; ++i) {
    const int q = (rank - i + world) % world;
    const char* src = c.partial.at(rank * c.block_rows);
    if (!ctx.loopback) {
      char* theirs = ctx.peers.regions[q];
      pulled[i - 1] = c.region.ready_flag(theirs, parity, rank);
      done[i - 1] = c.region.done_flag(theirs, parity, rank);
      stagers[i - 1] = static_cast<uint32_t>(q);
      JO_RETURN_IF_ERROR(
          wait_flags(ctx, &pulled[i - 1], &stagers[i - 1], 1, ctx.epoch, ctx.site, WaitOn::kPartialReady, s.copy));
      if (i == 1) JO_RETURN_IF_ERROR(pause_if_asked(s.copy));
      src = c.region.partial(theirs, parity) + rank * c.block_rows * n * c.partial_bytes;
    }
    JO_RETURN_IF_ERROR(copy_rows(ctx.copy_path, c.received_block(q, rank), c.block_rows * n, src,
                                 c.partial.batch_stride(), op.gemm.batch, c.block_rows, n, c.partial_bytes, s.copy));
  }
  if (!ctx.loopback) {
    JO_RETURN_IF_ERROR(verify_and_release(ctx, pulled, done, stagers, world - 1, s.copy));
    progress->verified = true;
  }

  JO_RETURN_IF_ERROR(s.join_into(origin, progress->forked));
  progress->forked = 0;
  return reduce(op, ctx, c, origin);
}

}  // namespace jo::pipelined::matmul_rs
