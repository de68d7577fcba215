#include "ffi/common.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <utility>

#include "core/block_scales.h"
#include "kernels/pipeline_kernels.h"
#include "kernels/tile_registry.h"
#include "runtime/faults.h"

namespace jo {

ffi::TypeId CallState::id = {};
const XLA_FFI_TypeInfo kCallStateTypeInfo = ffi::MakeTypeInfo<CallState>();

ffi::Error recorded_error(const Workspace& ws) {
  if (!error_recorded(*ws.error_host)) return ffi::Error::Success();
  return ffi::Error::Internal(describe_error(*ws.error_host, ws.info.ticks_per_second));
}

namespace {

// A call lowered under another runtime generation refuses to run: jax_overlap.shutdown() freed what it was
// bound to (and a later initialize() made new state its attributes do not describe).
ffi::Error check_generation(uint64_t lowered) {
  if (lowered == Runtime::instance().generation()) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    "jax_overlap: this compiled call was lowered for a workspace that jax_overlap.shutdown() freed; "
                    "trace and compile it again (for example after jax.clear_caches())");
}

}  // namespace

ffi::ErrorOr<std::unique_ptr<CallState>> make_call_state(ffi::Span<const int64_t> groups, int64_t world,
                                                          const RegionPlacement& region) {
  if (world < 1 || world > kMaxWorld)
    return ffi::Unexpected(invalid_argument("call", "the group size", "1 to " + std::to_string(kMaxWorld),
                                            std::to_string(world)));
  // A released flag always carries its site (kernels/region_layout.h match): 16 bits, never 0.
  if (world > 1 && (region.site < 1 || region.site > 0xFFFF))
    return ffi::Unexpected(invalid_argument("call", "call site number", "1 to 65535", std::to_string(region.site)));
  auto state = std::make_unique<CallState>();
  state->groups.assign(groups.begin(), groups.end());
  state->world = static_cast<int>(world);
  state->region_offset = static_cast<uint64_t>(region.offset);
  state->region_bytes = static_cast<uint64_t>(region.bytes);
  state->site = static_cast<uint32_t>(region.site);
  state->generation = static_cast<uint64_t>(region.generation);
  return state;
}

namespace {

// The thread enqueuing on each GPU (EnqueueClaim), 0 when none.
std::atomic<uint64_t> g_enqueuer[kMaxLocalDevices];

uint64_t this_thread() {
  static thread_local const uint64_t tid = static_cast<uint64_t>(syscall(SYS_gettid));
  return tid;
}

}  // namespace

EnqueueClaim::EnqueueClaim(int32_t ordinal) : ordinal_(ordinal), thread_(this_thread()), holder_(0) {
  if (ordinal < 0 || ordinal >= kMaxLocalDevices) return;  // status() says so
  uint64_t held = 0;
  if (!g_enqueuer[ordinal].compare_exchange_strong(held, thread_, std::memory_order_acquire,
                                                   std::memory_order_relaxed)) {
    holder_ = held;
    return;
  }
  // Fault "enqueue_hold_ms=<ms>": hold the claim that long (tests/gpu/scenarios/threads.py: a second thread's
  // call meets it).
  if (const int64_t ms = faults::value("enqueue_hold_ms", 0); ms > 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

EnqueueClaim::~EnqueueClaim() {
  if (ordinal_ >= 0 && ordinal_ < kMaxLocalDevices && holder_ == 0)
    g_enqueuer[ordinal_].store(0, std::memory_order_release);
}

ffi::Error EnqueueClaim::status(const char* op) const {
  if (ordinal_ < 0 || ordinal_ >= kMaxLocalDevices)
    return invalid_argument(op, "device ordinal", "0 to " + std::to_string(kMaxLocalDevices - 1),
                            std::to_string(ordinal_));
  if (holder_ == 0) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    std::string("jax_overlap ") + op + ": host thread " + std::to_string(thread_) +
                        " ran a call on GPU " + std::to_string(ordinal_) + " while thread " +
                        std::to_string(holder_) +
                        " was enqueuing another there; calls with peers must reach each GPU one at a time, in the "
                        "same order on every rank (docs/protocol.md, \"Host threads\"): call such programs from "
                        "one thread, or serialize the threads that call them");
}

ffi::ErrorOr<const GroupBinding*> bind_call(const char* op, CallState* state, const EnqueueClaim& claim) {
  if (auto e = claim.status(op); e.failure()) return ffi::Unexpected(std::move(e));
  const int32_t ordinal = claim.ordinal();
  // Checked before the binding is touched: after shutdown() it points at freed memory.
  if (auto e = check_generation(state->generation); e.failure()) return ffi::Unexpected(std::move(e));
  GroupBinding& binding = state->bindings[ordinal];
  if (!state->bound[ordinal]) {
    const Status s = Runtime::instance().bind_group(ordinal, state->groups.data(), state->groups.size(),
                                                    state->world, state->region_offset, state->region_bytes,
                                                    &binding);
    if (!s.ok()) return ffi::Unexpected(internal_error(s));
    state->bound[ordinal] = true;
  }
  return &binding;
}

ffi::ErrorOr<const GroupBinding*> prepare_call(const char* op, CallState* state, const EnqueueClaim& claim) {
  const auto bound = bind_call(op, state, claim);
  if (bound.has_error()) return ffi::Unexpected(bound.error());
  if (auto e = recorded_error(*bound.value()->ws); e.failure()) return ffi::Unexpected(std::move(e));
  return bound.value();
}

ffi::DataType ffi_data_type(DType t) {
  switch (t) {
    case DType::kBF16: return ffi::DataType::BF16;
    case DType::kF16: return ffi::DataType::F16;
    case DType::kF8E4M3FN: return ffi::DataType::F8E4M3FN;
    case DType::kF8E5M2: return ffi::DataType::F8E5M2;
    case DType::kF8E4M3FNUZ: return ffi::DataType::F8E4M3FNUZ;
    case DType::kF8E5M2FNUZ: return ffi::DataType::F8E5M2FNUZ;
    case DType::kF32: return ffi::DataType::F32;
  }
  return ffi::DataType::INVALID;
}

std::optional<DType> dtype_of(ffi::DataType t) {
  for (DType d : kDTypes)
    if (ffi_data_type(d) == t) return d;
  return std::nullopt;
}

std::string data_type_name(ffi::DataType t) {
  if (const auto d = dtype_of(t)) return dtype_name(*d);
  // XLA's other types as jax names them; the rest by number.
  switch (t) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::C64: return "complex64";
    case ffi::DataType::C128: return "complex128";
    default: return "XLA data type " + std::to_string(static_cast<int>(t));
  }
}

std::string dims_str(ffi::Span<const int64_t> d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

int64_t leading_batch(ffi::Span<const int64_t> dims) {
  int64_t b = 1;
  for (size_t i = 0; i + 2 < dims.size(); ++i) b *= dims[i];
  return b;
}

ffi::Error invalid_argument(const char* op, const char* name, const std::string& expected, const std::string& got) {
  return ffi::Error::InvalidArgument(std::string("jax_overlap ") + op + ": invalid " + name + ": expected " + expected +
                                     ", got " + got);
}

ffi::Error check_elements(const char* op, const char* name, const ffi::AnyBuffer& buffer, int64_t elements) {
  if (static_cast<int64_t>(buffer.element_count()) == elements) return ffi::Error::Success();
  return invalid_argument(op, name, std::to_string(elements) + " elements",
                          dims_str(buffer.dimensions()) + " (" + std::to_string(buffer.element_count()) + ")");
}

namespace {

bool is_e5m2(DType t) { return t == DType::kF8E5M2 || t == DType::kF8E5M2FNUZ; }
bool is_fnuz(DType t) { return t == DType::kF8E4M3FNUZ || t == DType::kF8E5M2FNUZ; }

// The element types of a call whose x has dtype `x` (checked as an operand) and whose attributes give its scales
// `mode`, or the error naming what is not.
ffi::ErrorOr<GemmTypes> check_types(const char* op, DType x, ScaleMode mode, const GemmArgs& a,
                                    const ffi::AnyBuffer& y, std::initializer_list<const ffi::AnyBuffer*> like_x) {
  const auto fail = [&](const char* name, const std::string& expected, ffi::DataType got) {
    return ffi::Unexpected(invalid_argument(op, name, expected, data_type_name(got)));
  };
  const std::string x_name = dtype_name(x);
  for (const ffi::AnyBuffer* r : like_x)
    if (r->element_count() && dtype_of(r->element_type()) != x)
      return fail("dtype of the gathered x", x_name, r->element_type());
  const bool has_bias = a.bias.element_count() != 0;
  if (!is_fp8(x)) {
    if (mode != ScaleMode::kNone)
      return ffi::Unexpected(invalid_argument(op, "scaling mode (config)", describe_scale_mode(ScaleMode::kNone) +
                                              " with " + x_name + " operands", describe_scale_mode(mode)));
    if (dtype_of(a.w.element_type()) != x) return fail("dtype of w", x_name + " (x's)", a.w.element_type());
    if (has_bias && dtype_of(a.bias.element_type()) != x) return fail("dtype of bias", x_name, a.bias.element_type());
    if (dtype_of(y.element_type()) != x) return fail("dtype of y", x_name, y.element_type());
    for (const ffi::AnyBuffer* scale : {a.x_scale, a.w_scale})
      if (scale != nullptr && scale->element_count() != 0)
        return ffi::Unexpected(invalid_argument(op, "scales", "none (f32[0]) with " + x_name + " operands",
                                                dims_str(scale->dimensions())));
    return GemmTypes::same(x);
  }
  if (a.x_scale == nullptr)
    return ffi::Unexpected(invalid_argument(op, "dtype of x", "bfloat16 or float16 (the fused kernels take no float8)",
                                            x_name));
  if (mode == ScaleMode::kNone)
    return ffi::Unexpected(invalid_argument(op, "scaling mode (config)",
                                            describe_scale_mode(ScaleMode::kTensor) + " or " +
                                                describe_scale_mode(ScaleMode::kBlock) + " with " + x_name +
                                                " operands",
                                            describe_scale_mode(mode)));
  const auto w = dtype_of(a.w.element_type());
  if (!w || !is_fp8(*w) || is_fnuz(*w) != is_fnuz(x))
    return fail("dtype of w", std::string("a float8 format of x's kind (") + (is_fnuz(x) ? "fnuz" : "OCP") + ")",
                a.w.element_type());
  if (is_e5m2(x) && is_e5m2(*w))
    return ffi::Unexpected(
        invalid_argument(op, "dtypes of x and w", "not both e5m2", x_name + " and " + dtype_name(*w)));
  const auto out = dtype_of(y.element_type());
  if (!out || !is_output(*out))
    return fail("dtype of y", dtype_choices([](DType t) { return is_output(t); }), y.element_type());
  const auto bias = has_bias ? dtype_of(a.bias.element_type()) : out;
  if (!bias || (*bias != *out && *bias != DType::kF32))
    return fail("dtype of bias", std::string(dtype_name(*out)) + " (y's) or float32", a.bias.element_type());
  for (const ffi::AnyBuffer* scale : {a.x_scale, a.w_scale})
    if (scale->element_type() != ffi::DataType::F32)
      return fail("dtype of scales", "float32 with float8 operands", scale->element_type());
  // Block scales' counts depend on the shapes: check_gemm checks them.
  const bool blocks = mode == ScaleMode::kBlock;
  if (!blocks)
    for (const auto& [name, scale] : {std::pair{"x_scale", a.x_scale}, std::pair{"w_scale", a.w_scale}})
      if (scale->element_count() != 1)
        return ffi::Unexpected(invalid_argument(op, name, "float32 [1] (scaling mode tensor)",
                                                dims_str(scale->dimensions())));
  return GemmTypes{x, *w, *out, *bias, true, blocks};
}

// A float8 call's block scales (core/block_scales.h) against its shapes: k and n whole blocks, w K-major,
// x_scale [k/128][batch * m] and w_scale [n/128][round_up(k/128, 4)] in elements. (Whether a bias may come with
// them depends on the schedule: pipelined::check_block_scales.)
ffi::Error check_block_scales(const char* op, const GemmArgs& a, int64_t batch, int64_t m, int64_t k, int64_t n,
                              bool w_kmajor) {
  if (k % kScaleBlock || n % kScaleBlock)
    return invalid_argument(op, "k and n", "multiples of " + std::to_string(kScaleBlock) + " with float8 block scales",
                            "k = " + std::to_string(k) + ", n = " + std::to_string(n));
  if (!w_kmajor) return invalid_argument(op, "layout of w", "[n, k] (w_kmajor) with float8 block scales", "[k, n]");
  const auto scales = [&](const char* name, const ffi::AnyBuffer& s, int64_t want, const char* layout) {
    if (static_cast<int64_t>(s.element_count()) == want) return ffi::Error::Success();
    return invalid_argument(op, name, std::to_string(want) + " block scales (" + layout + ", scaling mode block)",
                            dims_str(s.dimensions()) + " (" + std::to_string(s.element_count()) + ")");
  };
  if (auto e = scales("x_scale", *a.x_scale, x_block_scales(batch * m, k), "[k/128][rows of x]"); e.failure())
    return e;
  return scales("w_scale", *a.w_scale, w_block_scales(n, k), "[n/128][k/128 rounded up to a multiple of 4]");
}

}  // namespace

ffi::ErrorOr<GemmProblem> check_gemm(const char* op, const GemmArgs& a, const ffi::AnyBuffer& y,
                                     std::initializer_list<const ffi::AnyBuffer*> like_x, bool w_kmajor,
                                     int64_t scaling, bool fast_accumulation) {
  // Strings only on the error path: this runs on every call.
  ScaleMode mode;
  if (!scale_mode_of(scaling, &mode)) {
    std::string modes;
    for (ScaleMode m : kScaleModes) modes += (modes.empty() ? "" : ", ") + describe_scale_mode(m);
    return ffi::Unexpected(invalid_argument(op, "scaling mode (config)", "one of " + modes, std::to_string(scaling)));
  }
  const auto dtype = dtype_of(a.x.element_type());
  if (!dtype || !is_operand(*dtype))
    return ffi::Unexpected(invalid_argument(op, "dtype of x", dtype_choices([](DType t) { return is_operand(t); }),
                                            data_type_name(a.x.element_type())));
  auto types = check_types(op, *dtype, mode, a, y, like_x);
  if (types.has_error()) return ffi::Unexpected(types.error());
  if (fast_accumulation) {
    if (!types.value().scaled || types.value().blocks) {
      const std::string got = types.value().blocks ? "block scales" : data_type_name(a.x.element_type());
      return ffi::Unexpected(invalid_argument(op, "fast_accumulation", "tensor-scaled float8 operands", got));
    }
    types.value().fast_accumulation = true;
  }
  const auto xd = a.x.dimensions();
  const auto wd = a.w.dimensions();
  if (xd.size() < 2) return ffi::Unexpected(invalid_argument(op, "shape of x", "[..., m, k]", dims_str(xd)));
  const int64_t m = xd[xd.size() - 2];
  const int64_t k = xd[xd.size() - 1];
  if (wd.size() != 2 || (w_kmajor ? wd[1] : wd[0]) != k)
    return ffi::Unexpected(invalid_argument(op, "shape of w", w_kmajor ? "[n, k] with k = x's last dim" :
                                                                         "[k, n] with k = x's last dim",
                                            dims_str(wd) + " for x " + dims_str(xd)));
  const int64_t n = w_kmajor ? wd[0] : wd[1];
  if (a.bias.element_count() != 0 && static_cast<int64_t>(a.bias.element_count()) != n)
    return ffi::Unexpected(invalid_argument(op, "shape of bias", "[" + std::to_string(n) + "] or none",
                                            dims_str(a.bias.dimensions())));
  const int64_t vector = 16 / element_bytes(*dtype);
  if (k % vector || n % vector)
    return ffi::Unexpected(invalid_argument(op, "k and n", "multiples of " + std::to_string(vector),
                                            "k = " + std::to_string(k) + ", n = " + std::to_string(n)));
  const int64_t batch = leading_batch(xd);
  if (types.value().blocks)
    if (auto e = check_block_scales(op, a, batch, m, k, n, w_kmajor); e.failure()) return ffi::Unexpected(std::move(e));
  return GemmProblem::dense(types.value(), batch, m, k, n, w_kmajor, a.bias.element_count() != 0);
}

GemmOperands fused_operands(const GemmProblem& p, const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                            const ffi::AnyBuffer& bias, int64_t tile, int64_t comm_workgroups) {
  return GemmOperands{p.types.x, static_cast<int>(tile), p.w_kmajor, x.untyped_data(), w.untyped_data(),
                      p.bias ? bias.untyped_data() : nullptr, p.batch, p.k, p.n, static_cast<int>(comm_workgroups)};
}

CallContext call_context(const CallState& state, const GroupBinding& g, OpKind op) {
  const Workspace& ws = *g.ws;
  const uint64_t epoch = g.epochs != nullptr ? g.epochs->next() : 0;
  const bool slot_used = g.epochs != nullptr && g.epochs->slot_used(epoch);
  return CallContext{g.peers, epoch, state.site, slot_used, ws.watchdog(op), ws.trace_sink(), ws.limits()};
}

namespace {

ffi::Error launch_status(hipError_t launched, const char* op) {
  if (launched != hipSuccess)
    return ffi::Error::Internal(std::string("jax_overlap: launching ") + op + " failed: " +
                                hipGetErrorString(launched));
  return ffi::Error::Success();
}

}  // namespace

ffi::Error finish_local_launch(hipError_t launched, const LocalCall& lc, ffi::AnyBuffer out, hipStream_t stream,
                               const char* op) {
  if (launched == hipSuccess)
    launched = launch_poison_if_aborted(lc.ws->abort_flag(), out.untyped_data(), out.size_bytes(), nullptr, 0, stream);
  return launch_status(launched, op);
}

ffi::ErrorOr<LocalCall> local_call(const char* op, OpKind kind, const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                                   const ffi::AnyBuffer& bias, const ffi::AnyBuffer& out, ffi::AnyBuffer scratch,
                                   const FusedConfig& config, int32_t ordinal) {
  if (auto e = check_generation(static_cast<uint64_t>(config.generation)); e.failure())
    return ffi::Unexpected(std::move(e));
  const auto checked = check_gemm(op, GemmArgs{x, w, bias, nullptr, nullptr}, out, {}, config.w_kmajor != 0,
                                  static_cast<int64_t>(ScaleMode::kNone));
  if (checked.has_error()) return ffi::Unexpected(checked.error());
  const GemmProblem& p = checked.value();
  if (auto e = check_elements(op, "result y", out, p.batch * p.rows * p.n); e.failure())
    return ffi::Unexpected(std::move(e));
  const Workspace* ws = Runtime::instance().workspace(ordinal);
  if (ws == nullptr)
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kFailedPrecondition, not_initialized(ordinal).message));
  const int slots = static_cast<int>(config.tail_slots);
  if (config.tail_slots < 0 || scratch.size_bytes() != tail_scratch_bytes(static_cast<int>(config.tile), slots))
    return ffi::Unexpected(invalid_argument(op, "tail scratch",
                                            std::to_string(tail_scratch_bytes(static_cast<int>(config.tile), slots)) +
                                                " bytes for config.tail_slots = " + std::to_string(slots),
                                            std::to_string(scratch.size_bytes()) + " bytes"));
  if (auto e = recorded_error(*ws); e.failure()) return ffi::Unexpected(std::move(e));
  LocalCall c{p, fused_operands(p, x, w, bias, config.tile, /*comm_workgroups=*/0), CallContext{},
              TailScratch{slots > 0 ? scratch.untyped_data() : nullptr, slots, ws->timeout_ticks}, ws};
  c.ctx.peers.world = 1;
  c.ctx.wd = ws->watchdog(kind);
  c.ctx.trace = ws->trace_sink();
  c.ctx.limits = ws->limits();
  return c;
}

namespace {

ffi::Error sync_verdict(const Workspace& ws, hipStream_t stream, const char* op) {
  if (!ws.sync_after_launch) return ffi::Error::Success();
  const hipError_t synced = hipStreamSynchronize(stream);
  if (synced != hipSuccess)
    return ffi::Error::Internal(std::string("jax_overlap: ") + op + " failed: " + hipGetErrorString(synced));
  return recorded_error(ws);
}

}  // namespace

ffi::Error finish_launch(hipError_t launched, const Workspace& ws, hipStream_t stream, const char* op) {
  if (launched != hipSuccess) return launch_status(launched, op);
  return sync_verdict(ws, stream, op);
}

ffi::Error finish_launch(const Status& enqueued, const Workspace& ws, hipStream_t stream, const char* op) {
  if (!enqueued.ok()) return ffi::Error::Internal(std::string("jax_overlap ") + op + ": " + enqueued.message);
  return sync_verdict(ws, stream, op);
}

}  // namespace jo
