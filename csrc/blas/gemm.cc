#include "blas/gemm.h"

#include <string>

#include "blas/library.h"
#include "core/block_scales.h"
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

// The vendor's type of `t`; false for a dtype this vendor's GEMM does not take.
bool data_type(DType t, int* out) {
  switch (t) {
    case DType::kBF16: *out = kDataBF16; break;
    case DType::kF16: *out = kDataF16; break;
    case DType::kF32: *out = kDataF32; break;
    case DType::kF8E4M3FN: *out = kDataF8E4M3; break;
    case DType::kF8E5M2: *out = kDataF8E5M2; break;
    case DType::kF8E4M3FNUZ: *out = kDataF8E4M3Fnuz; break;
    case DType::kF8E5M2FNUZ: *out = kDataF8E5M2Fnuz; break;
  }
  return *out != kNoDataType;
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
  const GemmTypes& t = s.types;
  const std::string types = t.scaled ? std::string(dtype_name(t.x)) + " x " + dtype_name(t.w) + " -> " +
                                           dtype_name(t.out) + (t.blocks ? " (block scales)" : " (scaled)")
                                     : dtype_name(t.x);
  return types + " [" + std::to_string(s.batch) + " x " + std::to_string(s.rows) + ", " + std::to_string(s.k) +
         "] @ " + (s.w_kmajor ? "[n, k]" : "[k, n]") + " n=" + std::to_string(s.n) +
         (s.bias ? std::string(" + ") + dtype_name(t.bias) + " bias" : "") + ", " + std::to_string(s.alignment) +
         "-byte aligned";
}

Status refused(const GemmProblem& s, const std::string& why) {
  return Status{std::string("jax_overlap: the vendor GEMM (") + kLibraryName + ") does not take " + describe(s) +
                ": " + why};
}

// The vendor's types of the problem's A (w), B (x) and D (y, also C's), and the bias's; or why it takes none.
struct VendorTypes {
  int a, b, d, bias;
};
Status vendor_types(const GemmProblem& s, VendorTypes* out) {
  const GemmTypes& t = s.types;
  const auto vendor = [&](DType d, int* v) {
    return data_type(d, v) ? Status{} : refused(s, std::string("it has no ") + dtype_name(d) + " type");
  };
  JO_RETURN_IF_ERROR(vendor(t.w, &out->a));
  JO_RETURN_IF_ERROR(vendor(t.x, &out->b));
  JO_RETURN_IF_ERROR(vendor(t.out, &out->d));
  if (s.bias) JO_RETURN_IF_ERROR(vendor(t.bias, &out->bias));
  if (!t.scaled) {
    if (t.w != t.x || t.out != t.x || (s.bias && t.bias != t.x))
      return refused(s, "unscaled operands take w, bias and y in x's dtype");
    return {};
  }
  if (!is_fp8(t.x) || !is_fp8(t.w)) return refused(s, "scaled operands are float8");
  if (kFp8TransposedWOnly && !s.w_kmajor) return refused(s, "its float8 GEMM takes w K-major ([n, k]) only");
  if (s.bias && !fp8_bias_type_ok(t.out, t.bias)) return refused(s, "its float8 GEMM takes no such bias");
  if (!t.blocks) return {};
  if (kDescAScaleMode < 0) return refused(s, "float8 block scales are built for cuBLASLt (sm_90) only");
  if (!s.w_kmajor) return refused(s, "block scales take w K-major ([n, k])");
  // No algorithm on the H200 (cuBLASLt 13.1): the caller adds the bias after the GEMM.
  if (s.bias) return refused(s, "block scales take no bias epilogue");
  // The x scales are laid out over one matrix's rows (core/block_scales.h): a batch folds into the rows.
  if (s.batch > 1) return refused(s, "block scales take one batch element");
  if (s.k % kScaleBlock != 0 || s.n % kScaleBlock != 0 || s.rows % kScaleRowMultiple != 0)
    return refused(s, "block scales take k and n multiples of " + std::to_string(kScaleBlock) +
                          " and rows a multiple of " + std::to_string(kScaleRowMultiple));
  return {};
}

}  // namespace

bool takes_fp8(DType t, const std::string& arch) { return runs_fp8(t, arch); }

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
  VendorTypes type{};
  JO_RETURN_IF_ERROR(vendor_types(s, &type));
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
  p->scaled_ = s.types.scaled;
  // Column-major view of the row-major product: y^T [n, rows] = w^T [n, k] @ x^T [k, rows],
  // so the vendor's A is w (transposed when w is [n, k]) and its B is x.
  JO_RETURN_IF_BLAS_ERROR(api.matmul_desc_create(&p->desc_, kComputeF32, kDataF32));
  JO_RETURN_IF_ERROR(set_desc(api, p->desc_, kDescTransA, static_cast<int32_t>(s.w_kmajor ? kOpT : kOpN)));
  JO_RETURN_IF_ERROR(set_desc(api, p->desc_, kDescTransB, static_cast<int32_t>(kOpN)));
  JO_RETURN_IF_ERROR(set_desc(api, p->desc_, kDescEpilogue, s.bias ? kEpilogueBias : kEpilogueDefault));
  // The heuristic reads the bias and scale pointers' presence and alignment, not their data (and finds
  // nothing for an epilogue or scaling whose pointer is unset on hipBLASLt): stand-ins with exactly the
  // plan's alignment.
  const void* stand_in = reinterpret_cast<const void*>(static_cast<uintptr_t>(s.alignment));
  if (s.bias) JO_RETURN_IF_ERROR(set_desc(api, p->desc_, kDescBiasPointer, stand_in));
  if (s.types.scaled) {
    JO_RETURN_IF_ERROR(set_desc(api, p->desc_, kDescAScalePointer, stand_in));
    JO_RETURN_IF_ERROR(set_desc(api, p->desc_, kDescBScalePointer, stand_in));
    if (s.bias) JO_RETURN_IF_ERROR(set_desc(api, p->desc_, kDescBiasDataType, static_cast<int32_t>(type.bias)));
    if constexpr (kDescFastAccum >= 0) JO_RETURN_IF_ERROR(set_desc(api, p->desc_, kDescFastAccum, int8_t{0}));
  }
  if (s.types.blocks) {  // cuBLASLt only (vendor_types)
    JO_RETURN_IF_ERROR(set_desc(api, p->desc_, kDescAScaleMode, kScaleModeBlk128x128));
    JO_RETURN_IF_ERROR(set_desc(api, p->desc_, kDescBScaleMode, kScaleModeVec128));
  }
  if constexpr (kDescSmCountTarget >= 0) {
    if (s.sm_count > 0) JO_RETURN_IF_ERROR(set_desc(api, p->desc_, kDescSmCountTarget, int32_t{s.sm_count}));
  }
  JO_RETURN_IF_BLAS_ERROR(s.w_kmajor ? api.layout_create(&p->a_, type.a, s.k, s.n, s.ldw)
                                     : api.layout_create(&p->a_, type.a, s.n, s.k, s.ldw));
  JO_RETURN_IF_BLAS_ERROR(api.layout_create(&p->b_, type.b, s.k, s.rows, s.ldx));
  JO_RETURN_IF_BLAS_ERROR(api.layout_create(&p->d_, type.d, s.n, s.rows, s.ldy));
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

Status DeviceBlas::run(const GemmPlan& p, const GemmPointers& g, void* workspace, hipStream_t stream) const {
  // alpha 1: with scales, the vendor multiplies the product by A's and B's scale (w's and x's) itself.
  static const float kOne = 1.f, kZero = 0.f;
  const Api& api = *api_;
  auto matmul = [&]() -> Status {
    JO_RETURN_IF_BLAS_ERROR(api.matmul(handle_, p.desc_, &kOne, g.w, p.a_, g.x, p.b_, &kZero, g.y, p.d_, g.y, p.d_,
                                       &p.algo_, workspace, kWorkspaceBytes, stream));
    return {};
  };
  if (!p.bias_ && !p.scaled_) return matmul();
  std::lock_guard<std::mutex> lock(p.pointers_mu_);
  if (p.bias_) JO_RETURN_IF_ERROR(set_desc(api, p.desc_, kDescBiasPointer, g.bias));
  if (p.scaled_) {
    for (const float* scale : {g.w_scale, g.x_scale})
      if (reinterpret_cast<uintptr_t>(scale) % kScaleAlign != 0)
        return Status{"jax_overlap: a float8 GEMM's scales must be " + std::to_string(kScaleAlign) +
                      "-byte aligned (" + kLibraryName + " refuses others)"};
    JO_RETURN_IF_ERROR(set_desc(api, p.desc_, kDescAScalePointer, static_cast<const void*>(g.w_scale)));
    JO_RETURN_IF_ERROR(set_desc(api, p.desc_, kDescBScalePointer, static_cast<const void*>(g.x_scale)));
  }
  return matmul();
}

}  // namespace jo::blas
