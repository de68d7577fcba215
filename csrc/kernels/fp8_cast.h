// The float8 cast of the fp8 layers (jax_overlap/ops/fp8_cast.py): x / scale rounded to nearest even to a float8
// format, in one pass over x at HBM speed. XLA's own cast runs well below it (docs/performance.md). The
// delayed-scaling layers' variant also gives amax(|x|) from the same pass: their scale comes from earlier steps'
// amaxes, so the cast does not wait for this one's, and the amax is what they record for the next steps.
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "platform/gpu.h"

namespace jo {

struct Fp8Cast {
  const void* x;    // count elements of x_dtype: bfloat16, float16 or float32
  DType x_dtype;
  const float* scale;  // one float32 on the device: out = x * (1 / *scale), as XLA's form computes it
  void* out;        // count elements of out_dtype, a float8 format of this GPU's family
  DType out_dtype;
  int64_t count;
  // The delayed-scaling variant, or nullptr: one float32 on the device that receives max |x| over the count
  // elements (a NaN if any element is NaN, as XLA's max; 0 for none). With it the cast saturates: a value beyond
  // the format's largest finite one becomes that value, of its sign (a scale from earlier steps need not cover x).
  float* amax = nullptr;
  // True: *amax already holds 0 (the step kernel zeroed it, kernels/fp8_scales.h), so no memset is enqueued.
  bool amax_zeroed = false;
  // The transposing variant, or 0: x is [rows, count / rows] row-major and out its transpose [count / rows, rows]
  // (a weight cast into the K-major layout the fp8 GEMM takes, in the same pass as its amax). It needs the amax,
  // rows a multiple of 16 and of at most 128 * 65535, the columns a multiple of 8, and x and out 16-byte aligned.
  int64_t rows = 0;
};

// Enqueues the cast on `stream`; hipErrorInvalidValue for dtypes or (transposing) shapes it does not take (the
// caller names them; transposed_cast_declined says why a shape is not taken). A float8 format of the other family
// (fnuz on NVIDIA or gfx950, OCP on gfx942) would be rounded as this GPU's own: the caller checks the format
// against the GPU (blas::takes_fp8) first. With an amax it enqueues a 4-byte
// memset of it first, unless amax_zeroed: every call starts the reduction from 0 (nothing kept from an earlier
// call, so that XLA may record it into a command buffer and replay it).
hipError_t launch_fp8_cast(const Fp8Cast& cast, int sm_count, hipStream_t stream);

// Why the transposing variant cannot take x of [rows, cols] (its tile's rules above), or nullptr.
const char* transposed_cast_declined(int64_t rows, int64_t cols);

}  // namespace jo
