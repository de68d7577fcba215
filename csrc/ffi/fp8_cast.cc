// FFI handlers of the float8 cast (kernels/fp8_cast.h), of its variants that also give amax(|x|), and of the
// delayed-scaling step before them (kernels/fp8_scales.h): stateless, so XLA may record them into a command buffer
// (an amax variant zeroes its amax on the stream each call, or starts from the step kernel's zero).
#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "blas/gemm.h"
#include "ffi/binding.h"
#include "ffi/common.h"
#include "ffi/handlers.h"
#include "kernels/fp8_cast.h"
#include "kernels/fp8_scales.h"

namespace jo {
namespace {

struct CastDevice {
  std::string arch;
  int sm_count = 0;
};

// The architecture and SM count of GPU `ordinal`, queried once per process (entries stay put: no copy per call).
ffi::ErrorOr<const CastDevice*> cast_device(int32_t ordinal) {
  static std::mutex mu;
  static std::array<CastDevice, kMaxLocalDevices> known;
  if (ordinal < 0 || ordinal >= kMaxLocalDevices)
    return ffi::Unexpected(ffi::Error::InvalidArgument("jax_overlap fp8_cast: device ordinal " +
                                                       std::to_string(ordinal) + " out of range"));
  std::lock_guard<std::mutex> lock(mu);
  CastDevice& d = known[ordinal];
  if (d.sm_count == 0) {
    hipDeviceProp_t prop;
    hipError_t e = hipGetDeviceProperties(&prop, ordinal);
    int sms = 0;
    if (e == hipSuccess) e = hipDeviceGetAttribute(&sms, hipDeviceAttributeMultiprocessorCount, ordinal);
    if (e != hipSuccess)
      return ffi::Unexpected(ffi::Error::Internal(std::string("jax_overlap fp8_cast: ") + hipGetErrorString(e)));
    d.arch = gpu::arch_name(prop);
    d.sm_count = sms;
  }
  return &d;
}

// The cast of x into out, and with amax (the delayed-scaling variant) max |x| into it; with lead > 0 (the
// transposing variant) out is x with its first `lead` dims moved last.
// With amax_from (the accumulating variants) the amax starts from its value: XLA gives the two one buffer
// (operand_output_aliases), which the step kernel zeroed, so no memset is enqueued.
ffi::Error cast(hipStream_t stream, int32_t ordinal, const ffi::AnyBuffer& x, const ffi::AnyBuffer& scale,
                ffi::AnyBuffer& out, ffi::AnyBuffer* amax, int64_t lead = 0,
                const ffi::AnyBuffer* amax_from = nullptr) {
  if (amax_from != nullptr && amax_from->untyped_data() != amax->untyped_data())
    return ffi::Error::InvalidArgument("jax_overlap fp8_cast_amax_from: amax_from and the amax result must be one "
                                       "buffer (the custom call's operand_output_aliases)");
  const auto x_dtype = dtype_of(x.element_type());
  if (!x_dtype || element_bytes(*x_dtype) == 1)
    return invalid_argument("fp8_cast", "x", "bfloat16, float16 or float32", data_type_name(x.element_type()));
  if (scale.element_type() != ffi::DataType::F32 || scale.element_count() != 1)
    return invalid_argument("fp8_cast", "scale", "one float32",
                            data_type_name(scale.element_type()) + dims_str(scale.dimensions()));
  const auto out_dtype = dtype_of(out.element_type());
  if (!out_dtype || element_bytes(*out_dtype) != 1)
    return invalid_argument("fp8_cast", "result", "a float8 format", data_type_name(out.element_type()));
  if (out.element_count() != x.element_count())
    return invalid_argument("fp8_cast", "result", "x's " + std::to_string(x.element_count()) + " elements",
                            std::to_string(out.element_count()));
  if (amax != nullptr && (amax->element_type() != ffi::DataType::F32 || amax->element_count() != 1))
    return invalid_argument("fp8_cast", "amax", "one float32",
                            data_type_name(amax->element_type()) + dims_str(amax->dimensions()));
  int64_t rows = 0;
  if (lead != 0) {
    const auto dims = x.dimensions(), out_dims = out.dimensions();
    const int64_t rank = static_cast<int64_t>(dims.size());
    if (lead < 0 || lead >= rank)
      return invalid_argument("fp8_cast_amax_transposed", "lead", "1 to x's rank - 1", std::to_string(lead));
    bool moved = static_cast<int64_t>(out_dims.size()) == rank;  // compared in place: no allocation per call
    for (int64_t i = 0; moved && i < rank; ++i) moved = out_dims[i] == dims[(i + lead) % rank];
    if (!moved) {
      std::vector<int64_t> want(dims.begin() + lead, dims.end());
      want.insert(want.end(), dims.begin(), dims.begin() + lead);
      return invalid_argument("fp8_cast_amax_transposed", "result", "dims " + dims_str(want), dims_str(out_dims));
    }
    const int64_t count = static_cast<int64_t>(x.element_count());
    if (count > 0) {  // an empty x keeps rows 0: nothing to transpose, the amax zeroed
      rows = 1;
      for (int64_t i = 0; i < lead; ++i) rows *= dims[i];
      if (const char* why = transposed_cast_declined(rows, count / rows))
        return ffi::Error::InvalidArgument(std::string("jax_overlap fp8_cast_amax_transposed: x ") + dims_str(dims) +
                                           ": " + why);
    }
  }
  const auto found = cast_device(ordinal);
  if (found.has_error()) return found.error();
  const CastDevice& device = *found.value();
  if (!blas::takes_fp8(*out_dtype, device.arch))
    return ffi::Error::InvalidArgument(std::string("jax_overlap fp8_cast: ") + dtype_name(*out_dtype) +
                                       " is not a float8 format of this GPU (" + device.arch + ")");
  Fp8Cast cast{x.untyped_data(),  *x_dtype,   static_cast<const float*>(scale.untyped_data()),
               out.untyped_data(), *out_dtype, static_cast<int64_t>(x.element_count())};
  if (amax != nullptr) cast.amax = static_cast<float*>(amax->untyped_data());
  cast.amax_zeroed = amax_from != nullptr;
  cast.rows = rows;
  const hipError_t launched = launch_fp8_cast(cast, device.sm_count, stream);
  if (launched != hipSuccess)
    return ffi::Error::Internal(std::string("jax_overlap fp8_cast: launch failed: ") + hipGetErrorString(launched));
  return ffi::Error::Success();
}

// The handlers of cast: x bfloat16, float16 or float32, scale f32[], amax_from f32[] >= 0; out x / scale in a float8
// format (saturated in the amax variants), amax f32[].
ffi::Error Fp8CastExecute(hipStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                          ffi::Result<ffi::AnyBuffer> out) {
  return cast(stream, ordinal, x, scale, *out, nullptr);
}

ffi::Error Fp8CastAmaxExecute(hipStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                              ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> amax) {
  return cast(stream, ordinal, x, scale, *out, &*amax);
}

ffi::Error Fp8CastAmaxTransposedExecute(hipStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                                        ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> amax,
                                        int64_t lead) {
  return cast(stream, ordinal, x, scale, *out, &*amax, lead);
}

ffi::Error Fp8CastAmaxFromExecute(hipStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer scale,
                                  ffi::AnyBuffer amax_from, ffi::Result<ffi::AnyBuffer> out,
                                  ffi::Result<ffi::AnyBuffer> amax) {
  return cast(stream, ordinal, x, scale, *out, &*amax, 0, &amax_from);
}

ffi::Error Fp8CastAmaxFromTransposedExecute(hipStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                                            ffi::AnyBuffer scale, ffi::AnyBuffer amax_from,
                                            ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> amax,
                                            int64_t lead) {
  return cast(stream, ordinal, x, scale, *out, &*amax, lead, &amax_from);
}

// The delayed-scaling step (kernels/fp8_scales.h): arguments (scale, history) per operand, results (step scale,
// zeroed amax) per operand, fp8_max the formats' largest values in the operands' order.
ffi::Error Fp8StepScalesExecute(hipStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                                ffi::Span<const float> fp8_max) {
  const size_t count = fp8_max.size();
  if (count < 1 || count > static_cast<size_t>(kMaxStepScales) || args.size() != 2 * count ||
      rets.size() != 2 * count)
    return ffi::Error::InvalidArgument("jax_overlap fp8_step_scales: 1 to " + std::to_string(kMaxStepScales) +
                                       " operands, each a (scale, history) argument pair and a (step scale, amax) "
                                       "result pair, got " + std::to_string(args.size()) + " arguments, " +
                                       std::to_string(rets.size()) + " results, " + std::to_string(count) +
                                       " formats");
  Fp8StepScale operands[kMaxStepScales] = {};
  int64_t length = -1;
  for (size_t i = 0; i < count; ++i) {
    auto scale = args.get<ffi::AnyBuffer>(2 * i);
    auto history = args.get<ffi::AnyBuffer>(2 * i + 1);
    auto step = rets.get<ffi::AnyBuffer>(2 * i);
    auto amax = rets.get<ffi::AnyBuffer>(2 * i + 1);
    if (scale.has_error()) return scale.error();
    if (history.has_error()) return history.error();
    if (step.has_error()) return step.error();
    if (amax.has_error()) return amax.error();
    for (const ffi::AnyBuffer* b : {&scale.value(), &*step.value(), &*amax.value()})
      if (b->element_type() != ffi::DataType::F32 || b->element_count() != 1)
        return invalid_argument("fp8_step_scales", "a scale or result", "one float32",
                                data_type_name(b->element_type()) + dims_str(b->dimensions()));
    const ffi::AnyBuffer& h = history.value();
    if (h.element_type() != ffi::DataType::F32 || h.element_count() < 1 ||
        (length >= 0 && static_cast<int64_t>(h.element_count()) != length))
      return invalid_argument("fp8_step_scales", "history", "float32 histories of one length >= 1",
                              data_type_name(h.element_type()) + dims_str(h.dimensions()));
    length = static_cast<int64_t>(h.element_count());
    operands[i] = Fp8StepScale{static_cast<const float*>(scale.value().untyped_data()),
                               static_cast<const float*>(h.untyped_data()), fp8_max[i],
                               static_cast<float*>(step.value()->untyped_data()),
                               static_cast<float*>(amax.value()->untyped_data())};
  }
  const hipError_t launched = launch_fp8_step_scales(operands, static_cast<int>(count), length, stream);
  if (launched != hipSuccess)
    return ffi::Error::Internal(std::string("jax_overlap fp8_step_scales: launch failed: ") +
                                hipGetErrorString(launched));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jo

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoFp8CastExecute, jo::Fp8CastExecute, (jo::stream_binding<2, 1>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JoFp8CastAmaxExecute, jo::Fp8CastAmaxExecute, (jo::stream_binding<2, 2>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JoFp8CastAmaxTransposedExecute, jo::Fp8CastAmaxTransposedExecute,
                              (jo::stream_binding<2, 2>().Attr<int64_t>("lead")),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JoFp8CastAmaxFromExecute, jo::Fp8CastAmaxFromExecute, (jo::stream_binding<3, 2>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JoFp8CastAmaxFromTransposedExecute, jo::Fp8CastAmaxFromTransposedExecute,
                              (jo::stream_binding<3, 2>().Attr<int64_t>("lead")),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JoFp8StepScalesExecute, jo::Fp8StepScalesExecute,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<hipStream_t>>()
                                  .RemainingArgs()  // per operand: scale f32[], history f32[length]
                                  .RemainingRets()  // per operand: step scale f32[], amax f32[] (zeroed)
                                  .Attr<xla::ffi::Span<const float>>("fp8_max"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
