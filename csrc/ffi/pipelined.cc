// FFI handlers of the pipelined algorithm (pipelined/schedule.h): check every
// buffer once, bind the call to its group, enqueue the schedule on XLA's stream
// and the side streams. A group of one is the vendor GEMM alone, on XLA's
// stream (command-buffer compatible where its capture check passed).
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "blas/gemm.h"
#include "core/block_scales.h"
#include "ffi/binding.h"
#include "ffi/common.h"
#include "ffi/handlers.h"
#include "pipelined/schedule.h"
#include "pipelined/streams.h"

namespace jo {
namespace {

std::atomic<int64_t> g_vendor_gemm_runs{0}, g_vendor_gemm_captured{0}, g_vendor_gemm_handler_ns{0},
    g_vendor_gemm_vendor_ns{0};

int64_t ns_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t).count();
}

// The call's state; its stage plan is checked here, once, not on every execute.
ffi::ErrorOr<std::unique_ptr<CallState>> instantiate(OpKind kind, PipelinedConfig config,
                                                     ffi::Span<const int64_t> groups, int64_t world,
                                                     ffi::Span<const int64_t> stages) {
  auto state = make_call_state(groups, world,
                               {config.region_offset, config.region_bytes, config.site, config.generation});
  if (state.has_error()) return state;
  state.value()->stages.assign(stages.begin(), stages.end());
  const Status checked = pipelined::check_stages(kind, static_cast<int>(world), state.value()->stages.data(),
                                                 static_cast<int>(stages.size()));
  if (!checked.ok()) return ffi::Unexpected(ffi::Error::InvalidArgument(checked.message));
  return state;
}

ffi::ErrorOr<std::unique_ptr<CallState>> AgMatmulPipelinedInstantiate(PipelinedConfig config,
                                                                      ffi::Span<const int64_t> groups, int64_t world,
                                                                      ffi::Span<const int64_t> stages) {
  return instantiate(OpKind::kAgMatmul, config, groups, world, stages);
}

ffi::ErrorOr<std::unique_ptr<CallState>> MatmulRsPipelinedInstantiate(PipelinedConfig config,
                                                                      ffi::Span<const int64_t> groups, int64_t world,
                                                                      ffi::Span<const int64_t> stages) {
  return instantiate(OpKind::kMatmulRs, config, groups, world, stages);
}

// The checked operands of a pipelined call with output `y` (and `like_x`, gathered x), with the schedule's rules
// on block scales and its scratch size checked.
ffi::ErrorOr<pipelined::Operands> operands(const char* name, OpKind kind, const GemmArgs& args,
                                           const ffi::AnyBuffer& y, std::initializer_list<const ffi::AnyBuffer*> like_x,
                                           const ffi::AnyBuffer& scratch, bool w_kmajor, int64_t scaling,
                                           bool fast_accumulation, int world) {
  const auto checked = check_gemm(name, args, y, like_x, w_kmajor, scaling, fast_accumulation);
  if (checked.has_error()) return ffi::Unexpected(checked.error());
  const Status blocks = pipelined::check_block_scales(kind, world, checked.value());
  if (!blocks.ok()) return ffi::Unexpected(ffi::Error::InvalidArgument(blocks.message));
  pipelined::Operands op{};
  op.gemm = checked.value();
  op.x = args.x.untyped_data();
  op.w = args.w.untyped_data();
  op.bias = op.gemm.bias ? args.bias.untyped_data() : nullptr;
  if (op.gemm.types.scaled) {
    op.x_scale = static_cast<const float*>(args.x_scale->untyped_data());
    op.w_scale = static_cast<const float*>(args.w_scale->untyped_data());
  }
  op.out = y.untyped_data();
  op.scratch = scratch.untyped_data();
  const GemmProblem& g = op.gemm;
  const uint64_t want = pipelined::scratch_bytes(kind, world, g.batch, g.rows, g.n,
                                                 element_bytes(partial_dtype(g.types.out)), /*loopback=*/false);
  if (scratch.size_bytes() != want)
    return ffi::Unexpected(
        invalid_argument(name, "scratch", std::to_string(want) + " bytes", std::to_string(scratch.size_bytes())));
  return op;
}

// Binds the call and runs it (pipelined::run_call). Once bound, a rank keeps in step with its peers
// whatever happens: a call it cannot run (its side streams or vendor BLAS cannot be set up, or its
// GPU recorded an error before) takes its epoch and abandons it (pipelined::abandon_call), so that
// the peers' calls of that epoch fail at once, naming this rank, instead of after the watchdog.
ffi::Error run(const char* name, OpKind kind, hipStream_t stream, int32_t ordinal, CallState* state,
               pipelined::Operands& op) {
  op.stages = state->stages.data();
  op.stage_count = static_cast<int>(state->stages.size());
  const EnqueueClaim claim(ordinal);  // until run_call returns
  const auto bound = bind_call(name, state, claim);
  if (bound.has_error()) return bound.error();
  const GroupBinding& g = *bound.value();
  pipelined::Context ctx{};
  ctx.peers = g.peers;
  ctx.site = state->site;
  ctx.wd = g.ws->watchdog(kind);
  ctx.sm_count = g.ws->info.sm_count;
  ctx.gemm_sms = pipelined::gemm_sm_count(ctx.sm_count);
  Status ready = pipelined::device_side_streams(ordinal, &ctx.streams);
  if (ready.ok()) ready = Runtime::verified_copy_path(*g.ws, &ctx.copy_path);
  if (ready.ok()) ready = blas::DeviceBlas::get(ordinal, &ctx.blas);
  const ffi::Error refused = recorded_error(*g.ws);
  if (!ready.ok() || refused.failure()) {
    const Status abandoned = pipelined::abandon_call(kind, op, ctx, *g.epochs, stream);
    const std::string also = abandoned.ok() ? "" : "; abandoning its epoch failed too (the peers wait for their "
                                                   "watchdog): " + abandoned.message;
    if (refused.failure()) return ffi::Error(*refused.errc(), refused.message() + also);
    return ffi::Error::Internal(std::string("jax_overlap ") + name + ": " + ready.message + also);
  }
  return finish_launch(pipelined::run_call(kind, op, ctx, *g.epochs, stream), *g.ws, stream, name);
}

// x [..., m, k], w [k, n] or [n, k], bias [n] (y's dtype or f32) or [0] for none, x_scale f32[1] or [k/128][m] and
// w_scale f32[1] or block scales (float8; else f32[0]); y [..., world * m, n], gathered [..., world * m, k],
// gathered_scales f32[world] or [world][k/128][m] (float8; else f32[0]), scratch u8[pipelined_scratch_bytes].
ffi::Error AgMatmulPipelinedExecute(hipStream_t stream, int32_t ordinal, CallState* state, ffi::AnyBuffer x,
                                    ffi::AnyBuffer w, ffi::AnyBuffer bias, ffi::AnyBuffer x_scale,
                                    ffi::AnyBuffer w_scale, ffi::Result<ffi::AnyBuffer> y,
                                    ffi::Result<ffi::AnyBuffer> gathered, ffi::Result<ffi::AnyBuffer> gathered_scales,
                                    ffi::Result<ffi::AnyBuffer> scratch, PipelinedConfig config,
                                    ffi::Span<const int64_t> /*groups*/, int64_t world,
                                    ffi::Span<const int64_t> /*stages*/) {
  auto op = operands("ag_matmul", OpKind::kAgMatmul, GemmArgs{x, w, bias, &x_scale, &w_scale}, *y, {&*gathered},
                     *scratch, config.w_kmajor != 0, config.scaling, config.fast_accumulation != 0,
                     static_cast<int>(world));
  if (op.has_error()) return op.error();
  pipelined::Operands& o = op.value();
  const GemmProblem& g = o.gemm;
  if (auto e = check_elements("ag_matmul", "result y", *y, g.batch * world * g.rows * g.n); e.failure()) return e;
  if (auto e = check_elements("ag_matmul", "result gathered", *gathered, g.batch * world * g.rows * g.k); e.failure())
    return e;
  // Block scales: each shard's x scales as its GEMM read them, [world][k/128][m] (the batch 1 with peers).
  const int64_t scales = g.types.blocks ? world * x_block_scales(g.batch * g.rows, g.k) : g.types.scaled ? world : 0;
  if (auto e = check_elements("ag_matmul", "result gathered_scales", *gathered_scales, scales); e.failure()) return e;
  if (g.types.scaled && gathered_scales->element_type() != ffi::DataType::F32)
    return invalid_argument("ag_matmul", "dtype of gathered_scales", "float32",
                            data_type_name(gathered_scales->element_type()));
  o.gathered = gathered->untyped_data();
  o.gathered_scales = g.types.scaled ? static_cast<float*>(gathered_scales->untyped_data()) : nullptr;
  o.x_scale_shared = config.x_scale_shared != 0;
  return run("ag_matmul", OpKind::kAgMatmul, stream, ordinal, state, o);
}

// x [..., m_total, k], w, bias and w_scale as ag_matmul's, x_scale f32[1] or [world][k/128][m_total / world]
// (float8; else f32[0]); out [..., m_total / world, n], scratch u8[pipelined_scratch_bytes].
ffi::Error MatmulRsPipelinedExecute(hipStream_t stream, int32_t ordinal, CallState* state, ffi::AnyBuffer x,
                                    ffi::AnyBuffer w, ffi::AnyBuffer bias, ffi::AnyBuffer x_scale,
                                    ffi::AnyBuffer w_scale, ffi::Result<ffi::AnyBuffer> out,
                                    ffi::Result<ffi::AnyBuffer> scratch, PipelinedConfig config,
                                    ffi::Span<const int64_t> /*groups*/, int64_t world,
                                    ffi::Span<const int64_t> /*stages*/) {
  auto op = operands("matmul_rs", OpKind::kMatmulRs, GemmArgs{x, w, bias, &x_scale, &w_scale}, *out, {}, *scratch,
                     config.w_kmajor != 0, config.scaling, config.fast_accumulation != 0, static_cast<int>(world));
  if (op.has_error()) return op.error();
  pipelined::Operands& o = op.value();
  const GemmProblem& g = o.gemm;
  if (g.rows % world != 0)
    return invalid_argument("matmul_rs", "rows of x", "a multiple of the group size " + std::to_string(world),
                            std::to_string(g.rows));
  if (auto e = check_elements("matmul_rs", "result", *out, g.batch * (g.rows / world) * g.n); e.failure()) return e;
  return run("matmul_rs", OpKind::kMatmulRs, stream, ordinal, state, o);
}

// What a group-of-one call's checks and plan depend on: its GPU, its attribute, its buffers' dtypes and dims
// and its operands' alignment. Calls of equal keys pass the same checks and run the same plan.
struct VendorGemmKey {
  static constexpr int kWords = 56;
  int64_t words[kWords];
  int size = 0;
  bool full = false;  // more dims than kWords holds: not cached

  void push(int64_t v) {
    if (size < kWords) words[size++] = v; else full = true;
  }
  void push(const ffi::AnyBuffer& b) {
    push(static_cast<int64_t>(b.element_type()));
    const auto dims = b.dimensions();
    push(static_cast<int64_t>(dims.size()));
    for (int64_t d : dims) push(d);
  }
  bool operator==(const VendorGemmKey& o) const {
    return size == o.size && std::memcmp(words, o.words, sizeof(int64_t) * size) == 0;
  }
  uint64_t hash() const {  // FNV-1a over the words
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < size; ++i) h = (h ^ static_cast<uint64_t>(words[i])) * 1099511628211ull;
    return h;
  }
};

// A call checked before: its GPU's BLAS and plan. Immutable once published; never freed (a reader may hold it).
struct CheckedGemm {
  VendorGemmKey key;
  blas::DeviceBlas* blas = nullptr;
  const blas::GemmPlan* plan = nullptr;
  uint64_t plans_version = 0;  // blas->plans_version() when `plan` was looked up
};

// Checked calls by their key's hash, for any thread (XLA may run a GPU's calls from several): readers take a
// slot's entry with one atomic load, no lock; the checks of a call whose slot holds another key, or a plan
// replaced since (tuning, install), publish a new entry in its place.
constexpr size_t kCheckedSlots = 64;
constexpr size_t kCheckedKept = 4096;  // past this many (keys that keep changing), calls are checked every time
std::atomic<const CheckedGemm*> g_checked[kCheckedSlots];
std::mutex g_checked_mu;                                  // guards g_checked_kept
std::vector<std::unique_ptr<CheckedGemm>> g_checked_kept;  // every entry published

std::atomic<bool> g_count_vendor_gemm_runs{false};

// The checks of a call not checked before: its operands, its plan.
ffi::Error check_vendor_gemm(int32_t ordinal, const GemmArgs& args, const ffi::AnyBuffer& y,
                             const ffi::AnyBuffer& scratch, int64_t w_kmajor, int64_t scaling,
                             int64_t fast_accumulation, CheckedGemm* out) {
  auto op = operands("vendor_gemm", OpKind::kAgMatmul, args, y, {}, scratch, w_kmajor != 0, scaling,
                     fast_accumulation != 0, 1);
  if (op.has_error()) return op.error();
  const pipelined::Operands& o = op.value();
  if (auto e = check_elements("vendor_gemm", "result y", y, o.gemm.batch * o.gemm.rows * o.gemm.n); e.failure())
    return e;
  JO_FFI_RETURN_IF_ERROR(pipelined::check_block_scales(OpKind::kAgMatmul, /*world=*/1, o.gemm));
  JO_FFI_RETURN_IF_ERROR(blas::DeviceBlas::get(ordinal, &out->blas));
  out->plans_version = out->blas->plans_version();
  JO_FFI_RETURN_IF_ERROR(out->blas->plan(pipelined::local_problem(o), &out->plan));
  return ffi::Error::Success();
}

// A group of one: y = x @ w (+ bias) by the vendor GEMM (float8: scaled by x_scale * w_scale, or by block
// scales, x's [k/128][batch * m], the batch folded into the rows), nothing to
// move. No peer, no epoch, no host work a command-buffer replay would miss: it reads no runtime state, so a
// replay after jax_overlap.shutdown() is still right. Two targets run it: one command-buffer compatible, and
// one XLA dispatches from the host each time, for GPUs whose vendor GEMM failed the capture check
// (blas/capture_check.h). A call whose key was checked before skips the checks and the plan lookup (a hash and
// a few integer compares: the per-call cost of a group of one beside cuBLAS's own, issue 39).
// x [..., m, k], w [k, n] or [n, k], bias [n] in y's dtype (float8: or float32) or [0] for none, x_scale and w_scale
// f32[1] or block scales (float8; else f32[0]); y [..., m, n], scratch: the vendor GEMM's workspace, u8.
ffi::Error VendorGemmExecute(hipStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer w,
                             ffi::AnyBuffer bias, ffi::AnyBuffer x_scale, ffi::AnyBuffer w_scale,
                             ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> scratch, int64_t w_kmajor,
                             int64_t scaling, int64_t fast_accumulation) {
  const bool counting = g_count_vendor_gemm_runs.load(std::memory_order_relaxed);
  const auto started = counting ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  const bool has_bias = bias.element_count() != 0;
  VendorGemmKey key;
  key.push(ordinal);
  key.push(w_kmajor);
  key.push(scaling);
  key.push(fast_accumulation);
  key.push(blas::alignment_of({x.untyped_data(), w.untyped_data(), has_bias ? bias.untyped_data() : nullptr,
                               y->untyped_data()}));
  for (const ffi::AnyBuffer* b : {&x, &w, &bias, &x_scale, &w_scale}) key.push(*b);
  key.push(*y);
  key.push(static_cast<int64_t>(scratch->size_bytes()));
  std::atomic<const CheckedGemm*>& slot = g_checked[key.hash() % kCheckedSlots];
  const CheckedGemm* call = key.full ? nullptr : slot.load(std::memory_order_acquire);
  if (call != nullptr && (!(call->key == key) || call->plans_version != call->blas->plans_version())) call = nullptr;
  CheckedGemm uncached;  // a key too long to keep: checked on every call
  if (call == nullptr) {
    auto checked = std::make_unique<CheckedGemm>();
    if (auto e = check_vendor_gemm(ordinal, GemmArgs{x, w, bias, &x_scale, &w_scale}, *y, *scratch, w_kmajor,
                                   scaling, fast_accumulation, checked.get());
        e.failure())
      return e;
    checked->key = key;
    std::lock_guard<std::mutex> lock(g_checked_mu);
    if (key.full || g_checked_kept.size() >= kCheckedKept) {
      uncached = *checked;
      call = &uncached;
    } else {
      call = checked.get();
      g_checked_kept.push_back(std::move(checked));
      slot.store(call, std::memory_order_release);
    }
  }
  const bool scaled = scaling != static_cast<int64_t>(ScaleMode::kNone);
  const blas::GemmPointers pointers{x.untyped_data(), w.untyped_data(), has_bias ? bias.untyped_data() : nullptr,
                                    scaled ? static_cast<const float*>(x_scale.untyped_data()) : nullptr,
                                    scaled ? static_cast<const float*>(w_scale.untyped_data()) : nullptr,
                                    y->untyped_data()};
  const auto vendor_started = counting ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  JO_FFI_RETURN_IF_ERROR(
      call->blas->run(*call->plan, pointers, scratch->untyped_data(), stream, call->blas->stream_handle(stream)));
  // Counted for the tests and benchmarks only (count_vendor_gemm_runs): the capture query costs host time.
  if (counting) {
    g_vendor_gemm_vendor_ns.fetch_add(ns_since(vendor_started), std::memory_order_relaxed);
    g_vendor_gemm_handler_ns.fetch_add(ns_since(started), std::memory_order_relaxed);
    hipStreamCaptureStatus capture{};
    if (hipStreamIsCapturing(stream, &capture) == hipSuccess && capture == hipStreamCaptureStatusActive)
      g_vendor_gemm_captured.fetch_add(1, std::memory_order_relaxed);
    g_vendor_gemm_runs.fetch_add(1, std::memory_order_relaxed);
  }
  return ffi::Error::Success();
}

auto vendor_gemm_binding() {
  return stream_binding<5, 2>()
      .Attr<int64_t>("w_kmajor")
      .Attr<int64_t>("scaling")  // ScaleMode of x_scale and w_scale
      .Attr<int64_t>("fast_accumulation");
}

}  // namespace

VendorGemmRuns vendor_gemm_runs() {
  constexpr auto relaxed = std::memory_order_relaxed;
  return {g_vendor_gemm_runs.load(relaxed), g_vendor_gemm_captured.load(relaxed), g_vendor_gemm_handler_ns.load(relaxed),
          g_vendor_gemm_vendor_ns.load(relaxed)};
}

void count_vendor_gemm_runs(bool on) { g_count_vendor_gemm_runs.store(on, std::memory_order_relaxed); }

}  // namespace jo

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoAgMatmulPipelinedInstantiate, jo::AgMatmulPipelinedInstantiate,
                              jo::pipelined_instantiate_binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JoMatmulRsPipelinedInstantiate, jo::MatmulRsPipelinedInstantiate,
                              jo::pipelined_instantiate_binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JoAgMatmulPipelinedExecute, jo::AgMatmulPipelinedExecute,
                              (jo::pipelined_execute_binding<5, 4>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JoMatmulRsPipelinedExecute, jo::MatmulRsPipelinedExecute,
                              (jo::pipelined_execute_binding<5, 2>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoVendorGemmExecute, jo::VendorGemmExecute, jo::vendor_gemm_binding(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JoVendorGemmNoGraphExecute, jo::VendorGemmExecute, jo::vendor_gemm_binding());
