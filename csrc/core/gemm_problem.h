// One row-major GEMM problem, as every layer that checks, schedules or plans
// a GEMM sees it (the FFI handlers' checks, the pipelined schedule's chunks,
// the vendor BLAS plan key):
//   y[b] = x[b] @ w (+ bias)   for b < batch,
// x[b] [rows, k] (row stride ldx), y[b] [rows, n] (row stride ldy), w [k, n]
// or, with w_kmajor, [n, k], shared by every batch element; the bias [n].
// The operand pointers travel beside it: a problem is a shape, the same for
// every call of a compiled program.
#pragma once

#include <cstdint>
#include <tuple>

#include "core/dtype.h"

namespace jo {

struct GemmProblem {
  DType dtype;  // x, w, bias and y
  int64_t rows, n, k;
  int64_t batch;  // >= 1
  int64_t ldx, ldy;  // elements
  int64_t x_batch_stride, y_batch_stride;  // elements; unused when batch == 1
  bool w_kmajor;
  bool bias;
  int alignment;  // bytes every operand pointer is a multiple of (16 to 256); 0 where no pointer is known yet

  // A problem whose batch elements are dense [rows, k] and [rows, n] matrices, one after the other.
  static GemmProblem dense(DType dtype, int64_t batch, int64_t rows, int64_t k, int64_t n, bool w_kmajor,
                           bool bias) {
    return GemmProblem{dtype, rows, n, k, batch, k, n, rows * k, rows * n, w_kmajor, bias, 0};
  }

  auto key() const {
    return std::make_tuple(static_cast<int>(dtype), rows, n, k, batch, ldx, ldy, x_batch_stride, y_batch_stride,
                           w_kmajor, bias, alignment);
  }
  bool operator<(const GemmProblem& o) const { return key() < o.key(); }
};

}  // namespace jo
