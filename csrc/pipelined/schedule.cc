// The pipelined schedule's shared core (schedule.h, schedule_core.h).
#include "pipelined/schedule.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>

#include "core/block_scales.h"
#include "pipelined/schedule_core.h"
#include "runtime/faults.h"

namespace jo::pipelined {
namespace {

// Whether fault `name` (runtime/faults.h) hits group rank `rank`: the fault
// names the rank as its value, or has no value (every rank of the process).
bool fault_hits(const char* name, int rank) {
  if (!faults::enabled(name)) return false;
  const int64_t only = faults::value(name, -1);
  return only < 0 || only == rank;
}

// Fault "pipelined_plan_fail[=rank]": the vendor GEMM plans of the call cannot be made.
Status plan_fault(int rank) {
  if (!fault_hits("pipelined_plan_fail", rank)) return {};
  return Status{"jax_overlap: fault pipelined_plan_fail: no vendor GEMM plan"};
}

// The fields the verify and abandon kernels' arguments share: ctx's epoch (its low bits), site,
// rank, world and watchdog.
template <class FlagArgs>
void set_call_fields(FlagArgs& a, const Context& ctx) {
  a.epoch = static_cast<uint32_t>(ctx.epoch);
  a.site = ctx.site;
  a.rank = static_cast<uint32_t>(ctx.peers.rank);
  a.world = static_cast<uint32_t>(ctx.peers.world);
  a.wd = ctx.wd;
}

Status no_schedule(OpKind kind) {
  return Status{std::string("jax_overlap: ") + op_name(kind) + " has no pipelined schedule"};
}

// The plans of every GEMM the op's enqueue runs (schedule_core.h make_plans).
Status make_plans(OpKind kind, const Operands& op, const Context& ctx) {
  JO_RETURN_IF_ERROR(plan_fault(ctx.peers.rank));
  JO_RETURN_IF_ERROR(check_block_scales(kind, ctx.peers.world, op.gemm));
  switch (kind) {
    case OpKind::kAgMatmul: return ag_matmul::make_plans(op, ctx);
    case OpKind::kMatmulRs: return matmul_rs::make_plans(op, ctx);
    case OpKind::kAllGather: break;
  }
  return no_schedule(kind);
}

Status enqueue_op(OpKind kind, const Operands& op, const Context& ctx, Progress* progress, hipStream_t origin) {
  const StreamSet used = streams_used(kind, op);
  JO_RETURN_IF_ERROR(ctx.streams->fork_from(origin, used));
  progress->forked = used;
  switch (kind) {
    case OpKind::kAgMatmul: return ag_matmul::enqueue(op, ctx, progress, origin);
    case OpKind::kMatmulRs: return matmul_rs::enqueue(op, ctx, progress, origin);
    case OpKind::kAllGather: break;
  }
  return no_schedule(kind);
}

// Ends ctx's epoch for the peers after this rank failed to run its part (pipeline_kernels.h
// FlagAbandon): on `origin`, after whatever the call enqueued (joined back first).
Status abandon(OpKind kind, const Operands& op, const Context& ctx, const Progress& progress, hipStream_t origin) {
  if (progress.forked) JO_RETURN_IF_ERROR(ctx.streams->join_into(origin, progress.forked));
  FlagAbandon a{};
  switch (kind) {
    case OpKind::kAgMatmul: ag_matmul::abandon_flags(op, ctx, progress, &a); break;
    case OpKind::kMatmulRs: matmul_rs::abandon_flags(op, ctx, progress, &a); break;
    case OpKind::kAllGather: return no_schedule(kind);
  }
  set_call_fields(a, ctx);
  JO_RETURN_IF_HIP_ERROR(launch_flag_abandon(a, origin));
  return {};
}

// abandon() with its failure added to the call's error: then the peers wait for the watchdog.
Status abandoned(const Status& failed, const Status& abandoning) {
  if (abandoning.ok()) return failed;
  return Status{failed.message + "; abandoning the call's epoch failed too (the peers wait for their watchdog): " +
                abandoning.message};
}

// The plan of `problem`: the next of ctx.plans once run_call's make_plans filled it (a problem other than the
// listed one, as a batched GEMM's per-element fallback, is looked up), else looked up (and listed while filling).
Status plan_of(const Context& ctx, const GemmProblem& problem, const blas::GemmPlan** out) {
  PlanList* list = ctx.plans;
  if (list != nullptr && !list->filling && list->next < list->plans.size() &&
      list->plans[list->next]->problem() == problem) {
    *out = list->plans[list->next++];
    return {};
  }
  JO_RETURN_IF_ERROR(ctx.blas->plan(problem, out));
  if (list != nullptr && list->filling) list->plans.push_back(*out);
  return {};
}

}  // namespace

UnitRanges stage_units(int first_unit, int position, int size, int world) {
  UnitRanges r{};
  // A stage of every unit is one range from unit 0: nothing of it is released before all of it is done, so the
  // order of its units does not matter, and one GEMM of all rows beats two.
  for (int unit = size == world ? 0 : (first_unit + position) % world, left = size; left > 0; r.n++) {
    r.first[r.n] = unit;
    r.count[r.n] = left < world - unit ? left : world - unit;
    left -= r.count[r.n];
    unit = 0;
  }
  return r;
}

Status pause_if_asked(hipStream_t stream) {
  const int64_t ms = faults::value("pipelined_pause_pull", 0);
  if (ms <= 0) return {};
  JO_RETURN_IF_HIP_ERROR(launch_pause(static_cast<uint64_t>(ms) * 1000 * gpu::kNominalTicksPerMicrosecond, stream));
  return {};
}

Status fail_after_release_if_asked(int rank) {
  if (!fault_hits("pipelined_fail_after_release", rank)) return {};
  return Status{"jax_overlap: fault pipelined_fail_after_release: the call failed after its first release"};
}

Status mark_rewriting(PipeFlag* flag, hipStream_t stream) {
  JO_RETURN_IF_HIP_ERROR(gpu::stream_write_u32(stream, &flag->site, kSiteRewriting));
  return {};
}

Status release(PipeFlag* flag, uint64_t epoch, uint32_t site, hipStream_t stream) {
  JO_RETURN_IF_HIP_ERROR(gpu::stream_write_u32(stream, &flag->epoch, static_cast<uint32_t>(epoch)));
  JO_RETURN_IF_HIP_ERROR(gpu::stream_write_u32(stream, &flag->site, site));
  return {};
}

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
  set_call_fields(v, ctx);
  JO_RETURN_IF_HIP_ERROR(launch_flag_verify(v, stream));
  return {};
}

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

Status chunk_gemm(const Operands& op, const Context& ctx, const RowRange& x, int64_t x_first, const RowRange& out,
                  int64_t out_first, int64_t rows, const ChunkPart& part, int stream_index, bool enqueue) {
  const GemmProblem& g = op.gemm;
  const char* w = static_cast<const char*>(op.w);
  const char* a = x.at(x_first);
  char* d = out.at(out_first);
  const void* b = part.bias ? op.bias : nullptr;
  void* workspace = static_cast<char*>(op.scratch) + stream_index * blas::kWorkspaceBytes;
  const hipStream_t stream = enqueue ? ctx.streams->compute[stream_index] : nullptr;
  const blas::Handle handle = enqueue ? ctx.streams->blas[stream_index] : nullptr;
  GemmProblem problem = g;
  problem.rows = rows;
  problem.ldx = x.cols;
  problem.ldy = out.cols;
  // Strides only where a batch uses them: one problem (one plan, one tuning) per GEMM however its rows are reached.
  problem.x_batch_stride = g.batch > 1 ? x.batch_stride() : 0;
  problem.y_batch_stride = g.batch > 1 ? out.batch_stride() : 0;
  problem.bias = b != nullptr;
  problem.alignment = blas::alignment_of({a, d, w, b});
  problem.sm_count = ctx.gemm_sms;
  if (ctx.collect != nullptr) {  // gemm_problems: the batched problem (the one a call plans first)
    ctx.collect->push_back(problem);
    return {};
  }
  const auto pointers = [&](const char* xe, char* ye) {
    return blas::GemmPointers{xe, w, b, part.x_scale, op.w_scale, ye};
  };
  const blas::GemmPlan* plan = nullptr;
  const Status batched = plan_of(ctx, problem, &plan);
  if (batched.ok()) return enqueue ? ctx.blas->run(*plan, pointers(a, d), workspace, stream, handle) : Status{};
  if (g.batch == 1) return batched;
  problem.batch = 1;
  problem.x_batch_stride = problem.y_batch_stride = 0;
  for (int64_t e = 0; e < g.batch; ++e) {
    const char* ae = a + e * x.batch_stride() * x.elem_bytes;
    char* de = d + e * out.batch_stride() * out.elem_bytes;
    problem.alignment = blas::alignment_of({ae, de, w, b});
    JO_RETURN_IF_ERROR(plan_of(ctx, problem, &plan));
    if (enqueue) JO_RETURN_IF_ERROR(ctx.blas->run(*plan, pointers(ae, de), workspace, stream, handle));
  }
  return {};
}

Status stage_gemms(const Operands& op, const Context& ctx, const RowRange& x, const RowRange& out, int64_t unit_rows,
                   const UnitRanges& units, bool bias, const UnitScales& scales, int stream_index, bool enqueue) {
  for (int r = 0; r < units.n; ++r) {
    const int first = units.first[r], count = units.count[r];
    if (scales.first == nullptr) {
      JO_RETURN_IF_ERROR(chunk_gemm(op, ctx, x, first * unit_rows, out, first * unit_rows, count * unit_rows,
                                    ChunkPart{bias, op.x_scale}, stream_index, enqueue));
      continue;
    }
    for (int u = first; u < first + count; ++u)
      JO_RETURN_IF_ERROR(chunk_gemm(op, ctx, x, u * unit_rows, out, u * unit_rows, unit_rows,
                                    ChunkPart{bias, scales.of(u)}, stream_index, enqueue));
  }
  return {};
}

void wait_readers_before_marking(const Context& ctx, const PipeFlag* done, int reader, FlagAbandon* a) {
  if (!ctx.slot_used) return;
  a->readers_done[a->reader_count] = done;
  a->readers[a->reader_count++] = static_cast<uint32_t>(reader);
}

void release_done_after(PipeFlag* done, const PipeFlag* after, int peer, FlagAbandon* a) {
  a->done_after[a->done_count] = after;
  a->done_peers[a->done_count] = static_cast<uint32_t>(peer);
  a->done[a->done_count++] = done;
}

uint64_t scratch_bytes(OpKind op, int world, int64_t batch, int64_t m, int64_t n, int partial_bytes, bool loopback) {
  if (world <= 1) return blas::kWorkspaceBytes;
  const uint64_t workspaces = 2 * blas::kWorkspaceBytes;  // one per compute stream
  switch (op) {
    case OpKind::kAgMatmul: return workspaces + ag_matmul::kScaleSlotsBytes;
    case OpKind::kMatmulRs: return workspaces + matmul_rs::receive_bytes(world, batch, m, n, partial_bytes, loopback);
    case OpKind::kAllGather: break;
  }
  return 0;
}

uint64_t region_bytes(OpKind op, int world, int64_t batch, int64_t m, int64_t k, int64_t n, int x_bytes,
                      int partial_bytes, bool scaled, bool blocks) {
  if (world <= 1) return 0;
  switch (op) {
    case OpKind::kAgMatmul: return ag_matmul::region_bytes(world, batch, m, k, x_bytes, scaled, blocks);
    case OpKind::kMatmulRs: return matmul_rs::region_bytes(world, batch, m, n, partial_bytes);
    case OpKind::kAllGather: break;
  }
  return 0;
}

int gemm_sm_count(int sm_count) {
  static const int margin = [] {
    const char* set = std::getenv("JAX_OVERLAP_GEMM_SM_MARGIN");
    return set != nullptr && *set != '\0' ? std::max(0, std::atoi(set)) : kGemmSmMargin;
  }();
  return margin > 0 && margin < sm_count ? sm_count - margin : 0;
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
  switch (op) {
    case OpKind::kAgMatmul: return ag_matmul::check_stages(stages);
    case OpKind::kMatmulRs: return {};
    case OpKind::kAllGather: break;
  }
  return no_schedule(op);
}

Status check_block_scales(OpKind op, int world, const GemmProblem& g) {
  if (!g.types.blocks) return {};
  const bool reduced = op == OpKind::kMatmulRs && world > 1;  // its reduction adds the bias, never a GEMM
  // Strings only on the error path: the FFI handlers run this on every call.
  const auto refused = [&](const std::string& what) {
    return Status{std::string("jax_overlap: ") + (world > 1 ? op_name(op) : "a group of one") +
                  " with float8 block scales takes " + what};
  };
  // cuBLASLt has no block-scaled GEMM with a bias epilogue (blas/gemm.cc).
  if (g.bias && !reduced) return refused("no bias (add it after the call)");
  if (world > 1 && g.batch != 1)
    return refused("x with no leading batch dims (each GEMM's x scales are contiguous), got " +
                   std::to_string(g.batch) + " batch elements");
  // Each GEMM's rows: a group of one folds the batch into them (enqueue_local_gemm); matmul_rs GEMMs row blocks.
  const char* rows_name = "m";
  int64_t rows = g.rows;
  if (world <= 1) {
    rows_name = "batch * m";
    rows = g.batch * g.rows;
  } else if (op == OpKind::kMatmulRs) {
    rows_name = "m / world";
    rows = g.rows / world;
  }
  if (rows % kScaleRowMultiple != 0)
    return refused("each GEMM's rows a multiple of " + std::to_string(kScaleRowMultiple) + ", got " + rows_name +
                   " = " + std::to_string(rows));
  return {};
}

Status run_call(OpKind kind, const Operands& op, Context ctx, EpochCounter& epochs, hipStream_t origin) {
  std::lock_guard<std::mutex> lock(ctx.streams->mu);
  ctx.epoch = epochs.count + 1;  // the epoch the call takes: its plans use its parity's slot
  PlanList plans;
  ctx.plans = &plans;
  const Status planned = make_plans(kind, op, ctx);
  plans.filling = false;
  ctx.epoch = epochs.next();
  ctx.slot_used = epochs.slot_used(ctx.epoch);
  Progress progress;
  Status enqueued = planned;
  if (planned.ok()) enqueued = enqueue_op(kind, op, ctx, &progress, origin);
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

Status enqueue(OpKind kind, const Operands& op, const Context& ctx, hipStream_t origin) {
  JO_RETURN_IF_ERROR(check_block_scales(kind, ctx.peers.world, op.gemm));
  std::lock_guard<std::mutex> lock(ctx.streams->mu);
  Progress progress;
  return enqueue_op(kind, op, ctx, &progress, origin);
}

GemmProblem local_problem(const Operands& op) {
  // Leading batch dims fold into the rows: x and y are dense (block scales: x's [k/128][batch * m]).
  GemmProblem problem = op.gemm;
  problem.rows = op.gemm.batch * op.gemm.rows;
  problem.batch = 1;
  problem.ldx = op.gemm.k;
  problem.ldy = op.gemm.n;
  problem.x_batch_stride = problem.y_batch_stride = 0;
  problem.bias = op.bias != nullptr;
  problem.alignment = blas::alignment_of({op.x, op.w, op.bias, op.out});
  return problem;
}

Status enqueue_local_gemm(const Operands& op, blas::DeviceBlas& blas, hipStream_t stream, blas::Handle handle,
                          const blas::GemmPlan* plan) {
  if (plan == nullptr) {
    JO_RETURN_IF_ERROR(check_block_scales(OpKind::kAgMatmul, /*world=*/1, op.gemm));
    JO_RETURN_IF_ERROR(blas.plan(local_problem(op), &plan));
  }
  return blas.run(*plan, blas::GemmPointers{op.x, op.w, op.bias, op.x_scale, op.w_scale, op.out}, op.scratch, stream,
                  handle);
}

StreamSet streams_used(OpKind kind, const Operands& op) {
  switch (kind) {
    case OpKind::kAgMatmul: return kCopy | kCompute0 | kCompute1;  // stage 0 alone, then at least one more
    case OpKind::kMatmulRs: return matmul_rs::streams_used(op);
    case OpKind::kAllGather: break;
  }
  return 0;
}

namespace {

// make_plans of the op on ctx (ctx.collect set: recording the problems).
Status op_plans(OpKind kind, const Operands& op, const Context& ctx) {
  switch (kind) {
    case OpKind::kAgMatmul: return ag_matmul::make_plans(op, ctx);
    case OpKind::kMatmulRs: return matmul_rs::make_plans(op, ctx);
    case OpKind::kAllGather: break;
  }
  return no_schedule(kind);
}

// `found` without repeats, in first-seen order, appended to `out`.
void append_unique(const std::vector<GemmProblem>& found, std::vector<GemmProblem>* out) {
  for (const GemmProblem& p : found)
    if (std::find(out->begin(), out->end(), p) == out->end()) out->push_back(p);
}

}  // namespace

Status gemm_problems(OpKind kind, const Operands& shape, int world, int sm_count, std::vector<GemmProblem>* out) {
  out->clear();
  // Stand-ins for XLA's buffers and the workspace's regions, each far apart and 2^32-byte aligned: every
  // pointer a GEMM gets has the alignment its offset gives it in a 256-byte aligned buffer.
  const auto at = [](uintptr_t slot) { return reinterpret_cast<char*>(slot << 32); };
  Operands op = shape;
  op.x = at(1);
  op.w = at(2);
  op.bias = op.gemm.bias ? at(3) : nullptr;
  op.x_scale = op.gemm.types.scaled ? reinterpret_cast<const float*>(at(4)) : nullptr;
  op.w_scale = op.gemm.types.scaled ? reinterpret_cast<const float*>(at(5)) : nullptr;
  op.out = at(6);
  op.gathered = at(7);
  op.gathered_scales = op.gemm.types.scaled ? reinterpret_cast<float*>(at(8)) : nullptr;
  op.scratch = at(9);
  if (world <= 1) {
    out->push_back(local_problem(op));
    return {};
  }
  JO_RETURN_IF_ERROR(check_stages(kind, world, op.stages, op.stage_count));
  JO_RETURN_IF_ERROR(check_block_scales(kind, world, op.gemm));
  std::vector<GemmProblem> found;
  Context ctx{};
  ctx.peers.world = world;
  for (int r = 0; r < world; ++r) ctx.peers.regions[r] = at(16 + r);
  ctx.gemm_sms = gemm_sm_count(sm_count);
  ctx.sm_count = sm_count;
  ctx.collect = &found;
  for (int rank = 0; rank < world; ++rank)
    for (uint64_t epoch : {1, 2}) {  // both parities' slots
      ctx.peers.rank = rank;
      ctx.epoch = epoch;
      found.clear();
      JO_RETURN_IF_ERROR(op_plans(kind, op, ctx));
      append_unique(found, out);
    }
  return {};
}

Status loopback_problems(OpKind kind, const Operands& op, int world, int sm_count, std::vector<GemmProblem>* out) {
  out->clear();
  JO_RETURN_IF_ERROR(check_stages(kind, world, op.stages, op.stage_count));
  JO_RETURN_IF_ERROR(check_block_scales(kind, world, op.gemm));
  std::vector<GemmProblem> found;
  Context ctx{};
  ctx.peers.world = world;
  ctx.epoch = 1;
  ctx.loopback = true;
  ctx.gemm_sms = gemm_sm_count(sm_count);
  ctx.sm_count = sm_count;
  ctx.collect = &found;
  JO_RETURN_IF_ERROR(op_plans(kind, op, ctx));
  append_unique(found, out);
  return {};
}

}  // namespace jo::pipelined
