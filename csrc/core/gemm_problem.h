// One row-major GEMM problem, as every layer that checks, schedules or plans
// a GEMM sees it (the FFI handlers' checks, the pipelined schedule's chunks,
// the vendor BLAS plan key):
//   y[b] = x[b] @ w (+ bias)                       for b < batch (16-bit calls),
//   y[b] = x_scale * w_scale * (x[b] @ w) (+ bias)  with float8 x and w (scaled; fast_accumulation: the
//                                                  vendor's fast fp8 accumulation, as types.fast_accumulation says),
//   y[b][r, c] = sum_j x_scale[r, j] * w_scale[c / 128, j] * (x[b] @ w over k's j-th 128)[r, c]
//                                                  with float8 block scales (blocks: core/block_scales.h), no bias,
// accumulated in fp32, the bias added in fp32, y rounded once. x[b] [rows, k]
// (row stride ldx), y[b] [rows, n] (row stride ldy), w [k, n] or, with
// w_kmajor, [n, k] (row stride ldw), shared by every batch element; the bias
// [n]. The operand pointers (and the scales', device pointers to one float
// each or to the block scales) travel beside it: a problem is a shape, the
// same for every call of a compiled program.
#pragma once

#include <cstdint>
#include <tuple>

#include "core/dtype.h"

namespace jo {

// The element types of one GEMM (core/dtype.h roles).
struct GemmTypes {
  DType x, w;    // operands: both 16-bit of one type, or both float8
  DType out;     // y: x's type for 16-bit operands; bfloat16, float16 or float32 for float8 ones
  DType bias;    // out's type, or float32 (float8 operands); unused without a bias
  bool scaled;   // float8 operands, each with a float32 scale
  bool blocks = false;  // float8 block scales (core/block_scales.h) instead of one scale each; implies scaled
  // Tensor-scaled float8 only: the vendor GEMM may keep its tensor cores' partial sums in their own narrower
  // accumulator rather than promote them to float32 as the K loop goes (cuBLASLt's FAST_ACCUM; the forward
  // GEMM of Flax's and TransformerEngine's fp8 recipes). hipBLASLt has no such mode: AMD's MFMA accumulates in
  // float32 either way.
  bool fast_accumulation = false;

  // A 16-bit call's: x, w, y and the bias all of type t.
  static GemmTypes same(DType t) { return GemmTypes{t, t, t, t, false}; }

  auto key() const {
    return std::make_tuple(static_cast<int>(x), static_cast<int>(w), static_cast<int>(out), static_cast<int>(bias),
                           scaled, blocks, fast_accumulation);
  }
};

struct GemmProblem {
  GemmTypes types;
  int64_t rows, n, k;
  int64_t batch;  // >= 1
  int64_t ldx, ldy, ldw;  // elements
  int64_t x_batch_stride, y_batch_stride;  // elements; unused when batch == 1
  bool w_kmajor;
  bool bias;
  int alignment;  // bytes every operand pointer is a multiple of (16 to 256); 0 where no pointer is known yet
  int sm_count = 0;  // SMs (CUs) the vendor GEMM may take: the rest stay free for kernels beside it; 0: all

  // A problem whose batch elements are dense [rows, k] and [rows, n] matrices, one after the other, and whose w
  // is dense.
  static GemmProblem dense(const GemmTypes& types, int64_t batch, int64_t rows, int64_t k, int64_t n, bool w_kmajor,
                           bool bias) {
    return GemmProblem{types, rows, n, k, batch, k, n, w_kmajor ? k : n, rows * k, rows * n, w_kmajor, bias, 0};
  }

  auto key() const {
    return std::make_tuple(types.key(), rows, n, k, batch, ldx, ldy, ldw, x_batch_stride, y_batch_stride, w_kmajor,
                           bias, alignment, sm_count);
  }
  bool operator<(const GemmProblem& o) const { return key() < o.key(); }
  bool operator==(const GemmProblem& o) const { return key() == o.key(); }
};

}  // namespace jo
