// FFI handler of the fused GEMM + reduce-scatter: check every buffer once,
// bind the call to its group, launch.
#include <string>

#include "ffi/binding.h"
#include "ffi/common.h"
#include "ffi/handlers.h"
#include "kernels/matmul_rs.h"
#include "kernels/pipeline_kernels.h"

namespace jo {
namespace {

ffi::ErrorOr<std::unique_ptr<CallState>> MatmulRsInstantiate(FusedConfig config, ffi::Span<const int64_t> groups,
                                                             int64_t world) {
  return make_call_state(groups, world, {config.region_offset, config.region_bytes, config.site, config.generation});
}

// x [..., m_total, k], w [k, n] or [n, k], bias [n] or [0] for none; out [..., m_total / world, n].
ffi::Error MatmulRsExecute(hipStream_t stream, int32_t ordinal, CallState* state, ffi::AnyBuffer x,
                           ffi::AnyBuffer w, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out,
                           FusedConfig config, ffi::Span<const int64_t> /*groups*/, int64_t world) {
  const auto checked = check_gemm("matmul_rs", GemmArgs{x, w, bias, nullptr, nullptr}, *out, {}, config.w_kmajor != 0,
                                  static_cast<int64_t>(ScaleMode::kNone));
  if (checked.has_error()) return checked.error();
  const GemmProblem& p = checked.value();
  const GemmOperands op = fused_operands(p, x, w, bias, config.tile, config.comm_workgroups);
  const int64_t m_total = p.rows;
  if (m_total % world != 0)
    return invalid_argument("matmul_rs", "rows of x", "a multiple of the group size " + std::to_string(world),
                            std::to_string(m_total));
  if (auto e = check_elements("matmul_rs", "result", *out, op.batch * (m_total / world) * op.n); e.failure()) return e;
  // The kernel stages each rank's partial in the result's dtype, where float16 makes a partial past 65504 inf
  // while the sum is in range (core/dtype.h partial_dtype); planning.eligible declines such calls.
  if (world > 1 && partial_dtype(p.types.out) != p.types.out)
    return invalid_argument("matmul_rs", "dtype of the result with peers",
                            "bfloat16 (the fused kernel stages partials in the result's dtype; the pipelined "
                            "algorithm stages float16's in float32)",
                            dtype_name(p.types.out));

  const EnqueueClaim claim(ordinal);  // until the launches below are enqueued
  const auto bound = prepare_call("matmul_rs", state, claim);
  if (bound.has_error()) return bound.error();
  const GroupBinding& g = *bound.value();
  const MatmulRsLaunch l{op, out->untyped_data(), m_total, call_context(*state, g, OpKind::kMatmulRs)};
  hipError_t launched = launch_matmul_rs(l, stream);
  // Workgroups of a timed-out call leave the previous output in place: replace it.
  if (launched == hipSuccess)
    launched = launch_poison_if_aborted(g.ws->abort_flag(), out->untyped_data(), out->size_bytes(), nullptr, 0, stream);
  return finish_launch(launched, *g.ws, stream, "matmul_rs");
}

// A group of one: out = x @ w (+ bias), nothing to reduce.
ffi::Error MatmulRsLocalExecute(hipStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::AnyBuffer> scratch, FusedConfig config) {
  const auto c = local_call("matmul_rs", OpKind::kMatmulRs, x, w, bias, *out, *scratch, config, ordinal);
  if (c.has_error()) return c.error();
  const LocalCall& lc = c.value();
  const MatmulRsLaunch l{lc.op, out->untyped_data(), lc.problem.rows, lc.ctx, lc.tail};
  return finish_local_launch(launch_matmul_rs(l, stream), lc, *out, stream, "matmul_rs");
}

}  // namespace
}  // namespace jo

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoMatmulRsInstantiate, jo::MatmulRsInstantiate,
                              jo::group_instantiate_binding<jo::FusedConfig>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JoMatmulRsExecute, jo::MatmulRsExecute,
                              (jo::group_execute_binding<jo::FusedConfig, 3, 1>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JoMatmulRsLocalExecute, jo::MatmulRsLocalExecute, jo::local_gemm_binding());
