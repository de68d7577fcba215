// FFI handler of the fused all-gather + GEMM: check every buffer once, bind
// the call to its group, launch.
#include <string>

#include "ffi/common.h"
#include "ffi/handlers.h"
#include "kernels/ag_matmul.h"

namespace jo {
namespace {

ffi::ErrorOr<std::unique_ptr<CallState>> AgMatmulInstantiate(FusedConfig config, ffi::Span<const int64_t> groups,
                                                             int64_t world) {
  return make_call_state(groups, world, config.region_offset, config.region_bytes);
}

ffi::Error AgMatmulExecute(hipStream_t stream, int32_t ordinal, CallState* state, ffi::AnyBuffer x,
                           ffi::AnyBuffer w, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                           ffi::Result<ffi::AnyBuffer> gathered, FusedConfig config,
                           ffi::Span<const int64_t> /*groups*/, int64_t world) {
  const auto dtype = kernel_dtype(x.element_type());
  if (!dtype) return ffi::Error::InvalidArgument("jax_overlap ag_matmul: x must be bfloat16 or float16");
  if (w.element_type() != x.element_type() || y->element_type() != x.element_type() ||
      (bias.element_count() && bias.element_type() != x.element_type()) ||
      (gathered->element_count() && gathered->element_type() != x.element_type()))
    return ffi::Error::InvalidArgument("jax_overlap ag_matmul: x, w, bias, y and gathered must share x's dtype");
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() < 2 || wd.size() != 2)
    return ffi::Error::InvalidArgument("jax_overlap ag_matmul: x must be [..., m, k] and w 2-D, got x " +
                                       dims_str(xd) + ", w " + dims_str(wd));
  const int64_t m = xd[xd.size() - 2], k = xd[xd.size() - 1], batch = leading_batch(xd);
  const int64_t wk = config.w_kmajor ? wd[1] : wd[0];
  const int64_t n = config.w_kmajor ? wd[0] : wd[1];
  if (wk != k)
    return ffi::Error::InvalidArgument("jax_overlap ag_matmul: w " + dims_str(wd) + " does not contract with x " +
                                       dims_str(xd));
  if (bias.element_count() != 0 && static_cast<int64_t>(bias.element_count()) != n)
    return ffi::Error::InvalidArgument("jax_overlap ag_matmul: bias must have " + std::to_string(n) + " elements");
  if (static_cast<int64_t>(y->element_count()) != batch * world * m * n ||
      static_cast<int64_t>(gathered->element_count()) != (world > 1 ? batch * world * m * k : 0))
    return ffi::Error::InvalidArgument("jax_overlap ag_matmul: result shapes do not match x, w and the group");
  if (k % 8 || n % 8)
    return ffi::Error::InvalidArgument("jax_overlap ag_matmul: k and n must be multiples of 8");

  const auto bound = prepare_call(state, ordinal);
  if (bound.has_error()) return bound.error();
  const GroupBinding& g = *bound.value();
  AgMatmulLaunch l{};
  l.dtype = *dtype;
  l.tile = static_cast<int>(config.tile);
  l.w_kmajor = config.w_kmajor != 0;
  l.x = x.untyped_data();
  l.w = w.untyped_data();
  l.bias = bias.element_count() ? bias.untyped_data() : nullptr;
  l.y = y->untyped_data();
  l.gathered = world > 1 ? gathered->untyped_data() : nullptr;
  l.batch = batch;
  l.m = m;
  l.k = k;
  l.n = n;
  l.peers = g.peers;
  l.epoch = g.epoch ? ++*g.epoch : 0;
  l.workers = static_cast<int>(config.workers);
  l.chunk_k = static_cast<int>(config.chunk_k);
  l.wd = make_watchdog(*g.ws, OpKind::kAgMatmul);
  l.trace = g.ws->trace_sink();
  l.limits = g.ws->limits();
  return finish_launch(launch_ag_matmul(l, stream), *g.ws, stream, "ag_matmul");
}

}  // namespace
}  // namespace jo

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoAgMatmulInstantiate, jo::AgMatmulInstantiate,
                              xla::ffi::Ffi::BindInstantiate()
                                  .Attr<jo::FusedConfig>("config")
                                  .Attr<xla::ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("world"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoAgMatmulExecute, jo::AgMatmulExecute,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<hipStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Ctx<xla::ffi::State<jo::CallState>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [..., m, k]
                                  .Arg<xla::ffi::AnyBuffer>()  // w [k, n] or [n, k]
                                  .Arg<xla::ffi::AnyBuffer>()  // bias [n], or [0] for none
                                  .Ret<xla::ffi::AnyBuffer>()  // y [..., world * m, n]
                                  .Ret<xla::ffi::AnyBuffer>()  // gathered [..., world * m, k], [0] if world == 1
                                  .Attr<jo::FusedConfig>("config")
                                  .Attr<xla::ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("world"));
