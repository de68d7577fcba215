#include "pipelined/schedule.h"

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

// Copy-engine copy of `rows` rows per batch element (batch pieces, `batch` pitched 2-D copy).
Status copy_rows(char* dst, int64_t dst_batch_stride, const char* src, int64_t src_batch_stride, int64_t batch,
                 int64_t rows, int64_t cols, hipStream_t stream) {
  const size_t width = static_cast<size_t>(rows * cols * kElem);
  if (batch == 1) {
    JO_RETURN_IF_HIP_ERROR(hipMemcpyAsync(dst, src, width, gpu::kCopyEngineCopy, stream));
  } else {
    JO_RETURN_IF_HIP_ERROR(hipMemcpy2DAsync(dst, static_cast<size_t>(dst_batch_stride * kElem), src,
                                            static_cast<size_t>(src_batch_stride * kElem), width,
                                            static_cast<size_t>(batch), gpu::kCopyEngineCopy, stream));
  }
  return {};
}

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
// for it, else one GEMM each.
Status gemm(const Operands& op, const Context& ctx, const RowRange& x, int64_t x_first, const RowRange& out,
            int64_t out_first, int64_t rows, bool bias, int stream_index) {
  const char* a = x.at(x_first);
  char* d = out.at(out_first);
  const void* b = bias ? op.bias : nullptr;
  void* workspace = static_cast<char*>(op.scratch) + stream_index * blas::kWorkspaceBytes;
  const hipStream_t stream = ctx.streams->compute[stream_index];
  blas::GemmShape shape{op.dtype,       rows,         op.n,       op.k,       op.batch, x.cols, out.cols,
                        x.batch_stride(), out.batch_stride(), op.w_kmajor, b != nullptr,
                        blas::alignment_of({a, d, op.w, b})};
  // Fault "pipelined_plan_fail[=rank]": the vendor GEMM plans cannot be made.
  if (fault_hits("pipelined_plan_fail", ctx.peers.rank))
    return Status{"jax_overlap: fault pipelined_plan_fail: no vendor GEMM plan"};
  const blas::GemmPlan* plan = nullptr;
  const Status batched = ctx.blas->plan(shape, &plan);
  if (batched.ok()) return ctx.blas->run(*plan, a, op.w, b, d, workspace, stream);
  if (op.batch == 1) return batched;
  shape.batch = 1;
  for (int64_t e = 0; e < op.batch; ++e) {
    const char* ae = a + e * x.batch_stride() * kElem;
    char* de = d + e * out.batch_stride() * kElem;
    shape.alignment = blas::alignment_of({ae, de, op.w, b});
    JO_RETURN_IF_ERROR(ctx.blas->plan(shape, &plan));
    JO_RETURN_IF_ERROR(ctx.blas->run(*plan, ae, op.w, b, de, workspace, stream));
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

Status enqueue_ag_matmul(const Operands& op, const Context& ctx, hipStream_t origin) {
  SideStreams& s = *ctx.streams;
  std::lock_guard<std::mutex> lock(s.mu);
  const int world = ctx.peers.world;
  const int rank = ctx.peers.rank;
  const int parity = static_cast<int>(ctx.epoch & 1u);
  const uint64_t shard_bytes = static_cast<uint64_t>(op.batch) * op.m * op.k * kElem;
  const GatherRegion region = GatherRegion::make(world, shard_bytes);
  const RowRange x{static_cast<char*>(const_cast<void*>(op.x)), op.m, op.k};
  const RowRange gathered{static_cast<char*>(op.gathered), world * op.m, op.k};
  const RowRange y{static_cast<char*>(op.out), world * op.m, op.n};
  char* mine = ctx.peers.regions[rank];
  JO_RETURN_IF_ERROR(s.fork_from(origin));
  // My own shard straight from x, first: nothing of this call waits yet when it is launched (the launch
  // of a kernel not loaded yet waits for the device's running kernels).
  JO_RETURN_IF_ERROR(gemm(op, ctx, x, 0, y, rank * op.m, op.m, /*bias=*/true, /*stream_index=*/0));

  // Copy stream: publish my shard, then pull the peers' in ring order.
  if (!ctx.loopback) {
    const PipeFlag* flags[kMaxWorld];
    uint32_t peers[kMaxWorld];
    int count = 0;
    if (ctx.slot_used) {  // the readers of this slot two calls ago
      for (int q = 0; q < world; ++q)
        if (q != rank) flags[count] = region.done_flag(mine, parity, q), peers[count++] = q;
      JO_RETURN_IF_ERROR(
          wait_flags(ctx, flags, peers, count, ctx.epoch - 2, 0, WaitOn::kReadersDone, s.copy));
    }
    JO_RETURN_IF_ERROR(mark_rewriting(region.pub_flag(mine, parity), s.copy));
    JO_RETURN_IF_HIP_ERROR(hipMemcpyAsync(region.slot(mine, parity), op.x, shard_bytes, gpu::kCopyEngineCopy, s.copy));
    JO_RETURN_IF_ERROR(release(region.pub_flag(mine, parity), ctx.epoch, ctx.site, s.copy));
    JO_RETURN_IF_ERROR(fail_after_release_if_asked(rank));
    count = 0;
    for (int i = 1; i < world; ++i) {
      const int q = (rank + i) % world;
      flags[count] = region.pub_flag(ctx.peers.regions[q], parity), peers[count++] = q;
    }
    JO_RETURN_IF_ERROR(wait_flags(ctx, flags, peers, count, ctx.epoch, ctx.site, WaitOn::kPublished, s.copy));
    JO_RETURN_IF_ERROR(pause_if_asked(s.copy));
  }
  const PipeFlag* pulled[kMaxWorld];
  PipeFlag* done[kMaxWorld];
  uint32_t owners[kMaxWorld];
  for (int i = 1; i < world; ++i) {
    const int shard = (rank + i) % world;
    char* theirs = ctx.peers.regions[shard];
    const char* src = ctx.loopback ? x.base : region.slot(theirs, parity);
    JO_RETURN_IF_ERROR(copy_rows(gathered.at(shard * op.m), gathered.batch_stride(), src, x.batch_stride(), op.batch,
                                 op.m, op.k, s.copy));
    JO_RETURN_IF_HIP_ERROR(hipEventRecord(s.arrived[i], s.copy));
    pulled[i - 1] = region.pub_flag(theirs, parity);
    done[i - 1] = region.done_flag(theirs, parity, rank);
    owners[i - 1] = static_cast<uint32_t>(shard);
  }
  // One check of every peer's pub flag after the pulls, then the done flags (their writers need them only
  // when they publish into this parity's slot again, two calls later).
  if (!ctx.loopback) JO_RETURN_IF_ERROR(verify_and_release(ctx, pulled, done, owners, world - 1, s.copy));
  JO_RETURN_IF_ERROR(copy_rows(gathered.at(rank * op.m), gathered.batch_stride(), x.base, x.batch_stride(), op.batch,
                               op.m, op.k, s.copy));

  // Compute streams: each stage once its last shard arrived.
  for (int j = 1, position = 1; j < op.stage_count; position += static_cast<int>(op.stages[j]), ++j) {
    const int size = static_cast<int>(op.stages[j]);
    JO_RETURN_IF_HIP_ERROR(hipStreamWaitEvent(s.compute[j % 2], s.arrived[position + size - 1], 0));
    const UnitRanges units = stage_units(rank, position, size, world);
    for (int u = 0; u < units.n; ++u)
      JO_RETURN_IF_ERROR(gemm(op, ctx, gathered, units.first[u] * op.m, y, units.first[u] * op.m,
                              units.count[u] * op.m, /*bias=*/true, j % 2));
  }
  JO_RETURN_IF_ERROR(s.join_into(origin));
  if (ctx.wd.abort != nullptr)
    JO_RETURN_IF_HIP_ERROR(launch_poison_if_aborted(ctx.wd.abort, op.out, static_cast<uint64_t>(op.batch) * world *
                                                                             op.m * op.n * kElem,
                                                    op.gathered, static_cast<uint64_t>(world) * shard_bytes, origin));
  return {};
}

Status enqueue_matmul_rs(const Operands& op, const Context& ctx, hipStream_t origin) {
  SideStreams& s = *ctx.streams;
  std::lock_guard<std::mutex> lock(s.mu);
  const int world = ctx.peers.world;
  const int rank = ctx.peers.rank;
  const int parity = static_cast<int>(ctx.epoch & 1u);
  const int64_t block_rows = op.m / world;
  const uint64_t block_bytes = static_cast<uint64_t>(op.batch) * block_rows * op.n * kElem;
  const ReduceRegion region = ReduceRegion::make(world, static_cast<uint64_t>(op.batch) * op.m * op.n * kElem);
  char* mine = ctx.peers.regions[rank];
  char* received = static_cast<char*>(op.scratch) + 2 * blas::kWorkspaceBytes;  // the peers' partials, q != rank
  auto received_block = [&](int q) { return received + (q < rank ? q : q - 1) * block_bytes; };
  const RowRange x{static_cast<char*>(const_cast<void*>(op.x)), op.m, op.k};
  const RowRange partial{ctx.loopback ? received + (world - 1) * block_bytes : region.partial(mine, parity), op.m,
                         op.n};
  JO_RETURN_IF_ERROR(s.fork_from(origin));

  // Compute streams: ring position p is row block (rank + 1 + p) % world, my own last.
  for (int j = 0, position = 0; j < op.stage_count; position += static_cast<int>(op.stages[j]), ++j) {
    const hipStream_t stream = s.compute[j % 2];
    const UnitRanges units = stage_units(rank + 1, position, static_cast<int>(op.stages[j]), world);
    const PipeFlag* flags[kMaxWorld];
    uint32_t owners[kMaxWorld];
    int count = 0;
    for (int u = 0; u < units.n; ++u)
      for (int b = units.first[u]; b < units.first[u] + units.count[u]; ++b)
        if (b != rank) flags[count] = region.done_flag(mine, parity, b), owners[count++] = b;
    if (!ctx.loopback && ctx.slot_used)  // the blocks' owners pulled this slot two calls ago
      JO_RETURN_IF_ERROR(wait_flags(ctx, flags, owners, count, ctx.epoch - 2, 0, WaitOn::kReadersDone, stream));
    for (int i = 0; i < count && !ctx.loopback; ++i)
      JO_RETURN_IF_ERROR(mark_rewriting(region.ready_flag(mine, parity, static_cast<int>(owners[i])), stream));
    for (int u = 0; u < units.n; ++u)
      JO_RETURN_IF_ERROR(gemm(op, ctx, x, units.first[u] * block_rows, partial, units.first[u] * block_rows,
                              units.count[u] * block_rows, /*bias=*/false, j % 2));
    for (int i = 0; i < count && !ctx.loopback; ++i) {
      JO_RETURN_IF_ERROR(release(region.ready_flag(mine, parity, static_cast<int>(owners[i])), ctx.epoch, ctx.site,
                                 stream));
      JO_RETURN_IF_ERROR(fail_after_release_if_asked(rank));
    }
  }

  // Copy stream: my block from each peer, in the order they compute it.
  const PipeFlag* pulled[kMaxWorld];
  PipeFlag* done[kMaxWorld];
  uint32_t stagers[kMaxWorld];
  for (int i = 1; i < world; ++i) {
    const int q = (rank - i + world) % world;
    char* theirs = ctx.peers.regions[q];
    const char* src = partial.at(rank * block_rows);
    pulled[i - 1] = region.ready_flag(theirs, parity, rank);
    done[i - 1] = region.done_flag(theirs, parity, rank);
    stagers[i - 1] = static_cast<uint32_t>(q);
    if (!ctx.loopback) {
      JO_RETURN_IF_ERROR(
          wait_flags(ctx, &pulled[i - 1], &stagers[i - 1], 1, ctx.epoch, ctx.site, WaitOn::kPartialReady, s.copy));
      if (i == 1) JO_RETURN_IF_ERROR(pause_if_asked(s.copy));
      src = region.partial(theirs, parity) + rank * block_rows * op.n * kElem;
    }
    JO_RETURN_IF_ERROR(copy_rows(received_block(q), block_rows * op.n, src, partial.batch_stride(), op.batch,
                                 block_rows, op.n, s.copy));
  }
  if (!ctx.loopback) JO_RETURN_IF_ERROR(verify_and_release(ctx, pulled, done, stagers, world - 1, s.copy));
  JO_RETURN_IF_ERROR(s.join_into(origin));

  ReduceArgs r{};
  r.dtype = op.dtype;
  for (int q = 0; q < world; ++q) {
    r.partials[q] = q == rank ? partial.at(rank * block_rows) : received_block(q);
    r.partial_batch_stride[q] = q == rank ? partial.batch_stride() : block_rows * op.n;
  }
  r.count = world;
  r.bias = op.bias;
  r.out = op.out;
  r.batch = op.batch;
  r.rows = block_rows;
  r.n = op.n;
  r.abort = ctx.wd.abort;
  JO_RETURN_IF_HIP_ERROR(launch_reduce(r, ctx.sm_count, origin));
  return {};
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
