// FFI handler of the runtime's all-gather (gather along axis -2, any dtype).
#include <string>

#include "ffi/binding.h"
#include "ffi/common.h"
#include "ffi/handlers.h"
#include "kernels/all_gather.h"
#include "kernels/pipeline_kernels.h"

namespace jo {
namespace {

ffi::ErrorOr<std::unique_ptr<CallState>> AllGatherInstantiate(RegionConfig config, ffi::Span<const int64_t> groups,
                                                              int64_t world) {
  return make_call_state(groups, world, {config.region_offset, config.region_bytes, config.site, config.generation});
}

// x [..., m, cols]; gathered [..., world * m, cols].
ffi::Error AllGatherExecute(hipStream_t stream, int32_t ordinal, CallState* state, ffi::AnyBuffer x,
                            ffi::Result<ffi::AnyBuffer> gathered, RegionConfig /*config*/,
                            ffi::Span<const int64_t> /*groups*/, int64_t world) {
  const auto xd = x.dimensions();
  if (xd.size() < 2)
    return ffi::Error::InvalidArgument("jax_overlap all_gather: x must be [..., m, cols], got " + dims_str(xd));
  const int64_t m = xd[xd.size() - 2];
  const int64_t row_bytes = xd[xd.size() - 1] * static_cast<int64_t>(ffi::ByteWidth(x.element_type()));
  if (row_bytes % 16 != 0)
    return ffi::Error::InvalidArgument("jax_overlap all_gather: rows must be a multiple of 16 bytes, got " +
                                       std::to_string(row_bytes));
  if (gathered->element_count() != x.element_count() * static_cast<size_t>(world) ||
      gathered->element_type() != x.element_type())
    return ffi::Error::InvalidArgument("jax_overlap all_gather: result must be world times x's size, same dtype");
  if (world < 2) return ffi::Error::InvalidArgument("jax_overlap all_gather: needs a group of 2 or more");

  const EnqueueClaim claim(ordinal);  // until the launches below are enqueued
  const auto bound = prepare_call("all_gather", state, claim);
  if (bound.has_error()) return bound.error();
  const GroupBinding& g = *bound.value();
  AllGatherLaunch l{};
  l.x = x.untyped_data();
  l.gathered = gathered->untyped_data();
  l.batch = leading_batch(xd);
  l.m = m;
  l.row_bytes = row_bytes;
  l.ctx = call_context(*state, g, OpKind::kAllGather);
  hipError_t launched = launch_all_gather(l, stream);
  if (launched == hipSuccess)
    launched = launch_poison_if_aborted(g.ws->abort_flag(), gathered->untyped_data(), gathered->size_bytes(), nullptr,
                                        0, stream);
  return finish_launch(launched, *g.ws, stream, "all_gather");
}

}  // namespace
}  // namespace jo

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoAllGatherInstantiate, jo::AllGatherInstantiate,
                              jo::group_instantiate_binding<jo::RegionConfig>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JoAllGatherExecute, jo::AllGatherExecute,
                              (jo::group_execute_binding<jo::RegionConfig, 1, 1>()));
