// FFI handlers of the pipelined algorithm (pipelined/schedule.h): check every
// buffer once, bind the call to its group, enqueue the schedule on XLA's stream
// and the side streams. A group of one is the vendor GEMM alone, on XLA's
// stream and command-buffer compatible.
#include <string>

#include "blas/gemm.h"
#include "ffi/common.h"
#include "ffi/handlers.h"
#include "pipelined/schedule.h"

namespace jo {
namespace {

ffi::ErrorOr<std::unique_ptr<CallState>> PipelinedInstantiate(PipelinedConfig config, ffi::Span<const int64_t> groups,
                                                              int64_t world, ffi::Span<const int64_t> stages) {
  auto state = make_call_state(groups, world,
                               {config.region_offset, config.region_bytes, config.site, config.generation});
  if (state.has_error()) return state;
  state.value()->stages.assign(stages.begin(), stages.end());
  return state;
}

// The checked operands of a pipelined call with `results`, and its scratch size checked.
ffi::ErrorOr<pipelined::Operands> operands(const char* name, OpKind kind, const ffi::AnyBuffer& x,
                                           const ffi::AnyBuffer& w, const ffi::AnyBuffer& bias,
                                           std::initializer_list<const ffi::AnyBuffer*> results,
                                           const ffi::AnyBuffer& scratch, bool w_kmajor, int world) {
  const auto call = gemm_call(name, x, w, bias, results, w_kmajor);
  if (call.has_error()) return ffi::Unexpected(call.error());
  const GemmOperands& g = call.value().op;
  pipelined::Operands op{};
  op.dtype = g.dtype;
  op.x = g.x;
  op.w = g.w;
  op.bias = g.bias;
  op.batch = g.batch;
  op.m = call.value().m;
  op.k = g.k;
  op.n = g.n;
  op.w_kmajor = w_kmajor;
  op.scratch = scratch.untyped_data();
  const uint64_t want = pipelined::scratch_bytes(kind, world, op.batch, op.m, op.n, 2, /*loopback=*/false);
  if (scratch.size_bytes() != want)
    return ffi::Unexpected(
        invalid_argument(name, "scratch", std::to_string(want) + " bytes", std::to_string(scratch.size_bytes())));
  return op;
}

// Binds the call and enqueues it; `enqueue` is the op's schedule.
template <class Enqueue>
ffi::Error run(const char* name, OpKind kind, hipStream_t stream, int32_t ordinal, CallState* state,
               pipelined::Operands& op, Enqueue&& enqueue) {
  const Status stages = pipelined::check_stages(kind, state->world, state->stages.data(),
                                                static_cast<int>(state->stages.size()));
  if (!stages.ok()) return ffi::Error::InvalidArgument(stages.message);
  op.stages = state->stages.data();
  op.stage_count = static_cast<int>(state->stages.size());
  const auto bound = prepare_call(state, ordinal);
  if (bound.has_error()) return bound.error();
  const GroupBinding& g = *bound.value();
  pipelined::Context ctx{};
  JO_FFI_RETURN_IF_ERROR(Runtime::instance().side_streams(g.ws, &ctx.streams));
  JO_FFI_RETURN_IF_ERROR(blas::DeviceBlas::get(ordinal, &ctx.blas));
  ctx.peers = g.peers;
  ctx.epoch = g.epochs->next();
  ctx.site = state->site;
  ctx.slot_used = g.epochs->slot_used(ctx.epoch);
  ctx.wd = g.ws->watchdog(kind);
  ctx.sm_count = g.ws->info.sm_count;
  return finish_launch(enqueue(op, ctx, stream), *g.ws, stream, name);
}

ffi::Error AgMatmulPipelinedExecute(hipStream_t stream, int32_t ordinal, CallState* state, ffi::AnyBuffer x,
                                    ffi::AnyBuffer w, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                                    ffi::Result<ffi::AnyBuffer> gathered, ffi::Result<ffi::AnyBuffer> scratch,
                                    PipelinedConfig config, ffi::Span<const int64_t> /*groups*/, int64_t world,
                                    ffi::Span<const int64_t> /*stages*/) {
  auto op = operands("ag_matmul", OpKind::kAgMatmul, x, w, bias, {&*y, &*gathered}, *scratch, config.w_kmajor != 0,
                     static_cast<int>(world));
  if (op.has_error()) return op.error();
  pipelined::Operands& o = op.value();
  if (auto e = check_elements("ag_matmul", "result y", *y, o.batch * world * o.m * o.n); e.failure()) return e;
  if (auto e = check_elements("ag_matmul", "result gathered", *gathered, o.batch * world * o.m * o.k); e.failure())
    return e;
  o.out = y->untyped_data();
  o.gathered = gathered->untyped_data();
  return run("ag_matmul", OpKind::kAgMatmul, stream, ordinal, state, o, pipelined::enqueue_ag_matmul);
}

ffi::Error MatmulRsPipelinedExecute(hipStream_t stream, int32_t ordinal, CallState* state, ffi::AnyBuffer x,
                                    ffi::AnyBuffer w, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out,
                                    ffi::Result<ffi::AnyBuffer> scratch, PipelinedConfig config,
                                    ffi::Span<const int64_t> /*groups*/, int64_t world,
                                    ffi::Span<const int64_t> /*stages*/) {
  auto op = operands("matmul_rs", OpKind::kMatmulRs, x, w, bias, {&*out}, *scratch, config.w_kmajor != 0,
                     static_cast<int>(world));
  if (op.has_error()) return op.error();
  pipelined::Operands& o = op.value();
  if (o.m % world != 0)
    return invalid_argument("matmul_rs", "rows of x", "a multiple of the group size " + std::to_string(world),
                            std::to_string(o.m));
  if (auto e = check_elements("matmul_rs", "result", *out, o.batch * (o.m / world) * o.n); e.failure()) return e;
  o.out = out->untyped_data();
  return run("matmul_rs", OpKind::kMatmulRs, stream, ordinal, state, o, pipelined::enqueue_matmul_rs);
}

// A group of one: y = x @ w (+ bias) by the vendor GEMM, nothing to move. No
// peer, no epoch, no host work a command-buffer replay would miss.
ffi::Error VendorGemmExecute(hipStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer w,
                             ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> scratch,
                             int64_t w_kmajor) {
  auto op = operands("vendor_gemm", OpKind::kAgMatmul, x, w, bias, {&*y}, *scratch, w_kmajor != 0, 1);
  if (op.has_error()) return op.error();
  pipelined::Operands& o = op.value();
  if (auto e = check_elements("vendor_gemm", "result y", *y, o.batch * o.m * o.n); e.failure()) return e;
  o.out = y->untyped_data();
  blas::DeviceBlas* blas = nullptr;
  JO_FFI_RETURN_IF_ERROR(blas::DeviceBlas::get(ordinal, &blas));
  JO_FFI_RETURN_IF_ERROR(pipelined::enqueue_local_gemm(o, *blas, stream));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jo

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoPipelinedInstantiate, jo::PipelinedInstantiate,
                              xla::ffi::Ffi::BindInstantiate()
                                  .Attr<jo::PipelinedConfig>("config")
                                  .Attr<xla::ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("world")
                                  .Attr<xla::ffi::Span<const int64_t>>("stages"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoAgMatmulPipelinedExecute, jo::AgMatmulPipelinedExecute,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<hipStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Ctx<xla::ffi::State<jo::CallState>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [..., m, k]
                                  .Arg<xla::ffi::AnyBuffer>()  // w [k, n] or [n, k]
                                  .Arg<xla::ffi::AnyBuffer>()  // bias [n], or [0] for none
                                  .Ret<xla::ffi::AnyBuffer>()  // y [..., world * m, n]
                                  .Ret<xla::ffi::AnyBuffer>()  // gathered [..., world * m, k]
                                  .Ret<xla::ffi::AnyBuffer>()  // scratch, u8 [pipelined_scratch_bytes]
                                  .Attr<jo::PipelinedConfig>("config")
                                  .Attr<xla::ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("world")
                                  .Attr<xla::ffi::Span<const int64_t>>("stages"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoMatmulRsPipelinedExecute, jo::MatmulRsPipelinedExecute,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<hipStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Ctx<xla::ffi::State<jo::CallState>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [..., m_total, k]
                                  .Arg<xla::ffi::AnyBuffer>()  // w [k, n] or [n, k]
                                  .Arg<xla::ffi::AnyBuffer>()  // bias [n], or [0] for none
                                  .Ret<xla::ffi::AnyBuffer>()  // out [..., m_total / world, n]
                                  .Ret<xla::ffi::AnyBuffer>()  // scratch, u8 [pipelined_scratch_bytes]
                                  .Attr<jo::PipelinedConfig>("config")
                                  .Attr<xla::ffi::Span<const int64_t>>("groups")
                                  .Attr<int64_t>("world")
                                  .Attr<xla::ffi::Span<const int64_t>>("stages"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoVendorGemmExecute, jo::VendorGemmExecute,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<hipStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [..., m, k]
                                  .Arg<xla::ffi::AnyBuffer>()  // w [k, n] or [n, k]
                                  .Arg<xla::ffi::AnyBuffer>()  // bias [n], or [0] for none
                                  .Ret<xla::ffi::AnyBuffer>()  // y [..., m, n]
                                  .Ret<xla::ffi::AnyBuffer>()  // the vendor GEMM's workspace, u8
                                  .Attr<int64_t>("w_kmajor"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
