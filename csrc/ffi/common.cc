#include "ffi/common.h"

#include <string>

#include "kernels/ag_matmul.h"

namespace jo {

ffi::TypeId CallState::id = {};
const XLA_FFI_TypeInfo kCallStateTypeInfo = ffi::MakeTypeInfo<CallState>();

ffi::ErrorOr<std::unique_ptr<CallState>> make_call_state(ffi::Span<const int64_t> groups, int64_t world,
                                                          int64_t region_offset, int64_t region_bytes) {
  if (world < 1 || world > kMaxWorld)
    return ffi::Unexpected(ffi::Error::InvalidArgument("jax_overlap: group size " + std::to_string(world) + " is not in [1, " +
                                       std::to_string(kMaxWorld) + "]"));
  auto state = std::make_unique<CallState>();
  state->groups.assign(groups.begin(), groups.end());
  state->world = static_cast<int>(world);
  state->region_offset = static_cast<uint64_t>(region_offset);
  state->region_bytes = static_cast<uint64_t>(region_bytes);
  return state;
}

ffi::ErrorOr<const GroupBinding*> prepare_call(CallState* state, int32_t ordinal) {
  if (ordinal < 0 || ordinal >= kMaxLocalDevices)
    return ffi::Unexpected(ffi::Error::InvalidArgument("jax_overlap: device ordinal " + std::to_string(ordinal) +
                                                       " out of range"));
  GroupBinding& binding = state->bindings[ordinal];
  if (!state->bound[ordinal]) {
    const Status s = Runtime::instance().bind_group(ordinal, state->groups.data(), state->groups.size(),
                                                    state->world, state->region_offset, state->region_bytes,
                                                    &binding);
    if (!s.ok()) return ffi::Unexpected(internal_error(s));
    state->bound[ordinal] = true;
  }
  const Workspace& ws = *binding.ws;
  if (*static_cast<volatile uint32_t*>(&ws.error_host->valid) != 0)
    return ffi::Unexpected(ffi::Error::Internal(describe_error(*ws.error_host, ws.info.ticks_per_second)));
  return &binding;
}

std::optional<DType> kernel_dtype(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::BF16: return DType::kBF16;
    case ffi::DataType::F16: return DType::kF16;
    default: return std::nullopt;
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

ffi::ErrorOr<GemmCall> gemm_call(const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                                 const ffi::AnyBuffer& bias, std::initializer_list<const ffi::AnyBuffer*> results,
                                 const FusedConfig& config) {
  // Strings only on the error path: this runs on every call.
  auto invalid = [&](const std::string& what) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(std::string("jax_overlap ") + op + ": " + what));
  };
  const auto dtype = kernel_dtype(x.element_type());
  if (!dtype) return invalid("x must be bfloat16 or float16");
  bool same = w.element_type() == x.element_type() && (!bias.element_count() || bias.element_type() == x.element_type());
  for (const ffi::AnyBuffer* r : results) same = same && (!r->element_count() || r->element_type() == x.element_type());
  if (!same) return invalid("w, bias and the results must have x's dtype");
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() < 2 || wd.size() != 2)
    return invalid("x must be [..., m, k] and w 2-D, got x " + dims_str(xd) + ", w " + dims_str(wd));
  GemmCall c{};
  c.m = xd[xd.size() - 2];
  c.op.k = xd[xd.size() - 1];
  c.op.n = config.w_kmajor ? wd[0] : wd[1];
  if ((config.w_kmajor ? wd[1] : wd[0]) != c.op.k)
    return invalid("w " + dims_str(wd) + " does not contract with x " + dims_str(xd));
  if (bias.element_count() != 0 && static_cast<int64_t>(bias.element_count()) != c.op.n)
    return invalid("bias must have " + std::to_string(c.op.n) + " elements");
  if (c.op.k % 8 || c.op.n % 8) return invalid("k and n must be multiples of 8");
  c.op.dtype = *dtype;
  c.op.tile = static_cast<int>(config.tile);
  c.op.w_kmajor = config.w_kmajor != 0;
  c.op.x = x.untyped_data();
  c.op.w = w.untyped_data();
  c.op.bias = bias.element_count() ? bias.untyped_data() : nullptr;
  c.op.batch = leading_batch(xd);
  c.op.comm_workgroups = static_cast<int>(config.comm_workgroups);
  return c;
}

CallContext call_context(const GroupBinding& g, OpKind op) {
  const Workspace& ws = *g.ws;
  return CallContext{g.peers, g.epoch ? ++*g.epoch : 0u,
                     Watchdog{ws.error_device, ws.abort_flag(), ws.timeout_ticks, static_cast<uint32_t>(op)},
                     ws.trace_sink(), ws.limits()};
}

ffi::Error launch_status(hipError_t launched, const char* op) {
  if (launched != hipSuccess)
    return ffi::Error::Internal(std::string("jax_overlap: launching ") + op + " failed: " +
                                hipGetErrorString(launched));
  return ffi::Error::Success();
}

ffi::ErrorOr<LocalCall> local_call(const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                                   const ffi::AnyBuffer& bias, const ffi::AnyBuffer& out, ffi::AnyBuffer scratch,
                                   const FusedConfig& config, int32_t ordinal) {
  auto call = gemm_call(op, x, w, bias, {&out}, config);
  if (call.has_error()) return ffi::Unexpected(call.error());
  const GemmOperands& g = call.value().op;
  if (static_cast<int64_t>(out.element_count()) != g.batch * call.value().m * g.n)
    return ffi::Unexpected(
        ffi::Error::InvalidArgument(std::string("jax_overlap ") + op + ": result shape does not match x and w"));
  const Workspace* ws = Runtime::instance().workspace(ordinal);
  if (ws == nullptr)
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kFailedPrecondition, not_initialized(ordinal).message));
  const int slots = static_cast<int>(config.tail_slots);
  if (config.tail_slots < 0 || scratch.size_bytes() != tail_scratch_bytes(static_cast<int>(config.tile), slots))
    return ffi::Unexpected(ffi::Error::InvalidArgument(std::string("jax_overlap ") + op +
                                                       ": tail scratch does not match config.tail_slots"));
  LocalCall c{call.value(), CallContext{},
              TailScratch{slots > 0 ? scratch.untyped_data() : nullptr, slots, ws->timeout_ticks}};
  c.ctx.peers.world = 1;
  c.ctx.trace = ws->trace_sink();
  c.ctx.limits = ws->limits();
  return c;
}

ffi::Error finish_launch(hipError_t launched, const Workspace& ws, hipStream_t stream, const char* op) {
  if (launched != hipSuccess) return launch_status(launched, op);
  if (ws.sync_after_launch) {
    const hipError_t synced = hipStreamSynchronize(stream);
    if (synced != hipSuccess)
      return ffi::Error::Internal(std::string("jax_overlap: ") + op + " failed: " + hipGetErrorString(synced));
    if (*static_cast<volatile uint32_t*>(&ws.error_host->valid) != 0)
      return ffi::Error::Internal(describe_error(*ws.error_host, ws.info.ticks_per_second));
  }
  return ffi::Error::Success();
}

}  // namespace jo
