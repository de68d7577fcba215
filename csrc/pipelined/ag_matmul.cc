// ag_matmul's part of the pipelined schedule (schedule.h): its shard published
// on the copy stream and pulled from every peer in ring order, its stages'
// GEMMs over the gathered rows as they arrive.
#include "core/block_scales.h"
#include "pipelined/layout.h"
#include "pipelined/schedule_core.h"

namespace jo::pipelined::ag_matmul {
namespace {

// A slot header's bytes: the shard's x scales, which travel with it (none for 16-bit x; one float for tensor
// scales; block scales [k/128][m] of a shard of m rows, the batch 1).
uint64_t header_bytes(bool scaled, bool blocks, int64_t m, int64_t k) {
  if (blocks) return align_up(static_cast<uint64_t>(x_block_scales(m, k)) * sizeof(float), kRegionAlign);
  return scaled ? kRegionAlign : 0;
}

// The operands' tensors as row ranges, and the call's region in every rank's workspace.
struct AgCall {
  RowRange x, gathered, y;
  uint64_t shard_bytes;
  bool scaled, blocks;
  // Tensor scales: each rank's own (it travels in the slot header, and each shard's GEMM takes its shard's), or
  // one that every rank shares (none travels; a stage's shards are one GEMM with op.x_scale).
  bool own_tensor_scales, shared_tensor_scale;
  int64_t scale_floats;  // block scales: one shard's x scales, [k/128][m]; else 0
  GatherRegion region;

  AgCall(const Operands& op, const Context& ctx)
      : x{static_cast<char*>(const_cast<void*>(op.x)), op.gemm.rows, op.gemm.k, element_bytes(op.gemm.types.x)},
        gathered{static_cast<char*>(op.gathered), ctx.peers.world * op.gemm.rows, op.gemm.k, x.elem_bytes},
        y{static_cast<char*>(op.out), ctx.peers.world * op.gemm.rows, op.gemm.n, element_bytes(op.gemm.types.out)},
        shard_bytes(static_cast<uint64_t>(op.gemm.batch) * op.gemm.rows * op.gemm.k * x.elem_bytes),
        scaled(op.gemm.types.scaled),
        blocks(op.gemm.types.blocks),
        own_tensor_scales(scaled && !blocks && !op.x_scale_shared),
        shared_tensor_scale(scaled && !blocks && op.x_scale_shared),
        scale_floats(blocks ? x_block_scales(op.gemm.rows, op.gemm.k) : 0),
        region(GatherRegion::make(ctx.peers.world, shard_bytes,
                                  header_bytes(scaled, blocks, op.gemm.rows, op.gemm.k))) {}

  uint64_t scale_bytes() const { return static_cast<uint64_t>(scale_floats) * sizeof(float); }
  // Tensor scales: each shard's on a slot of its own in the scratch after the workspaces (gathered_scales'
  // floats are 4 bytes apart).
  float* scale_slots(const Operands& op) const {
    return reinterpret_cast<float*>(static_cast<char*>(op.scratch) + 2 * blas::kWorkspaceBytes);
  }
  // The x scales of each gathered shard's GEMM (one GEMM per shard), or none (one GEMM per range of shards,
  // with op.x_scale: 16-bit x, or tensor scales every rank shares): tensor scales on their slots, block scales in
  // gathered_scales itself (each shard's whole 16-byte vectors: m a multiple of 4).
  UnitScales shard_scales(const Operands& op) const {
    if (blocks) return {op.gathered_scales, scale_floats};
    return own_tensor_scales ? UnitScales{scale_slots(op), blas::kScaleSlot} : UnitScales{};
  }
  // Where shard s's block scales land in gathered_scales.
  float* gathered_scales(const Operands& op, int shard) const { return op.gathered_scales + shard * scale_floats; }
};

}  // namespace

uint64_t region_bytes(int world, int64_t batch, int64_t m, int64_t k, int x_bytes, bool scaled, bool blocks) {
  return GatherRegion::make(world, static_cast<uint64_t>(batch) * m * k * x_bytes, header_bytes(scaled, blocks, m, k))
      .total;
}

Status check_stages(const int64_t* stages) {
  if (stages[0] != 1) return Status{"jax_overlap: ag_matmul's first pipelined stage must be its own shard alone"};
  return {};
}

Status make_plans(const Operands& op, const Context& ctx) {
  const AgCall c(op, ctx);
  const int rank = ctx.peers.rank;
  const int64_t m = op.gemm.rows;
  JO_RETURN_IF_ERROR(chunk_gemm(op, ctx, c.x, 0, c.y, rank * m, m, ChunkPart{true, op.x_scale}, 0, /*enqueue=*/false));
  for (int j = 1, position = 1; j < op.stage_count; position += static_cast<int>(op.stages[j]), ++j) {
    const UnitRanges units = stage_units(rank, position, static_cast<int>(op.stages[j]), ctx.peers.world);
    JO_RETURN_IF_ERROR(
        stage_gemms(op, ctx, c.gathered, c.y, m, units, true, c.shard_scales(op), j % 2, /*enqueue=*/false));
  }
  return {};
}

void abandon_flags(const Operands& op, const Context& ctx, const Progress& progress, FlagAbandon* a) {
  const GatherRegion region = AgCall(op, ctx).region;
  const auto [world, rank, parity] = ring_place(ctx);
  char* mine = ctx.peers.regions[rank];
  a->own[a->own_count++] = region.pub_flag(mine, parity);
  a->released = progress.released;
  for (int q = 0; q < world && progress.released == 0; ++q)
    if (q != rank) wait_readers_before_marking(ctx, region.done_flag(mine, parity, q), q, a);
  for (int q = 0; q < world && !progress.verified; ++q)
    if (q != rank)
      release_done_after(region.done_flag(ctx.peers.regions[q], parity, rank),
                         region.pub_flag(ctx.peers.regions[q], parity), q, a);
}

Status enqueue(const Operands& op, const Context& ctx, Progress* progress, hipStream_t origin) {
  SideStreams& s = *ctx.streams;
  const auto [world, rank, parity] = ring_place(ctx);
  const int64_t m = op.gemm.rows;
  const AgCall c(op, ctx);
  // Copy stream, first: its copies within this GPU (the publish, my own rows of `gathered`) run on SMs, so
  // enqueued after the first GEMM they would wait for its last wave (and the peers' pulls for the publish).
  // Its one wait before the first GEMM's launch, for the slot's readers, ends with the peers' work of calls two
  // epochs old, never with this call's (the launch of a kernel not loaded yet waits for the running kernels).
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
    if (c.blocks) {  // whole 16-byte vectors (m a multiple of 4): the copy path's
      JO_RETURN_IF_ERROR(copy_bytes(ctx.copy_path, c.region.scales(mine, parity), op.x_scale, c.scale_bytes(), s.copy));
    } else if (c.own_tensor_scales) {  // a shared scale: the peers have it already
      const ScaleCopy header{{op.x_scale}, {c.region.scales(mine, parity)}, 1};
      JO_RETURN_IF_HIP_ERROR(launch_copy_scales(header, s.copy));
    }
    JO_RETURN_IF_ERROR(release(pub, ctx.epoch, ctx.site, s.copy));
    progress->released = 1;
    JO_RETURN_IF_ERROR(fail_after_release_if_asked(rank));
  }
  JO_RETURN_IF_ERROR(copy_rows(ctx.copy_path, c.gathered.at(rank * m), c.gathered.batch_stride(), c.x.base,
                               c.x.batch_stride(), op.gemm.batch, m, op.gemm.k, c.x.elem_bytes, s.copy));
  if (c.blocks)
    JO_RETURN_IF_ERROR(copy_bytes(ctx.copy_path, c.gathered_scales(op, rank), op.x_scale, c.scale_bytes(), s.copy));

  // Compute stream 0: my own shard straight from x.
  JO_RETURN_IF_ERROR(
      chunk_gemm(op, ctx, c.x, 0, c.y, rank * m, m, ChunkPart{/*bias=*/true, op.x_scale}, /*stream_index=*/0));

  // Copy stream, then: (tensor scales of their own: the peers' scales,) the peers' shards in ring order (block
  // scales: each with its scales).
  if (!ctx.loopback) {
    for (int i = 1; i < world; ++i) {
      const int q = (rank + i) % world;
      pulled[i - 1] = c.region.pub_flag(ctx.peers.regions[q], parity);
      done[i - 1] = c.region.done_flag(ctx.peers.regions[q], parity, rank);
      owners[i - 1] = static_cast<uint32_t>(q);
    }
    JO_RETURN_IF_ERROR(wait_flags(ctx, pulled, owners, world - 1, ctx.epoch, ctx.site, WaitOn::kPublished, s.copy));
  }
  if (c.own_tensor_scales) {
    // Every shard's scale into its slot, read from the peers' slot headers after the wait for their pub
    // flags (in loopback my own scale stands in for theirs; the check after the pulls covers them as it does
    // the shards), then from the slots into gathered_scales, the result.
    float* slots = c.scale_slots(op);
    ScaleCopy scales{}, result{};
    for (int q = 0; q < world; ++q) {
      scales.src[q] = q == rank || ctx.loopback ? op.x_scale : c.region.scales(ctx.peers.regions[q], parity);
      result.src[q] = scales.dst[q] = slots + q * blas::kScaleSlot;
      result.dst[q] = op.gathered_scales + q;
    }
    scales.count = result.count = world;
    JO_RETURN_IF_HIP_ERROR(launch_copy_scales(scales, s.copy));
    JO_RETURN_IF_HIP_ERROR(launch_copy_scales(result, s.copy));
  }
  if (!ctx.loopback) JO_RETURN_IF_ERROR(pause_if_asked(s.copy));
  for (int i = 1; i < world; ++i) {
    const int shard = (rank + i) % world;
    // Block scales: the shard's scales before its rows, both before arrived[i], which its GEMM waits for (in
    // loopback my own stand in for the peer's, as x does).
    if (c.blocks)
      JO_RETURN_IF_ERROR(copy_bytes(ctx.copy_path, c.gathered_scales(op, shard),
                                    ctx.loopback ? op.x_scale : c.region.scales(ctx.peers.regions[shard], parity),
                                    c.scale_bytes(), s.copy));
    const char* src = ctx.loopback ? c.x.base : c.region.slot(ctx.peers.regions[shard], parity);
    JO_RETURN_IF_ERROR(copy_rows(ctx.copy_path, c.gathered.at(shard * m), c.gathered.batch_stride(), src,
                                 c.x.batch_stride(), op.gemm.batch, m, op.gemm.k, c.x.elem_bytes, s.copy));
    JO_RETURN_IF_ERROR(s.record(s.arrived[i], s.copy));
  }
  if (!ctx.loopback) {
    // One check of every peer's pub flag after all pulls, then the done flags (their writers need them
    // only when they publish into this parity's slot again, two calls later).
    JO_RETURN_IF_ERROR(verify_and_release(ctx, pulled, done, owners, world - 1, s.copy));
    progress->verified = true;
  }
  if (c.shared_tensor_scale) {
    // Every shard's scale is mine: gathered_scales from my own, after the pulls (no GEMM reads it).
    ScaleCopy result{};
    for (int q = 0; q < world; ++q) result.src[q] = op.x_scale, result.dst[q] = op.gathered_scales + q;
    result.count = world;
    JO_RETURN_IF_HIP_ERROR(launch_copy_scales(result, s.copy));
  }

  // Compute streams: each stage once its last shard arrived.
  for (int j = 1, position = 1; j < op.stage_count; position += static_cast<int>(op.stages[j]), ++j) {
    const int size = static_cast<int>(op.stages[j]);
    JO_RETURN_IF_ERROR(s.wait(s.compute[j % 2], s.arrived[position + size - 1]));
    const UnitRanges units = stage_units(rank, position, size, world);
    JO_RETURN_IF_ERROR(stage_gemms(op, ctx, c.gathered, c.y, m, units, /*bias=*/true, c.shard_scales(op), j % 2));
  }
  JO_RETURN_IF_ERROR(s.join_into(origin, progress->forked));
  progress->forked = 0;
  if (ctx.wd.abort != nullptr) {
    const GemmTypes& t = op.gemm.types;
    const PoisonArea areas[] = {
        {op.out, static_cast<uint64_t>(op.gemm.batch) * world * m * op.gemm.n * c.y.elem_bytes, nan_fill_byte(t.out)},
        {op.gathered, static_cast<uint64_t>(world) * c.shard_bytes, nan_fill_byte(t.x)},
        {op.gathered_scales, world * (c.blocks ? c.scale_bytes() : c.scaled ? sizeof(float) : 0),
         nan_fill_byte(DType::kF32)}};
    JO_RETURN_IF_HIP_ERROR(launch_poison_if_aborted(ctx.wd.abort, areas, 3, origin));
  }
  return {};
}

}  // namespace jo::pipelined::ag_matmul
