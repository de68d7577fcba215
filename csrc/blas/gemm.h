// Row-major GEMMs through the vendor BLAS, for the pipelined algorithm:
//   y[b] = x[b] @ w (+ bias)   for b < batch,
// x[b] [rows, k] (row stride ldx), y[b] [rows, n] (row stride ldy), w [k, n]
// or, with w_kmajor, [n, k], shared by every batch element; the bias [n] is
// added by the GEMM's epilogue in fp32 before y is rounded. A plan (descriptors
// and the algorithm the vendor's heuristic picks) is made once per shape and
// device, on first use, and kept for the process.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "blas/api.h"
#include "kernels/params.h"
#include "platform/status.h"

namespace jo::blas {

// Workspace of one GEMM in flight (cuBLAS's own size on sm_90 and hipBLASLt's
// default); the pipelined calls take one per compute stream from their XLA
// scratch result, so nothing is allocated per call.
inline constexpr size_t kWorkspaceBytes = size_t{32} << 20;

struct GemmShape {
  DType dtype;
  int64_t rows, n, k;
  int64_t batch;  // >= 1
  int64_t ldx, ldy;
  int64_t x_batch_stride, y_batch_stride;  // elements; unused when batch == 1
  bool w_kmajor;
  bool bias;
  int alignment;  // bytes every operand pointer is a multiple of (16 to 256)

  auto key() const {
    return std::make_tuple(static_cast<int>(dtype), rows, n, k, batch, ldx, ldy, x_batch_stride, y_batch_stride,
                           w_kmajor, bias, alignment);
  }
  bool operator<(const GemmShape& o) const { return key() < o.key(); }
};

// The largest power of two (16 to 256) that divides every non-null pointer.
int alignment_of(std::initializer_list<const void*> pointers);

class GemmPlan {
 public:
  ~GemmPlan();
  GemmPlan(const GemmPlan&) = delete;
  GemmPlan& operator=(const GemmPlan&) = delete;

 private:
  friend class DeviceBlas;
  GemmPlan() = default;

  const Api* api_ = nullptr;
  MatmulDesc desc_ = nullptr;
  Layout a_ = nullptr, b_ = nullptr, d_ = nullptr;
  Algo algo_{};
  bool bias_ = false;
  // The bias pointer is an attribute of the shared descriptor: set and used
  // under this lock (uncontended: one thread enqueues a device's calls).
  mutable std::mutex bias_mu_;
};

// One GPU's vendor BLAS handle and the plans made on it.
class DeviceBlas {
 public:
  // The instance of GPU `ordinal`, made on first use with that device current
  // (host work only: call it outside graph capture the first time).
  static Status get(int ordinal, DeviceBlas** out);

  // The plan of `shape`, made with the vendor's heuristic on first use.
  Status plan(const GemmShape& shape, const GemmPlan** out);

  // Enqueues y = x @ w (+ bias) on `stream`; `workspace` holds kWorkspaceBytes.
  Status run(const GemmPlan& plan, const void* x, const void* w, const void* bias, void* y, void* workspace,
             hipStream_t stream) const;

 private:
  DeviceBlas() = default;

  const Api* api_ = nullptr;
  Handle handle_ = nullptr;
  std::mutex mu_;  // guards plans_
  std::map<GemmShape, std::unique_ptr<GemmPlan>> plans_;
};

}  // namespace jo::blas
