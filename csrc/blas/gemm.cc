#include "blas/gemm.h"

#include <string>

#include "blas/library.h"
#include "platform/device_scope.h"

namespace jo::blas {
namespace {

#define JO_RETURN_IF_BLAS_ERROR(expr)                                                                    \
  do {                                                                                                   \
    const LtStatus jo_blas_status_ = (expr);                                                               \
    if (jo_blas_status_ != kSuccess)                                                                     \
      return ::jo::Status{std::string(__FILE__) + ":" + std::to_string(__LINE__) + ": " #expr " failed: " + \
                          kLibraryName + " status " + std::to_string(jo_blas_status_)};                  \
  } while (0)

constexpr int kMaxDevices = 64;

// The vendor's type of x, w, bias and y; false for a dtype this path does not take.
bool data_type(DType t, int* out) {
  switch (t) {
    case DType::kBF16: *out = kDataBF16; return true;
    case DType::kF16: *out = kDataF16; return true;
  }
  return false;
}

template <typename V>
Status set_desc(const Api& api, MatmulDesc desc, int attr, V value) {
  JO_RETURN_IF_BLAS_ERROR(api.matmul_desc_set_attribute(desc, attr, &value, sizeof(value)));
  return {};
}

template <typename V>
Status set_layout(const Api& api, Layout layout, int attr, V value) {
  JO_RETURN_IF_BLAS_ERROR(api.layout_set_attribute(layout, attr, &value, sizeof(value)));
  return {};
}

// A batched layout: `count` matrices `stride` elements apart (0: one matrix shared by all).
Status batched(const Api& api, Layout layout, int64_t count, int64_t stride) {
  if (count == 1) return {};
  JO_RETURN_IF_ERROR(set_layout(api, layout, kLayoutBatchCount, static_cast<int32_t>(count)));
  return set_layout(api, layout, kLayoutBatchStride, stride);
}

std::string describe(const GemmProblem& s) {
  return std::string(dtype_name(s.dtype)) + " [" + std::to_string(s.batch) + " x " +
         std::to_string(s.rows) + ", " + std::to_string(s.k) + "] @ " + (s.w_kmajor ? "[n, k]" : "[k, n]") +
         " n=" + std::to_string(s.n) + (s.bias ? " + bias" : "") + ", " + std::to_string(s.alignment) +
         "-byte aligned";
}

}  // namespace

int alignment_of(std::initializer_list<const void*> pointers) {
  uintptr_t bits = 256;
  for (const void* p : pointers)
    if (p != nullptr) bits |= reinterpret_cast<uintptr_t>(p);
  return static_cast<int>(bits & (~bits + 1));  // lowest set bit, at most 256
}

GemmPlan::~GemmPlan() {
  // Teardown at process exit: errors have nowhere to go.
  if (api_ == nullptr) return;
  for (Layout l : {a_, b_, d_})
    if (l != nullptr) (void)api_->layout_destroy(l);
  if (desc_ != nullptr) (void)api_->matmul_desc_destroy(desc_);
}

Status DeviceBlas::get(int ordinal, DeviceBlas** out) {
  static std::mutex mu;
  static DeviceBlas* devices[kMaxDevices] = {};  // never freed: handlers may run during interpreter exit
  if (ordinal < 0 || ordinal >= kMaxDevices) return Status{"jax_overlap: device ordinal out of range"};
  std::lock_guard<std::mutex> lock(mu);
  if (devices[ordinal] == nullptr) {
    std::string error;
    const Api* api = vendor_api(&error);
    if (api == nullptr) return Status{error};
    DeviceScope scope(ordinal);
    JO_RETURN_IF_HIP_ERROR(scope.status());
    Handle handle = nullptr;
    const ::jo::Status created = api->create(&handle) == kSuccess
                               ? Status{}
                               : Status{std::string("jax_overlap: creating a ") + kLibraryName + " handle failed"};
    JO_RETURN_IF_ERROR(scope.restore());
    JO_RETURN_IF_ERROR(created);
    auto* d = new DeviceBlas();
    d->api_ = api;
    d->handle_ = handle;
    devices[ordinal] = d;
  }
  *out = devices[ordinal];
  return {};
}

Status DeviceBlas::plan(const GemmProblem& s, const GemmPlan** out) {
  int type = 0;
  if (!data_type(s.dtype, &type))
    return Status{std::string("jax_overlap: the vendor GEMM path does not take ") + dtype_name(s.dtype)};
  std::lock_guard<std::mutex> lock(mu_);
  auto it = plans_.find(s);
  if (it != plans_.end()) {
    *out = it->second.get();
    // A shape the heuristic had nothing for is remembered: callers that fall back ask once.
    return *out != nullptr ? Status{} : Status{std::string("jax_overlap: ") + kLibraryName + " has no algorithm for " +
                                               describe(s)};
  }
  const Api& api = *api_;
  std::unique_ptr<GemmPlan> p(new GemmPlan());
  p->api_ = api_;
  p->bias_ = s.bias;
  // Column-major view of the row-major product: y^T [n, rows] = w^T [n, k] @ x^T [k, rows],
  // so the vendor's A is w (transposed when w is [n, k]) and its B is x.
  JO_RETURN_IF_BLAS_ERROR(api.matmul_desc_create(&p->desc_, kComputeF32, kDataF32));
  JO_RETURN_IF_ERROR(set_desc(api, p->desc_, kDescTransA, static_cast<int32_t>(s.w_kmajor ? kOpT : kOpN)));
  JO_RETURN_IF_ERROR(set_desc(api, p->desc_, kDescTransB, static_cast<int32_t>(kOpN)));
  JO_RETURN_IF_ERROR(set_desc(api, p->desc_, kDescEpilogue, s.bias ? kEpilogueBias : kEpilogueDefault));
  if (s.bias) {
    // The heuristic reads the bias pointer's alignment, not its data: a
    // stand-in with exactly the plan's alignment.
    const void* stand_in = reinterpret_cast<const void*>(static_cast<uintptr_t>(s.alignment));
    JO_RETURN_IF_ERROR(set_desc(api, p->desc_, kDescBiasPointer, stand_in));
  }
  JO_RETURN_IF_BLAS_ERROR(s.w_kmajor ? api.layout_create(&p->a_, type, s.k, s.n, s.k)
                                     : api.layout_create(&p->a_, type, s.n, s.k, s.n));
  JO_RETURN_IF_BLAS_ERROR(api.layout_create(&p->b_, type, s.k, s.rows, s.ldx));
  JO_RETURN_IF_BLAS_ERROR(api.layout_create(&p->d_, type, s.n, s.rows, s.ldy));
  JO_RETURN_IF_ERROR(batched(api, p->a_, s.batch, 0));
  JO_RETURN_IF_ERROR(batched(api, p->b_, s.batch, s.x_batch_stride));
  JO_RETURN_IF_ERROR(batched(api, p->d_, s.batch, s.y_batch_stride));

  Preference pref = nullptr;
  JO_RETURN_IF_BLAS_ERROR(api.preference_create(&pref));
  HeuristicResult result{};
  int returned = 0;
  Status heuristic = [&]() -> Status {
    JO_RETURN_IF_BLAS_ERROR(api.preference_set_attribute(pref, kPrefMaxWorkspaceBytes, &kWorkspaceBytes,
                                                         sizeof(uint64_t)));
    if constexpr (kHasAlignmentPreferences) {
      const uint32_t align = static_cast<uint32_t>(s.alignment);
      for (int i = 0; i < 4; ++i)  // A, B, C, D
        JO_RETURN_IF_BLAS_ERROR(api.preference_set_attribute(pref, kPrefMinAlignmentA + i, &align, sizeof(align)));
    }
    JO_RETURN_IF_BLAS_ERROR(
        api.algo_get_heuristic(handle_, p->desc_, p->a_, p->b_, p->d_, p->d_, pref, 1, &result, &returned));
    return {};
  }();
  (void)api.preference_destroy(pref);
  JO_RETURN_IF_ERROR(heuristic);
  if (returned < 1 || result.state != kSuccess) {
    plans_.emplace(s, nullptr);
    return Status{std::string("jax_overlap: ") + kLibraryName + " has no algorithm for " + describe(s)};
  }
  p->algo_ = result.algo;
  *out = p.get();
  plans_.emplace(s, std::move(p));
  return {};
}

Status DeviceBlas::run(const GemmPlan& p, const void* x, const void* w, const void* bias, void* y, void* workspace,
                       hipStream_t stream) const {
  static const float kOne = 1.f, kZero = 0.f;
  const Api& api = *api_;
  auto matmul = [&]() -> Status {
    JO_RETURN_IF_BLAS_ERROR(api.matmul(handle_, p.desc_, &kOne, w, p.a_, x, p.b_, &kZero, y, p.d_, y, p.d_, &p.algo_,
                                       workspace, kWorkspaceBytes, stream));
    return {};
  };
  if (!p.bias_) return matmul();
  std::lock_guard<std::mutex> lock(p.bias_mu_);
  JO_RETURN_IF_ERROR(set_desc(api, p.desc_, kDescBiasPointer, bias));
  return matmul();
}

}  // namespace jo::blas
