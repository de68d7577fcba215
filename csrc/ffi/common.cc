#include "ffi/common.h"

#include <string>

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

Watchdog make_watchdog(const Workspace& ws, OpKind op) {
  return Watchdog{ws.error_device, ws.abort_flag(), ws.timeout_ticks, static_cast<uint32_t>(op)};
}

ffi::Error finish_launch(hipError_t launched, const Workspace& ws, hipStream_t stream, const char* op) {
  if (launched != hipSuccess)
    return ffi::Error::Internal(std::string("jax_overlap: launching ") + op + " failed: " +
                                hipGetErrorString(launched));
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
