// The delayed-scaling step (fp8_scales.h): a workgroup per operand. Its threads take the max of their strided share
// of the history, as keys whose unsigned order is the floats' order with every NaN above all numbers (so a NaN
// wins, as in XLA's max reduction); the workgroup reduces the keys warp-wide, then its warps' in shared memory, and
// its first thread applies Flax's compute_scale (margin 0) in the order Flax writes it.
#include "kernels/fp8_scales.h"

namespace jo {
namespace {

constexpr int kThreads = 256;

struct StepScales {
  Fp8StepScale operand[kMaxStepScales];
};

// An order-preserving key of a float: negative floats' bits inverted, others' sign bit set; NaNs the largest key.
__device__ __forceinline__ uint32_t order_key(float v) {
  if (v != v) return 0xffffffffu;
  uint32_t bits;
  __builtin_memcpy(&bits, &v, sizeof(bits));
  return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}

__device__ __forceinline__ float from_key(uint32_t key) {
  if (key == 0xffffffffu) return __builtin_nanf("");
  const uint32_t bits = (key & 0x80000000u) ? key & 0x7fffffffu : ~key;
  float v;
  __builtin_memcpy(&v, &bits, sizeof(v));
  return v;
}

__global__ void __launch_bounds__(kThreads) fp8_step_scales_kernel(StepScales s, int64_t length) {
  const Fp8StepScale& o = s.operand[blockIdx.x];
  uint32_t key = 0;  // below every number's key (the history holds at least one)
  for (int64_t i = threadIdx.x; i < length; i += kThreads) {
    const uint32_t k = order_key(o.history[i]);
    key = k > key ? k : key;
  }
  key = gpu::workgroup_max<kThreads>(key);
  if (threadIdx.x != 0) return;
  const float amax = from_key(key);
  // fp8_ops.compute_scale: the previous scale's reciprocal, fp8_max / amax where the amax is positive and finite,
  // the step's scale the reciprocal of that (two divisions that XLA does not rewrite into one).
  const float previous = gpu::div_as_xla(1.0f, *o.scale);
  float sf = gpu::div_as_xla(o.fp8_max, amax);
  sf = amax > 0.0f ? sf : previous;
  sf = isfinite(amax) ? sf : previous;
  *o.step_scale = gpu::div_as_xla(1.0f, sf);
  *o.amax = 0.0f;
}

}  // namespace

hipError_t launch_fp8_step_scales(const Fp8StepScale* operands, int count, int64_t length, hipStream_t stream) {
  if (count < 1 || count > kMaxStepScales || length < 1) return hipErrorInvalidValue;
  StepScales s{};
  for (int i = 0; i < count; ++i) s.operand[i] = operands[i];
  fp8_step_scales_kernel<<<count, kThreads, 0, stream>>>(s, length);
  return hipGetLastError();
}

}  // namespace jo
