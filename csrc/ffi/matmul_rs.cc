// FFI handler of the fused GEMM + reduce-scatter: check every buffer once,
// bind the call to its group, launch.
#include <string>

#include "ffi/common.h"
#include "ffi/handlers.h"
#include "kernels/matmul_rs.h"

namespace jo {
namespace {

ffi::ErrorOr<std::unique_ptr<CallState>> MatmulRsInstantiate(FusedConfig config, ffi::Span<const int64_t> groups,
                                                             int64_t world) {
  return make_call_state(groups, world, config.region_offset, config.region_bytes);
}

ffi::Error MatmulRsExecute(hipStream_t stream, int32_t ordinal, CallState* state, ffi::AnyBuffer x,
                           ffi::AnyBuffer w, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out,
                           FusedConfig config, ffi::Span<const int64_t> /*groups*/, int64_t world) {
  const auto call = gemm_call("matmul_rs", x, w, bias, {&*out}, config);
  if (call.has_error()) return call.error();
  const GemmOperands& op = call.value().op;
  const int64_t m_total = call.value().m;
  if (m_total % world != 0)
    return ffi::Error::InvalidArgument("jax_overlap matmul_rs: rows " + std::to_string(m_total) +
                                       " not divisible by the group size " + std::to_string(world));
  if (static_cast<int64_t>(out->element_count()) != op.batch * (m_total / world) * op.n)
    return ffi::Error::InvalidArgument("jax_overlap matmul_rs: output shape does not match x, w and the group");

  const auto bound = prepare_call(state, ordinal);
  if (bound.has_error()) return bound.error();
  const GroupBinding& g = *bound.value();
  const MatmulRsLaunch l{op, out->untyped_data(), m_total, call_context(g, OpKind::kMatmulRs)};
  return finish_launch(launch_matmul_rs(l, stream), *g.ws, stream, "matmul_rs");
}

// A group of one: out = x @ w (+ bias), nothing to reduce.
ffi::Error MatmulRsLocalExecute(hipStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::AnyBuffer> scratch, FusedConfig config) {
  const auto c = local_call("matmul_rs", x, w, bias, *out, *scratch, config, ordinal);
  if (c.has_error()) return c.error();
  const LocalCall& lc = c.value();
  const MatmulRsLaunch l{lc.call.op, out->untyped_data(), lc.call.m, lc.ctx, lc.tail};
  return launch_status(launch_matmul_rs(l, stream), "matmul_rs");
}

}  // namespace
}  // namespace jo

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoMatmulRsInstantiate, jo::MatmulRsInstantiate,
                              xla::ffi::Ffi::BindInstantiate()
                                  .Attr<jo::FusedConfig>("config")
                                  .Attr<xla::ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("world"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoMatmulRsExecute, jo::MatmulRsExecute,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<hipStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Ctx<xla::ffi::State<jo::CallState>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [..., m_total, k]
                                  .Arg<xla::ffi::AnyBuffer>()  // w [k, n] or [n, k]
                                  .Arg<xla::ffi::AnyBuffer>()  // bias [n], or [0] for none
                                  .Ret<xla::ffi::AnyBuffer>()  // out [..., m_total / world, n]
                                  .Attr<jo::FusedConfig>("config")
                                  .Attr<xla::ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("world"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoMatmulRsLocalExecute, jo::MatmulRsLocalExecute, jo::local_gemm_binding(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
