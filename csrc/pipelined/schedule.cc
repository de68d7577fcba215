#include "pipelined/schedule.h"

#include <mutex>
#include <string>

#include "kernels/pipeline_kernels.h"
#include "runtime/faults.h"

namespace jo::pipelined {
namespace {

constexpr int kElem = 2;  // bf16 and fp16

// Rows [first, first + count) of each batch element of a [batch, rows_per_batch, cols] tensor.
struct RowRange {
  char* base;
  int64_t rows_per_batch;
  int64_t cols;
  char* at(int64_t first) const { return base + first * cols * kElem; }
  int64_t batch_stride() const { return rows_per_batch * cols; }  // elements
};

// Whether fault `name` (runtime/faults.h) hits group rank `rank`: the fault
// names the rank as its value, or has no value (every rank of the process).
bool fault_hits(const char* name, int rank) {
  if (!faults::enabled(name)) return false;
  const int64_t only = faults::value(name, -1);
  return only < 0 || only == rank;
}

// Fault "pipelined_pause_pull=<ms>": this process's pipelined calls hold their
// copy stream for <ms> ms once the wait for their first peer's data matched,
// before pulling it (a reader stalled across its peers' watchdog,
// tests/gpu/scenarios/overwrite.py).
Status pause_if_asked(hipStream_t stream) {
  const int64_t ms = faults::value("pipelined_pause_pull", 0);
  if (ms <= 0) return {};
  JO_RETURN_IF_HIP_ERROR(launch_pause(static_cast<uint64_t>(ms) * 1000 * gpu::kNominalTicksPerMicrosecond, stream));
  return {};
}

// Fault "pipelined_fail_after_release[=rank]": the call fails to enqueue right
// after its first release to its peers, as a failed launch would.
Status fail_after_release_if_asked(int rank) {
  if (!fault_hits("pipelined_fail_after_release", rank)) return {};
  return Status{"jax_overlap: fault pipelined_fail_after_release: the call failed after its first release"};
}

// Marks `flag` kSiteRewriting before the data it released is overwritten
// (pipeline_kernels.h PipeFlag): the stream's next operation, the rewrite,
// starts after this write was performed, so a reader whose pull met any byte
// of the rewrite finds the mark, or a later release, when it verifies.
Status mark_rewriting(PipeFlag* flag, hipStream_t stream) {
  JO_RETURN_IF_HIP_ERROR(gpu::stream_write_u32(stream, &flag->site, kSiteRewriting));
  return {};
}

// Releases `flag` (marked rewriting) for (the low bits of) `epoch` and this
// call's site: the epoch, then the site, which a reader acquires last (each
// stream write is preceded by a memory fence, so the data written before on
// the stream is visible first).
Status release(PipeFlag* flag, uint64_t epoch, uint32_t site, hipStream_t stream) {
  JO_RETURN_IF_HIP_ERROR(gpu::stream_write_u32(stream, &flag->epoch, static_cast<uint32_t>(epoch)));
  JO_RETURN_IF_HIP_ERROR(gpu::stream_write_u32(stream, &flag->site, site));
  return {};
}

// After the pulls of this call on `stream`: checks that every flag they
// relied on still holds this release, and releases this rank's done flags
// in the peers' regions (pipeline_kernels.h FlagVerify).
Status verify_and_release(const Context& ctx, const PipeFlag* const* flags, PipeFlag* const* done,
                          const uint32_t* peers, int count, hipStream_t stream) {
  if (count == 0) return {};
  FlagVerify v{};
  for (int i = 0; i < count; ++i) {
    v.flags[i] = flags[i];
    v.done[i] = done[i];
    v.peers[i] = peers[i];
  }
  v.count = count;
  v.epoch = static_cast<uint32_t>(ctx.epoch);
  v.site = ctx.site;
  v.rank = static_cast<uint32_t>(ctx.peers.rank);
  v.world = static_cast<uint32_t>(ctx.peers.world);
  v.wd = ctx.wd;
  JO_RETURN_IF_HIP_ERROR(launch_flag_verify(v, stream));
  return {};
}

// A wait on `count` flags of this call for (the low bits of) `epoch`; `site` 0
// (any) for readers' done flags.
Status wait_flags(const Context& ctx, const PipeFlag* const* flags, const uint32_t* peers, int count, uint64_t epoch,
                  uint32_t site, WaitOn what, hipStream_t stream) {
  if (count == 0) return {};
  FlagWait w{};
  for (int i = 0; i < count; ++i) {
    w.flags[i] = flags[i];
    w.peers[i] = peers[i];
  }
  w.count = count;
  w.epoch = static_cast<uint32_t>(epoch);
  w.site = site;
  w.what = what;
  w.rank = static_cast<uint32_t>(ctx.peers.rank);
  w.world = static_cast<uint32_t>(ctx.peers.world);
  w.wd = ctx.wd;
  JO_RETURN_IF_HIP_ERROR(launch_flag_wait(w, stream));
  return {};
}

// One vendor GEMM over `rows` rows per batch element: out rows = x rows @ w (+ bias). The batch
// elements go into one strided-batched GEMM (w shared: stride 0) when the vendor has an algorithm
// for it, else one GEMM each. With `enqueue` false it only makes the plans it would run (a plan
// is made once per shape and alignment and kept: enqueuing after that finds it, and cannot fail
// on it).
Status gemm(const Operands& op, const Context& ctx, const RowRange& x, int64_t x_first, const RowRange& out,
            int64_t out_first, int64_t rows, bool bias, int stream_index, bool enqueue = true) {
  const char* a = x.at(x_first);
  char* d = out.at(out_first);
  const void* b = bias ? op.bias : nullptr;
  void* workspace = static_cast<char*>(op.scratch) + stream_index * blas::kWorkspaceBytes;
  const hipStream_t stream = enqueue ? ctx.streams->compute[stream_index] : nullptr;
  blas::GemmShape shape{op.dtype,       rows,         op.n,       op.k,       op.batch, x.cols, out.cols,
                        x.batch_stride(), out.batch_stride(), op.w_kmajor, b != nullptr,
                        blas::alignment_of({a, d, op.w, b})};
  const blas::GemmPlan* plan = nullptr;
  const Status batched = ctx.blas->plan(shape, &plan);
  if (batched.ok()) return enqueue ? ctx.blas->run(*plan, a, op.w, b, d, workspace, stream) : Status{};
  if (op.batch == 1) return batched;
  shape.batch = 1;
  for (int64_t e = 0; e < op.batch; ++e) {
    const char* ae = a + e * x.batch_stride() * kElem;
    char* de = d + e * out.batch_stride() * kElem;
    shape.alignment = blas::alignment_of({ae, de, op.w, b});
    JO_RETURN_IF_ERROR(ctx.blas->plan(shape, &plan));
    if (enqueue) JO_RETURN_IF_ERROR(ctx.blas->run(*plan, ae, op.w, b, de, workspace, stream));
  }
  return {};
}

// A stage's units (shards or row blocks) as at most two ranges of consecutive
// units: ring position p is unit (first_unit + p) % world, so a stage that
// wraps past the last unit splits.
struct UnitRanges {
  int first[2];
  int count[2];
  int n;
};

UnitRanges stage_units(int first_unit, int position, int size, int world) {
  UnitRanges r{};
  for (int unit = (first_unit + position) % world, left = size; left > 0; r.n++) {
    r.first[r.n] = unit;
    r.count[r.n] = left < world - unit ? left : world - unit;
    left -= r.count[r.n];
    unit = 0;
  }
  return r;
}

// What a call's enqueue has put on its streams so far, for abandon().
struct Progress {
  bool forked = false;    // the side streams wait on the origin stream
  uint32_t released = 0;  // bit i: this rank's flag i (ag: the pub flag; rs: the ready flag of block i) released
  bool verified = false;  // the check after the pulls is enqueued: it releases the done flags
};

// The operands' tensors as row ranges, and the call's region in every rank's workspace.
struct AgCall {
  RowRange x, gathered, y;
  uint64_t shard_bytes;
  GatherRegion region;

  AgCall(const Operands& op, const Context& ctx)
      : x{static_cast<char*>(const_cast<void*>(op.x)), op.m, op.k},
        gathered{static_cast<char*>(op.gathered), ctx.peers.world * op.m, op.k},
        y{static_cast<char*>(op.out), ctx.peers.world * op.m, op.n},
        shard_bytes(static_cast<uint64_t>(op.batch) * op.m * op.k * kElem),
        region(GatherRegion::make(ctx.peers.world, shard_bytes)) {}
};

struct RsCall {
  int64_t block_rows;
  uint64_t block_bytes;
  ReduceRegion region;
  RowRange x, partial;
  char* received;  // the peers' partials of my block, q != rank, in rank order

  RsCall(const Operands& op, const Context& ctx)
      : block_rows(op.m / ctx.peers.world),
        block_bytes(static_cast<uint64_t>(op.batch) * block_rows * op.n * kElem),
        region(ReduceRegion::make(ctx.peers.world, static_cast<uint64_t>(op.batch) * op.m * op.n * kElem)),
        x{static_cast<char*>(const_cast<void*>(op.x)), op.m, op.k},
        partial{nullptr, op.m, op.n},
        received(static_cast<char*>(op.scratch) + 2 * blas::kWorkspaceBytes) {
    const int world = ctx.peers.world;
    // Loopback: a stand-in staging slot after the receive area, in the scratch.
    partial.base = ctx.loopback ? received + (world - 1) * block_bytes
                                : region.partial(ctx.peers.regions[ctx.peers.rank], static_cast<int>(ctx.epoch & 1u));
  }
  char* received_block(int q, int rank) const { return received + (q < rank ? q : q - 1) * block_bytes; }
};

// Fault "pipelined_plan_fail[=rank]": the vendor GEMM plans of the call cannot be made.
Status plan_fault(int rank) {
  if (!fault_hits("pipelined_plan_fail", rank)) return {};
  return Status{"jax_overlap: fault pipelined_plan_fail: no vendor GEMM plan"};
}

// Makes the plans of every GEMM the op's enqueue runs, with the same operands (ctx.epoch is the
// epoch the call will take: matmul_rs's staging slot is its parity's, though both parities'
// slots have the same alignment).
Status make_ag_plans(const Operands& op, const Context& ctx) {
  JO_RETURN_IF_ERROR(plan_fault(ctx.peers.rank));
  const AgCall c(op, ctx);
  const int rank = ctx.peers.rank;
  JO_RETURN_IF_ERROR(gemm(op, ctx, c.x, 0, c.y, rank * op.m, op.m, true, 0, /*enqueue=*/false));
  for (int j = 1, position = 1; j < op.stage_count; position += static_cast<int>(op.stages[j]), ++j) {
    const UnitRanges units = stage_units(rank, position, static_cast<int>(op.stages[j]), ctx.peers.world);
    for (int u = 0; u < units.n; ++u)
      JO_RETURN_IF_ERROR(gemm(op, ctx, c.gathered, units.first[u] * op.m, c.y, units.first[u] * op.m,
                              units.count[u] * op.m, true, j % 2, /*enqueue=*/false));
  }
  return {};
}

Status make_rs_plans(const Operands& op, const Context& ctx) {
  JO_RETURN_IF_ERROR(plan_fault(ctx.peers.rank));
  const RsCall c(op, ctx);
  for (int j = 0, position = 0; j < op.stage_count; position += static_cast<int>(op.stages[j]), ++j) {
    const UnitRanges units = stage_units(ctx.peers.rank + 1, position, static_cast<int>(op.stages[j]),
                                         ctx.peers.world);
    for (int u = 0; u < units.n; ++u)
      JO_RETURN_IF_ERROR(gemm(op, ctx, c.x, units.first[u] * c.block_rows, c.partial, units.first[u] * c.block_rows,
                              units.count[u] * c.block_rows, false, j % 2, /*enqueue=*/false));
  }
  return {};
}

Status enqueue_ag(const Operands& op, const Context& ctx, Progress* progress, hipStream_t origin) {
  SideStreams& s = *ctx.streams;
  const int world = ctx.peers.world;
  const int rank = ctx.peers.rank;
  const int parity = static_cast<int>(ctx.epoch & 1u);
  const AgCall c(op, ctx);
  JO_RETURN_IF_ERROR(s.fork_from(origin));
  progress->forked = true;
  // My own shard straight from x, first: nothing of this call waits yet when it is launched (the launch
  // of a kernel not loaded yet waits for the device's running kernels).
  JO_RETURN_IF_ERROR(gemm(op, ctx, c.x, 0, c.y, rank * op.m, op.m, /*bias=*/true, /*stream_index=*/0));

  // Copy stream: publish my shard, then pull the peers' in ring order.
  const PipeFlag* pulled[kMaxWorld];
  PipeFlag* done[kMaxWorld];
  uint32_t owners[kMaxWorld];
  if (!ctx.loopback) {
    char* mine = ctx.peers.regions[rank];
    PipeFlag* pub = c.region.pub_flag(mine, parity);
    const PipeFlag* flags[kMaxWorld];
    int count = 0;
    if (ctx.slot_used) {  // the readers of this slot two calls ago
      for (int q = 0; q < world; ++q)
        if (q != rank) flags[count] = c.region.done_flag(mine, parity, q), owners[count++] = q;
      JO_RETURN_IF_ERROR(wait_flags(ctx, flags, owners, count, ctx.epoch - 2, 0, WaitOn::kReadersDone, s.copy));
    }
    JO_RETURN_IF_ERROR(mark_rewriting(pub, s.copy));
    JO_RETURN_IF_ERROR(copy_bytes(ctx.copy_path, c.region.slot(mine, parity), op.x, c.shard_bytes, s.copy));
    JO_RETURN_IF_ERROR(release(pub, ctx.epoch, ctx.site, s.copy));
    progress->released = 1;
    JO_RETURN_IF_ERROR(fail_after_release_if_asked(rank));
    for (int i = 1; i < world; ++i) {
      const int q = (rank + i) % world;
      pulled[i - 1] = c.region.pub_flag(ctx.peers.regions[q], parity);
      done[i - 1] = c.region.done_flag(ctx.peers.regions[q], parity, rank);
      owners[i - 1] = static_cast<uint32_t>(q);
    }
    JO_RETURN_IF_ERROR(wait_flags(ctx, pulled, owners, world - 1, ctx.epoch, ctx.site, WaitOn::kPublished, s.copy));
    JO_RETURN_IF_ERROR(pause_if_asked(s.copy));
  }
  for (int i = 1; i < world; ++i) {
    const int shard = (rank + i) % world;
    const char* src = ctx.loopback ? c.x.base : c.region.slot(ctx.peers.regions[shard], parity);
    JO_RETURN_IF_ERROR(copy_rows(ctx.copy_path, c.gathered.at(shard * op.m), c.gathered.batch_stride(), src,
                                 c.x.batch_stride(), op.batch, op.m, op.k, s.copy));
    JO_RETURN_IF_HIP_ERROR(hipEventRecord(s.arrived[i], s.copy));
  }
  if (!ctx.loopback) {
    // One check of every peer's pub flag after all pulls, then the done flags (their writers need them
    // only when they publish into this parity's slot again, two calls later).
    JO_RETURN_IF_ERROR(verify_and_release(ctx, pulled, done, owners, world - 1, s.copy));
    progress->verified = true;
  }
  JO_RETURN_IF_ERROR(copy_rows(ctx.copy_path, c.gathered.at(rank * op.m), c.gathered.batch_stride(), c.x.base,
                               c.x.batch_stride(), op.batch, op.m, op.k, s.copy));

  // Compute streams: each stage once its last shard arrived.
  for (int j = 1, position = 1; j < op.stage_count; position += static_cast<int>(op.stages[j]), ++j) {
    const int size = static_cast<int>(op.stages[j]);
    JO_RETURN_IF_HIP_ERROR(hipStreamWaitEvent(s.compute[j % 2], s.arrived[position + size - 1], 0));
    const UnitRanges units = stage_units(rank, position, size, world);
    for (int u = 0; u < units.n; ++u)
      JO_RETURN_IF_ERROR(gemm(op, ctx, c.gathered, units.first[u] * op.m, c.y, units.first[u] * op.m,
                              units.count[u] * op.m, /*bias=*/true, j % 2));
  }
  JO_RETURN_IF_ERROR(s.join_into(origin));
  progress->forked = false;
  if (ctx.wd.abort != nullptr)
    JO_RETURN_IF_HIP_ERROR(launch_poison_if_aborted(ctx.wd.abort, op.out,
                                                    static_cast<uint64_t>(op.batch) * world * op.m * op.n * kElem,
                                                    op.gathered, static_cast<uint64_t>(world) * c.shard_bytes, origin));
  return {};
}

Status enqueue_rs(const Operands& op, const Context& ctx, Progress* progress, hipStream_t origin) {
  SideStreams& s = *ctx.streams;
  const int world = ctx.peers.world;
  const int rank = ctx.peers.rank;
  const int parity = static_cast<int>(ctx.epoch & 1u);
  const RsCall c(op, ctx);
  JO_RETURN_IF_ERROR(s.fork_from(origin));
  progress->forked = true;

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
    for (int u = 0; u < units.n; ++u)
      JO_RETURN_IF_ERROR(gemm(op, ctx, c.x, units.first[u] * c.block_rows, c.partial, units.first[u] * c.block_rows,
                              units.count[u] * c.block_rows, /*bias=*/false, j % 2));
    for (int i = 0; i < count && !ctx.loopback; ++i) {
      JO_RETURN_IF_ERROR(release(c.region.ready_flag(ctx.peers.regions[rank], parity, blocks[i]), ctx.epoch, ctx.site,
                                 stream));
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
      src = c.region.partial(theirs, parity) + rank * c.block_rows * op.n * kElem;
    }
    JO_RETURN_IF_ERROR(copy_rows(ctx.copy_path, c.received_block(q, rank), c.block_rows * op.n, src,
                                 c.partial.batch_stride(), op.batch, c.block_rows, op.n, s.copy));
  }
  if (!ctx.loopback) {
    JO_RETURN_IF_ERROR(verify_and_release(ctx, pulled, done, stagers, world - 1, s.copy));
    progress->verified = true;
  }
  JO_RETURN_IF_ERROR(s.join_into(origin));
  progress->forked = false;

  ReduceArgs r{};
  r.dtype = op.dtype;
  for (int q = 0; q < world; ++q) {
    r.partials[q] = q == rank ? c.partial.at(rank * c.block_rows) : c.received_block(q, rank);
    r.partial_batch_stride[q] = q == rank ? c.partial.batch_stride() : c.block_rows * op.n;
  }
  r.count = world;
  r.bias = op.bias;
  r.out = op.out;
  r.batch = op.batch;
  r.rows = c.block_rows;
  r.n = op.n;
  r.abort = ctx.wd.abort;
  JO_RETURN_IF_HIP_ERROR(launch_reduce(r, ctx.sm_count, origin));
  return {};
}

// Ends ctx's epoch for the peers after this rank failed to run its part (pipeline_kernels.h
// FlagAbandon): on `origin`, after whatever the call enqueued (joined back first).
Status abandon(OpKind kind, const Operands& op, const Context& ctx, const Progress& progress, hipStream_t origin) {
  if (progress.forked) JO_RETURN_IF_ERROR(ctx.streams->join_into(origin));
  const int world = ctx.peers.world;
  const int rank = ctx.peers.rank;
  const int parity = static_cast<int>(ctx.epoch & 1u);
  char* mine = ctx.peers.regions[rank];
  FlagAbandon a{};
  auto wait_readers = [&](const PipeFlag* flag, int reader) {
    if (!ctx.slot_used) return;
    a.readers_done[a.reader_count] = flag;
    a.readers[a.reader_count++] = static_cast<uint32_t>(reader);
  };
  if (kind == OpKind::kAgMatmul) {
    const GatherRegion region = GatherRegion::make(world, static_cast<uint64_t>(op.batch) * op.m * op.k * kElem);
    a.own[a.own_count++] = region.pub_flag(mine, parity);
    a.released = progress.released;
    for (int q = 0; q < world && progress.released == 0; ++q)
      if (q != rank) wait_readers(region.done_flag(mine, parity, q), q);
    for (int q = 0; q < world && !progress.verified; ++q)
      if (q != rank) a.done[a.done_count++] = region.done_flag(ctx.peers.regions[q], parity, rank);
  } else {
    const ReduceRegion region = ReduceRegion::make(world, static_cast<uint64_t>(op.batch) * op.m * op.n * kElem);
    for (int b = 0; b < world; ++b) {
      if (b == rank) continue;
      if (progress.released >> b & 1u) {
        a.released |= 1u << a.own_count;
      } else {
        wait_readers(region.done_flag(mine, parity, b), b);
      }
      a.own[a.own_count++] = region.ready_flag(mine, parity, b);
      if (!progress.verified) a.done[a.done_count++] = region.done_flag(ctx.peers.regions[b], parity, rank);
    }
  }
  a.epoch = static_cast<uint32_t>(ctx.epoch);
  a.site = ctx.site;
  a.rank = static_cast<uint32_t>(rank);
  a.world = static_cast<uint32_t>(world);
  a.wd = ctx.wd;
  JO_RETURN_IF_HIP_ERROR(launch_flag_abandon(a, origin));
  return {};
}

// abandon() with its failure added to the call's error: then the peers wait for the watchdog.
Status abandoned(const Status& failed, const Status& abandoning) {
  if (abandoning.ok()) return failed;
  return Status{failed.message + "; abandoning the call's epoch failed too (the peers wait for their watchdog): " +
                abandoning.message};
}

}  // namespace

uint64_t scratch_bytes(OpKind op, int world, int64_t batch, int64_t m, int64_t n, int elem_bytes, bool loopback) {
  if (world <= 1) return blas::kWorkspaceBytes;
  uint64_t bytes = 2 * blas::kWorkspaceBytes;
  if (op == OpKind::kMatmulRs) {
    const uint64_t block = static_cast<uint64_t>(batch) * (m / world) * n * elem_bytes;
    bytes += (world - 1) * block;  // the peers' partials of my block
    if (loopback) bytes += static_cast<uint64_t>(batch) * m * n * elem_bytes;  // stand-in staging
  }
  return bytes;
}

uint64_t region_bytes(OpKind op, int world, int64_t batch, int64_t m, int64_t k, int64_t n, int elem_bytes) {
  if (world <= 1) return 0;
  if (op == OpKind::kAgMatmul) return GatherRegion::make(world, static_cast<uint64_t>(batch) * m * k * elem_bytes).total;
  return ReduceRegion::make(world, static_cast<uint64_t>(batch) * m * n * elem_bytes).total;
}

Status check_stages(OpKind op, int world, const int64_t* stages, int stage_count) {
  int64_t total = 0;
  for (int j = 0; j < stage_count; ++j) {
    if (stages[j] < 1) return Status{"jax_overlap: a pipelined stage must have at least one chunk"};
    total += stages[j];
  }
  if (total != world)
    return Status{"jax_overlap: the pipelined stages cover " + std::to_string(total) + " chunks, expected " +
                  std::to_string(world)};
  if (op == OpKind::kAgMatmul && stages[0] != 1)
    return Status{"jax_overlap: ag_matmul's first pipelined stage must be its own shard alone"};
  return {};
}

Status run_call(OpKind kind, const Operands& op, Context ctx, EpochCounter& epochs, hipStream_t origin) {
  std::lock_guard<std::mutex> lock(ctx.streams->mu);
  ctx.epoch = epochs.count + 1;  // the epoch the call takes: its plans use its parity's slot
  const Status planned = kind == OpKind::kAgMatmul ? make_ag_plans(op, ctx) : make_rs_plans(op, ctx);
  ctx.epoch = epochs.next();
  ctx.slot_used = epochs.slot_used(ctx.epoch);
  Progress progress;
  Status enqueued = planned;
  if (planned.ok())
    enqueued = kind == OpKind::kAgMatmul ? enqueue_ag(op, ctx, &progress, origin)
                                         : enqueue_rs(op, ctx, &progress, origin);
  if (enqueued.ok()) return {};
  return abandoned(enqueued, abandon(kind, op, ctx, progress, origin));
}

Status abandon_call(OpKind kind, const Operands& op, Context ctx, EpochCounter& epochs, hipStream_t origin) {
  std::unique_lock<std::mutex> lock;
  if (ctx.streams != nullptr) lock = std::unique_lock<std::mutex>(ctx.streams->mu);
  ctx.epoch = epochs.next();
  ctx.slot_used = epochs.slot_used(ctx.epoch);
  return abandon(kind, op, ctx, Progress{}, origin);
}

Status enqueue_ag_matmul(const Operands& op, const Context& ctx, hipStream_t origin) {
  std::lock_guard<std::mutex> lock(ctx.streams->mu);
  Progress progress;
  return enqueue_ag(op, ctx, &progress, origin);
}

Status enqueue_matmul_rs(const Operands& op, const Context& ctx, hipStream_t origin) {
  std::lock_guard<std::mutex> lock(ctx.streams->mu);
  Progress progress;
  return enqueue_rs(op, ctx, &progress, origin);
}

Status enqueue_local_gemm(const Operands& op, blas::DeviceBlas& blas, hipStream_t stream) {
  // Leading batch dims fold into the rows: x and y are dense.
  const int64_t rows = op.batch * op.m;
  const blas::GemmShape shape{op.dtype, rows, op.n, op.k, 1, op.k, op.n, 0, 0, op.w_kmajor, op.bias != nullptr,
                              blas::alignment_of({op.x, op.w, op.bias, op.out})};
  const blas::GemmPlan* plan = nullptr;
  JO_RETURN_IF_ERROR(blas.plan(shape, &plan));
  return blas.run(*plan, op.x, op.w, op.bias, op.out, op.scratch, stream);
}

}  // namespace jo::pipelined
