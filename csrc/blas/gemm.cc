#include "blas/gemm.h"

#include <cstdlib>
#include <string>

#include "blas/internal.h"
#include "blas/library.h"
#include "core/block_scales.h"
#include "platform/device_scope.h"
#include "runtime/faults.h"

namespace jo::blas {

Counts& counts() {
  static Counts c;
  return c;
}

namespace {

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
    if (t.fast_accumulation) return refused(s, "fast accumulation is float8's");
    if (t.w != t.x || (s.bias && (t.bias != t.x || t.out != t.x)))
      return refused(s, "unscaled operands take w, and a bias with y, in x's dtype");
    // float32 y: matmul_rs's partials of a float16 output (core/dtype.h partial_dtype).
    if (t.out != t.x && t.out != DType::kF32) return refused(s, "unscaled operands take y in x's dtype or float32");
    return {};
  }
  if (!is_fp8(t.x) || !is_fp8(t.w)) return refused(s, "scaled operands are float8");
  if (kFp8TransposedWOnly && !s.w_kmajor) return refused(s, "its float8 GEMM takes w K-major ([n, k]) only");
  if (s.bias && !fp8_bias_type_ok(t.out, t.bias)) return refused(s, "its float8 GEMM takes no such bias");
  if (!t.blocks) return {};
  if (t.fast_accumulation) return refused(s, "block scales take no fast accumulation (they apply per 128 of k)");
  if (kDescAScaleMode < 0) return refused(s, "float8 block scales are built for cuBLASLt (sm_90) only");
  if (!s.w_kmajor) return refused(s, "block scales take w K-major ([n, k])");
  // cuBLASLt 13.1 has no algorithm for it: the caller adds the bias after the GEMM.
  if (s.bias) return refused(s, "block scales take no bias epilogue");
  // The x scales are laid out over one matrix's rows (core/block_scales.h): a batch folds into the rows.
  if (s.batch > 1) return refused(s, "block scales take one batch element");
  if (s.k % kScaleBlock != 0 || s.n % kScaleBlock != 0 || s.rows % kScaleRowMultiple != 0)
    return refused(s, "block scales take k and n multiples of " + std::to_string(kScaleBlock) +
                          " and rows a multiple of " + std::to_string(kScaleRowMultiple));
  return {};
}

Status no_algorithm(const GemmProblem& s) {
  return Status{std::string("jax_overlap: ") + kLibraryName + " has no algorithm for " + describe(s)};
}

}  // namespace

bool takes_fp8(DType t, const std::string& arch) { return runs_fp8(t, arch); }

int alignment_of(std::initializer_list<const void*> pointers) {
  uintptr_t bits = 256;
  for (const void* p : pointers)
    if (p != nullptr) bits |= reinterpret_cast<uintptr_t>(p);
  return static_cast<int>(bits & (~bits + 1));  // lowest set bit, at most 256
}

std::string describe(const GemmProblem& s) {
  const GemmTypes& t = s.types;
  const char* scales = t.blocks              ? " (block scales)"
                       : t.fast_accumulation ? " (scaled, fast accumulation)"
                                             : " (scaled)";
  std::string types = dtype_name(t.x);
  if (t.scaled)
    types += std::string(" x ") + dtype_name(t.w) + " -> " + dtype_name(t.out) + scales;
  else if (t.out != t.x)
    types += std::string(" -> ") + dtype_name(t.out);
  return types + " [" + std::to_string(s.batch) + " x " + std::to_string(s.rows) + ", " + std::to_string(s.k) +
         "] @ " + (s.w_kmajor ? "[n, k]" : "[k, n]") + " n=" + std::to_string(s.n) +
         (s.bias ? std::string(" + ") + dtype_name(t.bias) + " bias" : "") + ", " + std::to_string(s.alignment) +
         "-byte aligned";
}

const char* algo_source_name(AlgoSource source) {
  switch (source) {
    case AlgoSource::kHeuristic: return "heuristic";
    case AlgoSource::kTimed: return "timed";
    case AlgoSource::kDiskCache: return "disk_cache";
    case AlgoSource::kInstalled: return "installed";
  }
  return "unknown";
}

// name:value fields separated by ';', in this order, dtypes by name: one token (no space), readable in the
// tuning cache's lines.
std::string problem_id(const GemmProblem& s) {
  const GemmTypes& t = s.types;
  const auto i = [](int64_t v) { return std::to_string(v); };
  return std::string("x:") + dtype_name(t.x) + ";w:" + dtype_name(t.w) + ";out:" + dtype_name(t.out) +
         ";bias_type:" + dtype_name(t.bias) + ";scaled:" + i(t.scaled) + ";blocks:" + i(t.blocks) + ";fast_accum:" +
         i(t.fast_accumulation) + ";rows:" +
         i(s.rows) + ";n:" + i(s.n) + ";k:" + i(s.k) + ";batch:" + i(s.batch) + ";ldx:" + i(s.ldx) + ";ldy:" +
         i(s.ldy) + ";ldw:" + i(s.ldw) + ";x_stride:" + i(s.x_batch_stride) + ";y_stride:" + i(s.y_batch_stride) +
         ";w_kmajor:" + i(s.w_kmajor) + ";bias:" + i(s.bias) + ";align:" + i(s.alignment) + ";sms:" + i(s.sm_count);
}

bool parse_problem_id(const std::string& text, GemmProblem* out) {
  static const char* const kNames[] = {"x",        "w",        "out",  "bias_type", "scaled", "blocks",
                                       "fast_accum", "rows",   "n",    "k",         "batch",  "ldx",
                                       "ldy",      "ldw",      "x_stride", "y_stride", "w_kmajor", "bias",
                                       "align",    "sms"};
  constexpr size_t kFields = sizeof(kNames) / sizeof(kNames[0]);
  std::string values[kFields];
  size_t start = 0;
  for (size_t f = 0; f < kFields; ++f) {
    const size_t end = f + 1 < kFields ? text.find(';', start) : text.size();
    if (end == std::string::npos) return false;
    const std::string field = text.substr(start, end - start);
    const std::string name = std::string(kNames[f]) + ":";
    if (field.compare(0, name.size(), name) != 0 || field.size() == name.size()) return false;
    values[f] = field.substr(name.size());
    start = end + 1;
  }
  GemmProblem p{};
  DType* types[] = {&p.types.x, &p.types.w, &p.types.out, &p.types.bias};
  for (int f = 0; f < 4; ++f)
    if (!dtype_from_name(values[f], types[f])) return false;
  int64_t ints[kFields - 4];
  for (size_t f = 4; f < kFields; ++f) {
    char* end = nullptr;
    ints[f - 4] = std::strtoll(values[f].c_str(), &end, 10);
    if (end == nullptr || *end != '\0') return false;
  }
  p.types.scaled = ints[0] != 0;
  p.types.blocks = ints[1] != 0;
  p.types.fast_accumulation = ints[2] != 0;
  p.rows = ints[3];
  p.n = ints[4];
  p.k = ints[5];
  p.batch = ints[6];
  p.ldx = ints[7];
  p.ldy = ints[8];
  p.ldw = ints[9];
  p.x_batch_stride = ints[10];
  p.y_batch_stride = ints[11];
  p.w_kmajor = ints[12] != 0;
  p.bias = ints[13] != 0;
  p.alignment = static_cast<int>(ints[14]);
  p.sm_count = static_cast<int>(ints[15]);
  if (p.rows < 1 || p.n < 1 || p.k < 1 || p.batch < 1 || p.alignment < 1) return false;
  *out = p;
  return true;
}

BlasCounters blas_counters() {
  const Counts& c = counts();
  const auto load = [](const std::atomic<int64_t>& v) { return v.load(std::memory_order_relaxed); };
  return BlasCounters{load(c.plans_made), load(c.plan_lookups), load(c.descriptor_writes), load(c.tuned),
                      load(c.installs_refused), load(c.shared_handles)};
}

GemmPlan::~GemmPlan() {
  // Teardown at process exit: errors have nowhere to go.
  if (api_ == nullptr) return;
  for (Layout l : {a_, b_, d_})
    if (l != nullptr) (void)api_->layout_destroy(l);
  if (desc_ != nullptr) (void)api_->matmul_desc_destroy(desc_);
}

namespace {

struct Registry {
  std::mutex mu;
  DeviceBlas* devices[kMaxDevices] = {};  // never freed: handlers may run during interpreter exit
};

Registry& registry() {
  static Registry* r = new Registry();
  return *r;
}

Status ordinal_in_range(int ordinal) {
  if (ordinal < 0 || ordinal >= kMaxDevices)
    return Status{"jax_overlap: device ordinal " + std::to_string(ordinal) + " out of range [0, " +
                  std::to_string(kMaxDevices) + ")"};
  return {};
}

}  // namespace

Status DeviceBlas::prepare(int ordinal, DeviceBlas** out) {
  JO_RETURN_IF_ERROR(ordinal_in_range(ordinal));
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.devices[ordinal] == nullptr) {
    std::string error;
    const Api* api = vendor_api(&error);
    if (api == nullptr) return Status{error};
    std::unique_ptr<DeviceBlas> d(new DeviceBlas());
    d->ordinal_ = ordinal;
    d->api_ = api;
    DeviceScope scope(ordinal);
    JO_RETURN_IF_HIP_ERROR(scope.status());
    Status made = d->create_handle(&d->tool_handle_);
    for (Handle& h : d->origin_handles_)
      if (made.ok()) made = d->create_handle(&h);
    if (!made.ok()) {  // none of them is kept: the next prepare tries again from nothing
      for (Handle h : d->origin_handles_) d->destroy_handle(h);
      d->destroy_handle(d->tool_handle_);
    }
    JO_RETURN_IF_ERROR(scope.restore());
    JO_RETURN_IF_ERROR(made);
    r.devices[ordinal] = d.release();
  }
  *out = r.devices[ordinal];
  return {};
}

Status DeviceBlas::get(int ordinal, DeviceBlas** out) {
  JO_RETURN_IF_ERROR(ordinal_in_range(ordinal));
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.devices[ordinal] == nullptr)
    return Status{std::string("jax_overlap: the vendor BLAS (") + kLibraryName + ") is not prepared on GPU " +
                  std::to_string(ordinal) + ": jax_overlap prepares it when it lowers a pipelined call"};
  *out = r.devices[ordinal];
  return {};
}

Status DeviceBlas::create_handle(Handle* out) const {
  // Fault blas_handle_fails: the library cannot make a handle (as when it cannot allocate its own memory).
  if (faults::enabled("blas_handle_fails"))
    return Status{std::string("jax_overlap: fault blas_handle_fails: creating a ") + kLibraryName + " handle failed"};
  Handle h = nullptr;
  const LtStatus created = api_->create(&h);
  if (created != kSuccess)
    return Status{std::string("jax_overlap: creating a ") + kLibraryName + " handle on GPU " +
                  std::to_string(ordinal_) + " failed: status " + std::to_string(created)};
  *out = h;
  return {};
}

void DeviceBlas::destroy_handle(Handle handle) const {
  if (handle != nullptr) (void)api_->destroy(handle);  // teardown: errors have nowhere to go
}

Handle DeviceBlas::stream_handle(hipStream_t stream) {
  for (int i = 0; i < kOriginHandles; ++i) {
    hipStream_t bound = origin_streams_[i].load(std::memory_order_acquire);
    if (bound == stream) return origin_handles_[i];
    // A free slot: bind it to this stream (another thread may take it first: then look on).
    if (bound == nullptr && origin_streams_[i].compare_exchange_strong(bound, stream, std::memory_order_acq_rel))
      return origin_handles_[i];
    if (bound == stream) return origin_handles_[i];
  }
  counts().shared_handles.fetch_add(1, std::memory_order_relaxed);
  return origin_handles_[kOriginHandles - 1];
}

Status DeviceBlas::describe_plan(const GemmProblem& s, std::unique_ptr<GemmPlan>* out) const {
  VendorTypes type{};
  JO_RETURN_IF_ERROR(vendor_types(s, &type));
  const Api& api = *api_;
  std::unique_ptr<GemmPlan> p(new GemmPlan());
  p->problem_ = s;
  p->api_ = api_;
  // Column-major view of the row-major product: y^T [n, rows] = w^T [n, k] @ x^T [k, rows],
  // so the vendor's A is w (transposed when w is [n, k]) and its B is x.
  JO_RETURN_IF_BLAS_ERROR(api.matmul_desc_create(&p->desc_, kComputeF32, kDataF32));
  JO_RETURN_IF_ERROR(set_desc(api, p->desc_, kDescTransA, static_cast<int32_t>(s.w_kmajor ? kOpT : kOpN)));
  JO_RETURN_IF_ERROR(set_desc(api, p->desc_, kDescTransB, static_cast<int32_t>(kOpN)));
  JO_RETURN_IF_ERROR(set_desc(api, p->desc_, kDescEpilogue, s.bias ? kEpilogueBias : kEpilogueDefault));
  // The heuristic reads the bias and scale pointers' presence and alignment, not their data (and finds
  // nothing for an epilogue or scaling whose pointer is unset on hipBLASLt): stand-ins with exactly the
  // plan's alignment. run() writes the call's own before the first GEMM (set_* start out null).
  const void* stand_in = reinterpret_cast<const void*>(static_cast<uintptr_t>(s.alignment));
  if (s.bias) JO_RETURN_IF_ERROR(set_desc(api, p->desc_, kDescBiasPointer, stand_in));
  if (s.types.scaled) {
    JO_RETURN_IF_ERROR(set_desc(api, p->desc_, kDescAScalePointer, stand_in));
    JO_RETURN_IF_ERROR(set_desc(api, p->desc_, kDescBScalePointer, stand_in));
    if (s.bias) JO_RETURN_IF_ERROR(set_desc(api, p->desc_, kDescBiasDataType, static_cast<int32_t>(type.bias)));
    // Off unless asked for: the accumulator is promoted to full fp32 as the K loop goes (torch._scaled_mm's
    // default numerics). On (types.fast_accumulation): Flax's and TransformerEngine's forward GEMM.
    if constexpr (kDescFastAccum >= 0) {
      const int8_t fast = s.types.fast_accumulation ? 1 : 0;
      JO_RETURN_IF_ERROR(set_desc(api, p->desc_, kDescFastAccum, fast));
    }
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
  *out = std::move(p);
  return {};
}

Status DeviceBlas::heuristic(const GemmPlan& p, int count, std::vector<HeuristicResult>* out) const {
  const Api& api = *api_;
  const GemmProblem& s = p.problem_;
  Preference pref = nullptr;
  JO_RETURN_IF_BLAS_ERROR(api.preference_create(&pref));
  std::vector<HeuristicResult> results(static_cast<size_t>(count < 1 ? 1 : count));
  int returned = 0;
  const Status asked = [&]() -> Status {
    JO_RETURN_IF_BLAS_ERROR(api.preference_set_attribute(pref, kPrefMaxWorkspaceBytes, &kWorkspaceBytes,
                                                         sizeof(uint64_t)));
    if constexpr (kHasAlignmentPreferences) {
      const uint32_t align = static_cast<uint32_t>(s.alignment);
      for (int i = 0; i < 4; ++i)  // A, B, C, D
        JO_RETURN_IF_BLAS_ERROR(api.preference_set_attribute(pref, kPrefMinAlignmentA + i, &align, sizeof(align)));
    }
    // Any handle of this GPU's: the heuristic reads the device, not the handle's stream.
    JO_RETURN_IF_BLAS_ERROR(api.algo_get_heuristic(tool_handle_, p.desc_, p.a_, p.b_, p.d_, p.d_, pref,
                                                   static_cast<int>(results.size()), results.data(), &returned));
    return {};
  }();
  (void)api.preference_destroy(pref);
  JO_RETURN_IF_ERROR(asked);
  out->clear();
  for (int i = 0; i < returned && i < static_cast<int>(results.size()); ++i)
    if (results[i].state == kSuccess) out->push_back(results[i]);
  return {};
}

const GemmPlan* DeviceBlas::replace(std::unique_ptr<GemmPlan> plan) {
  const GemmPlan* made = plan.get();
  std::unique_ptr<GemmPlan>& slot = plans_[plan->problem_];
  if (slot) retired_.push_back(std::move(slot));
  slot = std::move(plan);
  plans_version_.fetch_add(1, std::memory_order_acq_rel);
  return made;
}

Status DeviceBlas::plan(const GemmProblem& s, const GemmPlan** out) {
  counts().plan_lookups.fetch_add(1, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = plans_.find(s);
  if (it != plans_.end()) {
    *out = it->second.get();
    // A shape the heuristic had nothing for is remembered: callers that fall back ask once.
    return *out != nullptr ? Status{} : no_algorithm(s);
  }
  std::unique_ptr<GemmPlan> p;
  JO_RETURN_IF_ERROR(describe_plan(s, &p));
  std::vector<HeuristicResult> found;
  JO_RETURN_IF_ERROR(heuristic(*p, 1, &found));
  counts().plans_made.fetch_add(1, std::memory_order_relaxed);
  if (found.empty()) {
    plans_.emplace(s, nullptr);
    return no_algorithm(s);
  }
  p->algo_ = found[0].algo;
  *out = p.get();
  plans_.emplace(s, std::move(p));
  return {};
}

Status DeviceBlas::run(const GemmPlan& p, const GemmPointers& g, void* workspace, hipStream_t stream,
                       Handle handle) const {
  // alpha 1: with scales, the vendor multiplies the product by A's and B's scale (w's and x's) itself.
  static const float kOne = 1.f, kZero = 0.f;
  const Api& api = *api_;
  const GemmProblem& s = p.problem_;
  auto matmul = [&]() -> Status {
    JO_RETURN_IF_BLAS_ERROR(api.matmul(handle, p.desc_, &kOne, g.w, p.a_, g.x, p.b_, &kZero, g.y, p.d_, g.y, p.d_,
                                       &p.algo_, workspace, kWorkspaceBytes, stream));
    return {};
  };
  if (!s.bias && !s.types.scaled) return matmul();
  if (s.types.scaled)
    for (const float* scale : {g.w_scale, g.x_scale})
      if (reinterpret_cast<uintptr_t>(scale) % kScaleAlign != 0)
        return Status{"jax_overlap: a float8 GEMM's scales must be " + std::to_string(kScaleAlign) +
                      "-byte aligned (" + kLibraryName + " refuses others)"};
  std::lock_guard<std::mutex> lock(p.pointers_mu_);
  const auto write = [&](int attr, const void* value, const void** set) -> Status {
    if (*set == value) return {};
    JO_RETURN_IF_ERROR(set_desc(api, p.desc_, attr, value));
    *set = value;
    counts().descriptor_writes.fetch_add(1, std::memory_order_relaxed);
    return {};
  };
  if (s.bias) JO_RETURN_IF_ERROR(write(kDescBiasPointer, g.bias, &p.set_bias_));
  if (s.types.scaled) {
    JO_RETURN_IF_ERROR(write(kDescAScalePointer, g.w_scale, &p.set_a_scale_));
    JO_RETURN_IF_ERROR(write(kDescBScalePointer, g.x_scale, &p.set_b_scale_));
  }
  return matmul();
}

}  // namespace jo::blas
