// Row-major GEMMs through the vendor BLAS, for the pipelined algorithm: one
// GemmProblem (core/gemm_problem.h) per plan, the bias added by the GEMM's
// epilogue in fp32 before y is rounded; float8 operands with their scales as
// device pointers (the vendor's A and B scale: the product is scaled in fp32
// before the bias is added), or with block scales (core/block_scales.h;
// cuBLASLt only, no bias). A plan (descriptors and the algorithm the
// vendor's heuristic picks) is made once per problem and device, on first
// use, and kept for the process.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "blas/api.h"
#include "core/gemm_problem.h"
#include "platform/status.h"

namespace jo::blas {

// Workspace of one GEMM in flight (cuBLAS's own size on sm_90 and hipBLASLt's
// default); the pipelined calls take one per compute stream from their XLA
// scratch result, so nothing is allocated per call.
inline constexpr size_t kWorkspaceBytes = size_t{32} << 20;

// The alignment run() requires of a float8 GEMM's scale pointers: cuBLASLt's
// fails the call (NOT_SUPPORTED) for a scale 4 bytes off one (seen on the
// H200), so scales a GEMM reads each sit on a slot of their own.
inline constexpr size_t kScaleAlign = 16;
// Floats from one scale to the next where scales sit side by side on such slots.
inline constexpr int kScaleSlot = static_cast<int>(kScaleAlign / sizeof(float));

// The largest power of two (16 to 256) that divides every non-null pointer.
int alignment_of(std::initializer_list<const void*> pointers);

// Whether the vendor GEMM takes float8 operands of format `t` on a GPU of architecture `arch` ("sm_90",
// "gfx942"; gpu::arch_name).
bool takes_fp8(DType t, const std::string& arch);

// One GEMM's operands: x, w, y, and the bias and the scales where the plan has them (else null).
struct GemmPointers {
  const void* x;
  const void* w;
  const void* bias;
  const float* x_scale;
  const float* w_scale;
  void* y;
};

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
  bool scaled_ = false;
  // The bias and scale pointers are attributes of the shared descriptor: set
  // and used under this lock (uncontended: one thread enqueues a device's calls).
  mutable std::mutex pointers_mu_;
};

// One GPU's vendor BLAS handle and the plans made on it.
class DeviceBlas {
 public:
  // The instance of GPU `ordinal`, made on first use with that device current
  // (host work only: call it outside graph capture the first time).
  static Status get(int ordinal, DeviceBlas** out);

  // The plan of `problem` (its alignment set), made with the vendor's
  // heuristic on first use; an error for a dtype the vendor GEMM path does
  // not take.
  Status plan(const GemmProblem& problem, const GemmPlan** out);

  // Enqueues the plan's GEMM of `p` on `stream`; `workspace` holds kWorkspaceBytes.
  Status run(const GemmPlan& plan, const GemmPointers& p, void* workspace, hipStream_t stream) const;

 private:
  DeviceBlas() = default;

  const Api* api_ = nullptr;
  Handle handle_ = nullptr;
  std::mutex mu_;  // guards plans_
  std::map<GemmProblem, std::unique_ptr<GemmPlan>> plans_;
};

}  // namespace jo::blas
