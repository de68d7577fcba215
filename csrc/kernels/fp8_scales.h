// The delayed-scaling layers' step before their casts (jax_overlap/ops/fp8_scales.py): for each operand, the scale
// the step casts with, from the previous step's scale and the amax history (Flax's rule, fp8_ops.update_fp8_meta:
// compute_scale of the history's max), and a zeroed amax that the operand's cast then accumulates into. One launch
// for all of a step's operands, in place of XLA's reduction, its division and a memset per cast.
#pragma once

#include <cstdint>

#include "platform/gpu.h"

namespace jo {

inline constexpr int kMaxStepScales = 4;  // operands per launch (a forward step has two: x and the kernel)

struct Fp8StepScale {
  const float* scale;    // the previous step's scale, one float32
  const float* history;  // its amax history, `length` float32 (any values: a NaN wins the max, as in XLA's)
  float fp8_max;         // the largest finite value of the format the operand is cast to
  float* step_scale;     // receives the step's scale, one float32
  float* amax;           // receives 0.0f: the cast's amax starts from it (kernels/fp8_cast.h, Fp8Cast::amax_zeroed)
};

// Enqueues the step of `count` operands (1 to kMaxStepScales), their histories `length` (>= 1) long, on `stream`;
// hipErrorInvalidValue for counts or lengths it does not take. Divisions are XLA's (gpu::div_as_xla), so the scales
// equal XLA's form of the rule bit for bit.
hipError_t launch_fp8_step_scales(const Fp8StepScale* operands, int count, int64_t length, hipStream_t stream);

}  // namespace jo
