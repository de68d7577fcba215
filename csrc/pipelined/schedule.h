// The pipelined algorithm: the vendor GEMM per chunk of rows, on two compute
// streams forked from the caller's stream, with the rows moved between ranks
// by copy engines on a copy stream (no SM spent on moving data, no host
// synchronization), and epoch flags in the symmetric workspace between ranks
// (docs/protocol.md; a flag's values: kernels/pipeline_kernels.h PipeFlag).
//
// ag_matmul, rank r of T, y = all_gather(x) @ w + bias:
//   copy stream, first (its copies within this GPU run on SMs: enqueued before the first GEMM, they
//                   run at once instead of after its last wave): [wait: readers done with slot(e-2)]
//                   mark pub rewriting; copy x -> my slot (float8: and x's scales into its header,
//                   unless every rank shares one x scale); release pub(e); copy x (and its block
//                   scales) into my own rows of `gathered` (and gathered_scales).
//   compute stream 0: stage 0 = my own shard from x.
//   copy stream, then: wait: every peer's pub(e); (tensor scales of their own: every peer's scale
//                   from its slot header into gathered_scales, by one small kernel;) for s = r+1,
//                   r+2, ... (ring order, so each rank is read by one peer at a time): pull peer s's
//                   slot (block scales: its header into s's scales of gathered_scales, then) into
//                   s's rows of `gathered`, record arrived[i]; verify that every peer's pub still
//                   holds (e) and release done(e) in their regions; (a shared x scale: mine into
//                   every shard's place in gathered_scales.)
//   compute streams: the stages of the plan after stage 0 (consecutive ring positions, one GEMM per
//                   contiguous range of rows; float8 with scales of their own: one per shard, each
//                   with its own x scales, back to back), each after its last shard arrived,
//                   alternating between the two streams.
//   then:           join; NaN over y, gathered (and its scales) if the watchdog fired (or a check
//                   failed).
// matmul_rs, rank r of T, out = psum_scatter(x @ w) + bias:
//   compute streams: stages over the row blocks in the order r+1, r+2, ..., r (my own last):
//                   [wait: the blocks' owners done with staging(e-2)] mark the blocks' ready flags
//                   rewriting; GEMM the blocks' rows of x into my staging slot (in
//                   partial_dtype(output dtype), core/dtype.h: float32 for float16; float8: scaled
//                   by my own x and w scales; block scales: one GEMM per block, each with its
//                   block's x scales), release ready(e) per block.
//                   A stage of every block is one GEMM of all rows (block scales: one per block).
//   copy stream:    for q = r-1, r-2, ... (the order in which peers compute my block): wait for
//                   q's ready(e) of block r, pull it into my receive area; then verify that every
//                   ready(e) pulled still holds and release done(e) in the stagers' regions.
//   then:           join; the fixed-order reduction (fp32, ranks 0..T-1, bias once) into out, NaN
//                   if the watchdog fired (or a check failed). (Not under the last GEMM: the vendor
//                   GEMM, persistent on every SM, leaves a kernel beside it no SM until its last
//                   wave, and splitting the GEMM to make room costs more than it hides.)
// Every wait is a bounded wait kernel (kernels/pipeline_kernels.h): a stream-
// memory-op wait cannot time out, a kernel records the error and returns.
// The rewriting mark and the check after the pulls are for writers that run
// on after their GPU aborted (its waits return at once): neither a copy
// engine nor a vendor GEMM checks a flag, so a reader that was still pulling
// finds the rewrite afterwards and fails the call instead of using the bytes.
// Loopback (benchmarks and tests on one GPU): the same streams, GEMMs and
// copies with my own data standing in for every peer's, and no flags.
//
// The code: schedule.cc is the core every op shares (waits, releases, the
// check after the pulls, abandoned epochs, the GEMM plans, stage units) and
// dispatches per op (switch over OpKind) to the op's own file, ag_matmul.cc
// and matmul_rs.cc (its region, stage rule, plans, enqueue and abandon).
#pragma once

#include <cstdint>
#include <vector>

#include "blas/gemm.h"
#include "core/gemm_problem.h"
#include "core/op_kind.h"
#include "kernels/params.h"
#include "pipelined/copy.h"
#include "pipelined/layout.h"
#include "pipelined/streams.h"
#include "platform/status.h"

namespace jo::pipelined {

// The plans of one call's GEMMs in the order its enqueue runs them: make_plans
// fills the list, the enqueue takes them in turn (one plan lookup per GEMM per
// call, not two).
struct PlanList {
  std::vector<const blas::GemmPlan*> plans;
  size_t next = 0;
  bool filling = true;
};

// Where and how one rank runs a call.
struct Context {
  SideStreams* streams;
  blas::DeviceBlas* blas;
  Peers peers;      // every rank's region of the call (unused in loopback)
  uint64_t epoch;   // this call's epoch on the region (params.h EpochCounter); flags hold its low 32 bits
  uint32_t site;    // this call site's number among those sharing the region (1 to 65535)
  bool slot_used;   // EpochCounter::slot_used(epoch): wait for the readers of this parity's slots
  Watchdog wd;      // wd.abort: this GPU's abort flag (nullptr in loopback: no poisoning)
  int sm_count;
  int gemm_sms;     // SMs each GEMM of the schedule may take (gemm_sm_count), 0: all
  bool loopback;
  CopyPath copy_path = CopyPath::kEngine;  // how the copy stream moves bytes: the GPU's verified path (copy.h)
  PlanList* plans = nullptr;  // run_call's (else each GEMM looks its plan up)
  // Set: make_plans records each GEMM's problem here instead of planning it (gemm_problems).
  std::vector<GemmProblem>* collect = nullptr;
};

struct Operands {
  // The call's GEMM as x gives it, dense (its alignment unset: each GEMM of
  // the schedule has its own): gemm.rows (m below) is ag_matmul's rows of x's
  // shard, matmul_rs's rows of x (all blocks), per batch element.
  GemmProblem gemm;
  const void* x;
  const void* w;
  const void* bias;       // [n] or nullptr
  // gemm.types.scaled: this rank's scales, a device float each, or block scales (core/block_scales.h): x's
  // [k/128][m] (matmul_rs: per row block, [world][k/128][m / world]) and w's; else nullptr.
  const float* x_scale;
  const float* w_scale;
  void* out;              // ag_matmul: y [batch, world * m, n]; matmul_rs: [batch, m / world, n]
  void* gathered;         // ag_matmul: [batch, world * m, k]
  // ag_matmul, scaled: shard s's x scales in gathered order: [world] floats, or block scales [world][k/128][m].
  float* gathered_scales;
  void* scratch;          // scratch_bytes(): the compute streams' vendor workspaces, then ag_matmul's scale slots
                          // (tensor scales: the gathered scales its GEMMs read) or matmul_rs's receive area
  const int64_t* stages;  // ring positions per stage, in order; they sum to the world size
  int stage_count;
  // ag_matmul with float8 tensor scales: every rank's x_scale is the same value (the caller's x_scale is
  // replicated over the group: jax_overlap's Scaling.x_shared), so the gathered shards' GEMMs take my own, one
  // per contiguous range of shards as for 16-bit x, instead of one per shard with its rank's.
  bool x_scale_shared = false;
};

// Sizes of a call's buffers. x_bytes: x's element; partial_bytes: matmul_rs's
// partials' (element_bytes(partial_dtype(y's dtype)); ag_matmul ignores it); scaled: float8 operands; blocks:
// with block scales (core/block_scales.h). all_gather has no
// pipelined schedule: 0 here, an error from check_stages and the enqueues.
// The XLA scratch result (and, in loopback, matmul_rs's stand-in staging after it):
uint64_t scratch_bytes(OpKind op, int world, int64_t batch, int64_t m, int64_t n, int partial_bytes, bool loopback);
// The symmetric region (0 for a group of one):
uint64_t region_bytes(OpKind op, int world, int64_t batch, int64_t m, int64_t k, int64_t n, int x_bytes,
                      int partial_bytes, bool scaled, bool blocks);
// The SMs a schedule's GEMMs may take on a GPU of sm_count SMs (0: all): all but JAX_OVERLAP_GEMM_SM_MARGIN
// (default kGemmSmMargin), left to the kernels that run beside them: the copy stream's flag waits, float8 scale
// copies and copies within the GPU. A persistent vendor GEMM on every SM holds them off until its last wave.
inline constexpr int kGemmSmMargin = 0;
int gemm_sm_count(int sm_count);
// Checks a stage plan: positive sizes summing to `world`, ag_matmul's first stage its own shard alone.
Status check_stages(OpKind op, int world, const int64_t* stages, int stage_count);
// Checks what the schedule asks of a call with float8 block scales (core/block_scales.h), beyond the shapes the
// FFI checks: each GEMM's rows (a group of one: batch * m, the batch folded into the rows; ag_matmul: the shard's
// m; matmul_rs: a row block's m / world) a multiple of 4, one batch element with peers (a GEMM's x scales are
// contiguous), and no bias where a GEMM would add it (every op but matmul_rs with peers, whose reduction adds
// it). Success for other calls.
Status check_block_scales(OpKind op, int world, const GemmProblem& gemm);

// One call of a group of two or more on its rank, start to end; `ctx` comes
// without its epoch, which this takes from `epochs`, in the order calls are
// enqueued on this GPU (under the side streams' lock). Whatever can fail on
// the host is done before the epoch is taken: the vendor GEMM plans of every
// GEMM of the schedule, made with the call's own pointers (plans depend on
// their alignment, which differs from rank to rank; made once per shape and
// kept, so a later call only finds them). If that, or the enqueue itself,
// fails, the rank still takes the epoch, to stay in step with its peers, and
// abandons it (abandon_call), and the error is returned.
Status run_call(OpKind kind, const Operands& op, Context ctx, EpochCounter& epochs, hipStream_t origin);

// A call this rank cannot run (its side streams or vendor BLAS could not be
// set up, or its GPU refuses calls after an error): takes the epoch and
// abandons it on `origin` (kernels/pipeline_kernels.h FlagAbandon), so that
// the peers' waits for this epoch fail at once, naming this rank
// (WaitOn::kPeerAbandoned), instead of after the watchdog. ctx.streams and
// ctx.blas may be null.
Status abandon_call(OpKind kind, const Operands& op, Context ctx, EpochCounter& epochs, hipStream_t origin);

// One call with ctx's epoch as given and nothing abandoned on a failure: the
// one-GPU loopback of the benchmarks (pipelined/measure.h).
Status enqueue(OpKind kind, const Operands& op, const Context& ctx, hipStream_t origin);

// A group of one: y = x @ w + bias, the vendor GEMM alone on `stream` with
// that stream's BLAS handle (scratch: one vendor workspace): the problem
// local_problem() gives, its plan `plan` when the caller has it (else looked up).
GemmProblem local_problem(const Operands& op);
Status enqueue_local_gemm(const Operands& op, blas::DeviceBlas& blas, hipStream_t stream, blas::Handle handle,
                          const blas::GemmPlan* plan = nullptr);

// The side streams a call of the op gives work (pipelined/streams.h): it forks and joins those only.
StreamSet streams_used(OpKind kind, const Operands& op);

// Every GEMM problem a call of the op with `shape` (its gemm and stages;
// pointers unused) runs on any rank of `world` (each rank's
// stages cover other units, and epochs alternate between two slots), on
// buffers as XLA gives them (256-byte aligned) and a GPU of `sm_count` SMs: the
// problems jax_overlap tunes at lowering. A group of one's is local_problem's.
Status gemm_problems(OpKind kind, const Operands& shape, int world, int sm_count, std::vector<GemmProblem>* out);
// The GEMM problems of one loopback call (measure.h time_loopback) with its own pointers.
Status loopback_problems(OpKind kind, const Operands& op, int world, int sm_count, std::vector<GemmProblem>* out);

}  // namespace jo::pipelined
