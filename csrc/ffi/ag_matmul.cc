// FFI handler of the fused all-gather + GEMM: check every buffer once, bind
// the call to its group, launch.
#include <string>

#include "ffi/binding.h"
#include "ffi/common.h"
#include "ffi/handlers.h"
#include "kernels/ag_matmul.h"
#include "kernels/pipeline_kernels.h"

namespace jo {
namespace {

ffi::ErrorOr<std::unique_ptr<CallState>> AgMatmulInstantiate(FusedConfig config, ffi::Span<const int64_t> groups,
                                                             int64_t world) {
  return make_call_state(groups, world, {config.region_offset, config.region_bytes, config.site, config.generation});
}

// x [..., m, k], w [k, n] or [n, k], bias [n] or [0] for none; y [..., world * m, n], gathered [..., world * m, k]
// ([0] at world 1).
ffi::Error AgMatmulExecute(hipStream_t stream, int32_t ordinal, CallState* state, ffi::AnyBuffer x,
                           ffi::AnyBuffer w, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                           ffi::Result<ffi::AnyBuffer> gathered, FusedConfig config,
                           ffi::Span<const int64_t> /*groups*/, int64_t world) {
  const auto checked =
      check_gemm("ag_matmul", GemmArgs{x, w, bias, nullptr, nullptr}, *y, {&*gathered}, config.w_kmajor != 0,
                 static_cast<int64_t>(ScaleMode::kNone));
  if (checked.has_error()) return checked.error();
  const GemmProblem& p = checked.value();
  const GemmOperands op = fused_operands(p, x, w, bias, config.tile, config.comm_workgroups);
  const int64_t m = p.rows;
  if (auto e = check_elements("ag_matmul", "result y", *y, op.batch * world * m * op.n); e.failure()) return e;
  if (auto e = check_elements("ag_matmul", "result gathered", *gathered, world > 1 ? op.batch * world * m * op.k : 0);
      e.failure())
    return e;

  const EnqueueClaim claim(ordinal);  // until the launches below are enqueued
  const auto bound = prepare_call("ag_matmul", state, claim);
  if (bound.has_error()) return bound.error();
  const GroupBinding& g = *bound.value();
  const AgMatmulLaunch l{op, y->untyped_data(), world > 1 ? gathered->untyped_data() : nullptr, m,
                         static_cast<int>(config.chunk_k), call_context(*state, g, OpKind::kAgMatmul)};
  hipError_t launched = launch_ag_matmul(l, stream);
  // A timed-out call's tiles hold whatever arrived: none of it may look like a result.
  if (launched == hipSuccess)
    launched = launch_poison_if_aborted(g.ws->abort_flag(), y->untyped_data(), y->size_bytes(),
                                        gathered->untyped_data(), gathered->size_bytes(), stream);
  return finish_launch(launched, *g.ws, stream, "ag_matmul");
}

// A group of one: y = x @ w (+ bias), nothing gathered.
ffi::Error AgMatmulLocalExecute(hipStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                                ffi::Result<ffi::AnyBuffer> scratch, FusedConfig config) {
  const auto c = local_call("ag_matmul", OpKind::kAgMatmul, x, w, bias, *y, *scratch, config, ordinal);
  if (c.has_error()) return c.error();
  const LocalCall& lc = c.value();
  const AgMatmulLaunch l{lc.op, y->untyped_data(), nullptr, lc.problem.rows, static_cast<int>(config.chunk_k), lc.ctx,
                         lc.tail};
  return finish_local_launch(launch_ag_matmul(l, stream), lc, *y, stream, "ag_matmul");
}

}  // namespace
}  // namespace jo

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoAgMatmulInstantiate, jo::AgMatmulInstantiate,
                              jo::group_instantiate_binding<jo::FusedConfig>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JoAgMatmulExecute, jo::AgMatmulExecute,
                              (jo::group_execute_binding<jo::FusedConfig, 3, 2>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JoAgMatmulLocalExecute, jo::AgMatmulLocalExecute, jo::local_gemm_binding());
