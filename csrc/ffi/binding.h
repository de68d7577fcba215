// The FFI signatures of the handlers, built from what they share: a handler's
// buffers are all AnyBuffer, so a signature is its context, a count of
// arguments and results, and its attributes. The buffers' meanings live in
// the handler's parameter list, which XLA_FFI_DEFINE_HANDLER_SYMBOL checks
// against the binding at compile time.
#pragma once

#include <cstdint>
#include <utility>

#include "ffi/common.h"

namespace jo {

// `binding` followed by kArgs AnyBuffer arguments, then kRets AnyBuffer results (one at least: a Binding can only
// be made by adding to one, never copied or moved out of a function).
template <int kArgs, int kRets, typename Binding>
auto with_buffers(Binding&& binding) {
  static_assert(kArgs >= 0 && kRets >= 0 && kArgs + kRets > 0, "with_buffers adds one buffer at least");
  if constexpr (kArgs + kRets == 1) {
    if constexpr (kArgs == 1) {
      return std::move(binding).template Arg<ffi::AnyBuffer>();
    } else {
      return std::move(binding).template Ret<ffi::AnyBuffer>();
    }
  } else if constexpr (kArgs > 0) {
    return with_buffers<kArgs - 1, kRets>(std::move(binding).template Arg<ffi::AnyBuffer>());
  } else {
    return with_buffers<0, kRets - 1>(std::move(binding).template Ret<ffi::AnyBuffer>());
  }
}

// A stateless handler: stream and device ordinal, then its buffers.
template <int kArgs, int kRets>
auto stream_binding() {
  return with_buffers<kArgs, kRets>(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<hipStream_t>>().Ctx<ffi::DeviceOrdinal>());
}

// The attributes that make a call of a group: its launch config, the groups and the world
// (make_call_state), in the order the instantiate and execute handlers take them.
template <typename Config, typename Binding>
auto with_group_attrs(Binding&& binding) {
  return std::move(binding)
      .template Attr<Config>("config")
      .template Attr<ffi::Span<const int64_t>>("groups")
      .template Attr<int64_t>("world");
}

// A group op's instantiate handler.
template <typename Config>
auto group_instantiate_binding() {
  return with_group_attrs<Config>(ffi::Ffi::BindInstantiate());
}

// A group op's execute handler: stream, device ordinal and the call's state, its buffers, the group's attributes.
template <typename Config, int kArgs, int kRets>
auto group_execute_binding() {
  return with_group_attrs<Config>(with_buffers<kArgs, kRets>(
      ffi::Ffi::Bind().Ctx<ffi::PlatformStream<hipStream_t>>().Ctx<ffi::DeviceOrdinal>().Ctx<ffi::State<CallState>>()));
}

// The pipelined ops' handlers add the schedule's stage sizes.
inline auto pipelined_instantiate_binding() {
  return group_instantiate_binding<PipelinedConfig>().Attr<ffi::Span<const int64_t>>("stages");
}

template <int kArgs, int kRets>
auto pipelined_execute_binding() {
  return group_execute_binding<PipelinedConfig, kArgs, kRets>().template Attr<ffi::Span<const int64_t>>("stages");
}

}  // namespace jo
