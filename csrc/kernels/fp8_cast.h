// The float8 cast of the fp8 layers' current scaling (jax_overlap/ops/fp8_cast.py):
// x / scale rounded to nearest even to a float8 format, in one pass over x at
// HBM speed. XLA's own cast runs well below it (benchmarks/results/fp8_*.md).
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
};

// Enqueues the cast on `stream`; hipErrorInvalidValue for dtypes it does not take (the caller names them). A
// float8 format of the other family (fnuz on NVIDIA or gfx950, OCP on gfx942) would be rounded as this GPU's
// own: the caller checks the format against the GPU (blas::takes_fp8) first.
hipError_t launch_fp8_cast(const Fp8Cast& cast, int sm_count, hipStream_t stream);

}  // namespace jo
