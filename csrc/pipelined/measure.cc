#include "pipelined/measure.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <vector>

#include "core/block_scales.h"
#include "kernels/pipeline_kernels.h"
#include "platform/device_scope.h"

namespace jo::pipelined {
namespace {

// A back-to-back timing sample (median_back_to_back_us): at least this much GPU time and this many enqueues, so
// that the host's latency before the first is a small share of it.
constexpr double kSampleUs = 1000;
constexpr int kMinBackToBack = 4;

// A device allocation freed at scope exit.
struct DeviceBuffer {
  void* p = nullptr;
  ~DeviceBuffer() {
    if (p) (void)hipFree(p);
  }
};

// Median over `repeats` of the time between events around `per_sample` enqueue(stream)s, per enqueue, after one
// warm-up.
Status median_us(hipStream_t stream, int repeats, const std::function<Status(hipStream_t)>& enqueue, double* us,
                 int per_sample = 1) {
  hipEvent_t start = nullptr, stop = nullptr;
  JO_RETURN_IF_HIP_ERROR(hipEventCreate(&start));
  JO_RETURN_IF_HIP_ERROR(hipEventCreate(&stop));
  std::vector<double> times;
  Status status = enqueue(stream);
  for (int i = 0; i < repeats && status.ok(); ++i) {
    float ms = 0;
    const hipError_t recorded = hipEventRecord(start, stream);
    status = recorded == hipSuccess ? Status{} : Status{hipGetErrorString(recorded)};
    for (int j = 0; j < per_sample && status.ok(); ++j) status = enqueue(stream);
    if (!status.ok()) break;
    const hipError_t e = [&] {
      hipError_t r = hipEventRecord(stop, stream);
      if (r == hipSuccess) r = hipEventSynchronize(stop);
      if (r == hipSuccess) r = hipEventElapsedTime(&ms, start, stop);
      return r;
    }();
    if (e != hipSuccess) status = Status{std::string("timing failed: ") + hipGetErrorString(e)};
    times.push_back(ms * 1e3 / per_sample);
  }
  (void)hipEventDestroy(start);
  (void)hipEventDestroy(stop);
  JO_RETURN_IF_ERROR(status);
  std::sort(times.begin(), times.end());
  *us = times.empty() ? 0.0 : times[times.size() / 2];
  return {};
}

// median_us with samples of enqueues back to back, each sample about kSampleUs long (one enqueue alone, as its
// first estimate, also times the host's enqueue of it).
Status median_back_to_back_us(hipStream_t stream, int repeats, const std::function<Status(hipStream_t)>& enqueue,
                              double* us) {
  double one = 0;
  JO_RETURN_IF_ERROR(median_us(stream, 1, enqueue, &one));
  const int per_sample = std::clamp(static_cast<int>(std::ceil(kSampleUs / std::max(one, 1.0))), kMinBackToBack, 64);
  return median_us(stream, repeats, enqueue, us, per_sample);
}

// Median over `repeats` of the host's wall time (us) per enqueue(stream) of kHostSample enqueues back to back,
// each sample after the stream has drained (a queue that fills would block the host), after one warm-up.
constexpr int kHostSample = 8;
Status median_host_us(hipStream_t stream, int repeats, const std::function<Status(hipStream_t)>& enqueue,
                      double* us) {
  JO_RETURN_IF_ERROR(enqueue(stream));
  std::vector<double> times;
  for (int i = 0; i < repeats; ++i) {
    JO_RETURN_IF_HIP_ERROR(hipStreamSynchronize(stream));
    const auto start = std::chrono::steady_clock::now();
    for (int j = 0; j < kHostSample; ++j) JO_RETURN_IF_ERROR(enqueue(stream));
    times.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() /
                    kHostSample);
  }
  JO_RETURN_IF_HIP_ERROR(hipStreamSynchronize(stream));
  std::sort(times.begin(), times.end());
  *us = times.empty() ? 0.0 : times[times.size() / 2];
  return {};
}

// Keeps the GPU busy with enqueue(stream) for about `ms` milliseconds, then
// waits for it: a GPU idle before a timing runs its first tens of milliseconds
// on higher clocks than under the sustained load of a training step.
Status warm_up(hipStream_t stream, const std::function<Status(hipStream_t)>& enqueue, double ms) {
  if (ms <= 0) return {};
  double one_us = 0;
  JO_RETURN_IF_ERROR(median_us(stream, 1, enqueue, &one_us));
  const int launches = static_cast<int>(ms * 1e3 / std::max(one_us, 1.0));
  for (int i = 0; i < launches; ++i) JO_RETURN_IF_ERROR(enqueue(stream));
  JO_RETURN_IF_HIP_ERROR(hipStreamSynchronize(stream));
  return {};
}

// A non-blocking stream, drained and destroyed at scope exit.
struct TimingStream {
  hipStream_t s = nullptr;
  ~TimingStream() {
    if (s) {
      (void)hipStreamSynchronize(s);
      (void)hipStreamDestroy(s);
    }
  }
};

}  // namespace

Status time_gemms(int ordinal, const GemmTypes& types, const std::vector<int64_t>& rows, int64_t n, int64_t k,
                  bool w_kmajor, int repeats, double warmup_ms, const blas::TuningOptions& tuning,
                  std::vector<double>* us) {
  DeviceScope scope(ordinal);
  JO_RETURN_IF_HIP_ERROR(scope.status());
  blas::DeviceBlas* blas = nullptr;
  JO_RETURN_IF_ERROR(blas::DeviceBlas::prepare(ordinal, &blas));
  const int64_t max_rows = rows.empty() ? 0 : *std::max_element(rows.begin(), rows.end());
  DeviceBuffer x, w, y, workspace, scales;
  JO_RETURN_IF_HIP_ERROR(hipMalloc(&x.p, max_rows * k * element_bytes(types.x)));
  JO_RETURN_IF_HIP_ERROR(hipMalloc(&w.p, k * n * element_bytes(types.w)));
  JO_RETURN_IF_HIP_ERROR(hipMalloc(&y.p, max_rows * n * element_bytes(types.out)));
  JO_RETURN_IF_HIP_ERROR(hipMalloc(&workspace.p, blas::kWorkspaceBytes));
  // x's scales, then w's from the next aligned slot: one float each, or block scales (core/block_scales.h) of ones.
  const int64_t x_scales = types.blocks ? (x_block_scales(max_rows, k) + blas::kScaleSlot - 1) / blas::kScaleSlot *
                                              blas::kScaleSlot
                                        : blas::kScaleSlot;
  if (types.scaled) {
    std::vector<float> ones(x_scales + (types.blocks ? w_block_scales(n, k) : 1), 1.f);
    JO_RETURN_IF_HIP_ERROR(hipMalloc(&scales.p, ones.size() * sizeof(float)));
    JO_RETURN_IF_HIP_ERROR(hipMemcpy(scales.p, ones.data(), ones.size() * sizeof(float), hipMemcpyHostToDevice));
  }
  TimingStream timing;
  JO_RETURN_IF_HIP_ERROR(hipStreamCreateWithFlags(&timing.s, hipStreamNonBlocking));
  const hipStream_t stream = timing.s;
  // Random operands: on constant data (as on zeros) the GEMM runs up to ~15% faster than on real data.
  JO_RETURN_IF_HIP_ERROR(launch_fill_random(x.p, static_cast<uint64_t>(max_rows * k), types.x, 1, stream));
  JO_RETURN_IF_HIP_ERROR(launch_fill_random(w.p, static_cast<uint64_t>(k * n), types.w, 2, stream));
  const auto operands = [&](int64_t r) {
    Operands op{};
    op.gemm = GemmProblem::dense(types, /*batch=*/1, r, k, n, w_kmajor, /*bias=*/false);
    op.x = x.p;
    op.w = w.p;
    op.x_scale = types.scaled ? static_cast<const float*>(scales.p) : nullptr;
    op.w_scale = types.scaled ? static_cast<const float*>(scales.p) + x_scales : nullptr;
    op.out = y.p;
    op.scratch = workspace.p;
    return op;
  };
  for (int64_t r : rows) {  // each problem's algorithm chosen before any is timed
    blas::TuneResult tuned;
    JO_RETURN_IF_ERROR(blas->tune(local_problem(operands(r)), tuning, &tuned));
  }
  const blas::Handle handle = blas->tool_handle();
  std::lock_guard<std::mutex> tool(blas->tool_mu());
  const auto gemm = [&](int64_t r) {
    return [op = operands(r), blas, handle](hipStream_t s) { return enqueue_local_gemm(op, *blas, s, handle); };
  };
  Status status = rows.empty() ? Status{} : warm_up(stream, gemm(max_rows), warmup_ms);
  // Each sample is GEMMs back to back, as a schedule enqueues them: one GEMM alone between two events also times
  // the host's enqueue of it (tens of us with cuBLASLt), which a schedule hides (the cost model put a
  // loopback fp8 ag_matmul of eight GEMMs at 1.31x its time, 1.18x with samples back to back).
  us->clear();
  for (size_t i = 0; i < rows.size() && status.ok(); ++i) {
    double t = 0;
    status = median_back_to_back_us(stream, repeats, gemm(rows[i]), &t);
    if (status.ok()) us->push_back(t);
  }
  return status;
}

Status time_copy(int ordinal, const void* src, uint64_t bytes, int repeats, CopyPath path, uint64_t max_piece_bytes,
                 double* us) {
  DeviceScope scope(ordinal);
  JO_RETURN_IF_HIP_ERROR(scope.status());
  DeviceBuffer dst, own_src;
  JO_RETURN_IF_HIP_ERROR(hipMalloc(&dst.p, bytes));
  if (src == nullptr) {
    JO_RETURN_IF_HIP_ERROR(hipMalloc(&own_src.p, bytes));
    src = own_src.p;
  }
  TimingStream timing;
  JO_RETURN_IF_HIP_ERROR(hipStreamCreateWithFlags(&timing.s, hipStreamNonBlocking));
  return median_us(
      timing.s, repeats,
      [&](hipStream_t s) { return copy_2d(path, dst.p, bytes, src, bytes, bytes, 1, s, max_piece_bytes); },
      us);
}

Status copy_and_wait(int ordinal, CopyPath path, void* dst, uint64_t dst_pitch, const void* src, uint64_t src_pitch,
                     uint64_t width, uint64_t height, uint64_t max_bytes) {
  DeviceScope scope(ordinal);
  JO_RETURN_IF_HIP_ERROR(scope.status());
  TimingStream stream;
  JO_RETURN_IF_HIP_ERROR(hipStreamCreateWithFlags(&stream.s, hipStreamNonBlocking));
  JO_RETURN_IF_ERROR(copy_2d(path, dst, dst_pitch, src, src_pitch, width, height, stream.s, max_bytes));
  JO_RETURN_IF_HIP_ERROR(hipStreamSynchronize(stream.s));
  return {};
}

Status time_reduce(int ordinal, DType dtype, int count, int64_t rows, int64_t n, int repeats, double* us) {
  if (count < 1 || count > kMaxWorld) return Status{"jax_overlap: time_reduce takes 1 to 8 partials"};
  DeviceScope scope(ordinal);
  JO_RETURN_IF_HIP_ERROR(scope.status());
  const uint64_t elems = static_cast<uint64_t>(rows) * n;
  const DType partial = partial_dtype(dtype);  // what launch_reduce reads
  const int elem = element_bytes(partial);
  DeviceBuffer partials, out;
  JO_RETURN_IF_HIP_ERROR(hipMalloc(&partials.p, count * elems * elem));
  JO_RETURN_IF_HIP_ERROR(hipMalloc(&out.p, elems * element_bytes(dtype)));
  int sm_count = 0;
  JO_RETURN_IF_HIP_ERROR(hipDeviceGetAttribute(&sm_count, hipDeviceAttributeMultiprocessorCount, ordinal));
  TimingStream timing;
  JO_RETURN_IF_HIP_ERROR(hipStreamCreateWithFlags(&timing.s, hipStreamNonBlocking));
  JO_RETURN_IF_HIP_ERROR(launch_fill_random(partials.p, count * elems, partial, 3, timing.s));
  ReduceArgs r{};
  r.dtype = dtype;
  r.bias_dtype = dtype;
  for (int q = 0; q < count; ++q) {
    r.partials[q] = static_cast<char*>(partials.p) + q * elems * elem;
    r.partial_batch_stride[q] = static_cast<int64_t>(elems);
  }
  r.count = count;
  r.out = out.p;
  r.batch = 1;
  r.rows = rows;
  r.n = n;
  return median_back_to_back_us(
      timing.s, repeats,
      [&](hipStream_t s) -> Status {
        JO_RETURN_IF_HIP_ERROR(launch_reduce(r, sm_count, s));
        return {};
      },
      us);
}

namespace {

// One loopback call of the op as rank 0 of `world` on GPU `ordinal`: its context on side streams of its own, and
// a stream of its own to enqueue it on (drained before the side streams go).
class LoopbackCall {
 public:
  explicit LoopbackCall(int ordinal) : ordinal_(ordinal), scope_(ordinal) {}

  Status open(OpKind op, const Operands& operands, int world, CopyPath path) {
    JO_RETURN_IF_HIP_ERROR(scope_.status());
    JO_RETURN_IF_ERROR(check_stages(op, world, operands.stages, operands.stage_count));
    JO_RETURN_IF_ERROR(SideStreams::create(ordinal_, &streams_));
    ctx_.streams = streams_.get();
    JO_RETURN_IF_ERROR(blas::DeviceBlas::prepare(ordinal_, &ctx_.blas));
    JO_RETURN_IF_ERROR(ctx_.streams->attach_blas(*ctx_.blas));
    ctx_.peers.world = world;
    ctx_.peers.rank = 0;
    ctx_.epoch = 1;
    ctx_.site = 1;
    int sm_count = 0;
    JO_RETURN_IF_HIP_ERROR(hipDeviceGetAttribute(&sm_count, hipDeviceAttributeMultiprocessorCount, ordinal_));
    ctx_.sm_count = sm_count;
    ctx_.gemm_sms = gemm_sm_count(sm_count);
    ctx_.loopback = true;
    ctx_.copy_path = path;
    JO_RETURN_IF_HIP_ERROR(hipStreamCreateWithFlags(&timing_.s, hipStreamNonBlocking));
    enqueue_ = [this, op, &operands](hipStream_t s) { return enqueue(op, operands, ctx_, s); };
    return {};
  }

  hipStream_t stream() const { return timing_.s; }
  const std::function<Status(hipStream_t)>& enqueuer() const { return enqueue_; }
  const StreamEdges& edges() const { return streams_->edges; }

 private:
  int ordinal_;
  DeviceScope scope_;
  std::unique_ptr<SideStreams> streams_;
  Context ctx_{};
  std::function<Status(hipStream_t)> enqueue_;
  TimingStream timing_;  // last: destroyed first, drained while the side streams still exist
};

}  // namespace

Status time_loopback(int ordinal, OpKind op, const Operands& operands, int world, int repeats, CopyPath path,
                     bool back_to_back, double* us) {
  LoopbackCall call(ordinal);
  JO_RETURN_IF_ERROR(call.open(op, operands, world, path));
  return back_to_back ? median_back_to_back_us(call.stream(), repeats, call.enqueuer(), us)
                      : median_us(call.stream(), repeats, call.enqueuer(), us);
}

Status time_loopback_enqueue(int ordinal, OpKind op, const Operands& operands, int world, int repeats, CopyPath path,
                             double* us) {
  LoopbackCall call(ordinal);
  JO_RETURN_IF_ERROR(call.open(op, operands, world, path));
  return median_host_us(call.stream(), repeats, call.enqueuer(), us);
}

Status loopback_edges(int ordinal, OpKind op, const Operands& operands, int world, CopyPath path, StreamEdges* out) {
  LoopbackCall call(ordinal);
  JO_RETURN_IF_ERROR(call.open(op, operands, world, path));
  JO_RETURN_IF_ERROR(call.enqueuer()(call.stream()));
  JO_RETURN_IF_HIP_ERROR(hipStreamSynchronize(call.stream()));
  *out = call.edges();
  return {};
}

}  // namespace jo::pipelined
