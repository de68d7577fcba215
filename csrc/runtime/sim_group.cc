#include "runtime/sim_group.h"

#include <cstring>

#include "kernels/ag_matmul.h"
#include "kernels/all_gather.h"
#include "kernels/matmul_rs.h"
#include "kernels/region_layout.h"

namespace jo {
namespace {

enum SimOp { kSimAg = 0, kSimRs = 1, kSimGather = 2 };

}  // namespace

Status SimGroup::create(int ordinal, int world, uint64_t bytes_per_rank, double watchdog_seconds,
                        std::unique_ptr<SimGroup>* out) {
  if (world < 1 || world > kMaxWorld) return Status{"SimGroup: world must be in [1, 16]"};
  std::unique_ptr<SimGroup> g(new SimGroup());
  g->ordinal_ = ordinal;
  g->world_ = world;
  g->bytes_ = bytes_per_rank;
  JO_RETURN_IF_ERROR(query_device(ordinal, &g->info_));
  g->timeout_ticks_ = static_cast<uint64_t>(watchdog_seconds * static_cast<double>(g->info_.ticks_per_second));
  JO_RETURN_IF_HIP_ERROR(hipSetDevice(ordinal));
  for (int r = 0; r < world; ++r) {
    void* base = nullptr;
    JO_RETURN_IF_HIP_ERROR(hipMalloc(&base, bytes_per_rank));
    g->bases_.push_back(static_cast<char*>(base));
    JO_RETURN_IF_HIP_ERROR(hipMemset(base, 0, bytes_per_rank));
    void* rec = nullptr;
    JO_RETURN_IF_HIP_ERROR(hipHostMalloc(&rec, sizeof(ErrorRecord), hipHostMallocMapped));
    std::memset(rec, 0, sizeof(ErrorRecord));
    g->records_host_.push_back(static_cast<ErrorRecord*>(rec));
    void* rec_dev = nullptr;
    JO_RETURN_IF_HIP_ERROR(hipHostGetDevicePointer(&rec_dev, rec, 0));
    g->records_device_.push_back(static_cast<ErrorRecord*>(rec_dev));
    hipStream_t s;
    JO_RETURN_IF_HIP_ERROR(hipStreamCreateWithFlags(&s, hipStreamNonBlocking));
    g->streams_.push_back(s);
  }
  JO_RETURN_IF_HIP_ERROR(hipDeviceSynchronize());
  *out = std::move(g);
  return {};
}

SimGroup::~SimGroup() {
  (void)hipSetDevice(ordinal_);
  (void)hipDeviceSynchronize();
  for (char* b : bases_) (void)hipFree(b);
  for (ErrorRecord* r : records_host_) (void)hipHostFree(r);
  for (hipStream_t s : streams_) (void)hipStreamDestroy(s);
}

Status SimGroup::region(int op, uint64_t bytes, uint64_t* offset) {
  auto key = std::make_pair(op, bytes);
  auto it = regions_.find(key);
  if (it == regions_.end()) {
    if (next_offset_ + bytes > bytes_)
      return Status{"SimGroup: workspace of " + std::to_string(bytes_) + " bytes per rank is too small; the call needs " +
                    std::to_string(next_offset_ + bytes)};
    it = regions_.emplace(key, next_offset_).first;
    next_offset_ = align_up(next_offset_ + bytes, 4096);
  }
  *offset = it->second;
  return {};
}

CallContext SimGroup::context(int rank, uint64_t offset, uint32_t epoch, OpKind op) const {
  Peers p{};
  p.rank = rank;
  p.world = world_;
  for (int r = 0; r < world_; ++r) p.regions[r] = bases_[r] + offset;
  const Watchdog wd{records_device_[rank], abort_flag(rank), timeout_ticks_, static_cast<uint32_t>(op)};
  return CallContext{p, epoch, wd, TraceSink{nullptr, nullptr, nullptr, 0}, LaunchLimits{info_.sm_count, world_, info_.l2_bytes}};
}

GemmOperands SimMatmul::operands(int rank) const {
  return GemmOperands{dtype, tile, w_kmajor, reinterpret_cast<const void*>(x[rank]),
                      reinterpret_cast<const void*>(w[rank]), reinterpret_cast<const void*>(bias[rank]), batch, k, n,
                      comm_workgroups};
}

Status SimGroup::run(const std::function<hipError_t(int, hipStream_t)>& launch) {
  JO_RETURN_IF_HIP_ERROR(hipSetDevice(ordinal_));
  for (int r = 0; r < world_; ++r)
    if (r != absent_) JO_RETURN_IF_HIP_ERROR(launch(r, streams_[r]));
  for (int r = 0; r < world_; ++r) JO_RETURN_IF_HIP_ERROR(hipStreamSynchronize(streams_[r]));
  return {};
}

Status SimGroup::clear_errors() {
  for (int r = 0; r < world_; ++r)
    JO_RETURN_IF_ERROR(clear_watchdog(ordinal_, records_host_[r], abort_flag(r)));
  return {};
}

std::vector<std::string> SimGroup::errors() const {
  std::vector<std::string> out;
  for (ErrorRecord* r : records_host_)
    if (*static_cast<volatile uint32_t*>(&r->valid)) out.push_back(describe_error(*r, info_.ticks_per_second));
  return out;
}

Status SimGroup::ag_matmul(const SimMatmul& c) {
  const int elem = 2;
  uint64_t offset = 0;
  JO_RETURN_IF_ERROR(region(kSimAg, ag_matmul_region_bytes(world_, c.batch * c.m, c.k, c.tile, c.chunk_k, elem),
                            &offset));
  const uint32_t epoch = ++epochs_[offset];
  return run([&](int r, hipStream_t s) {
    const AgMatmulLaunch l{c.operands(r), reinterpret_cast<void*>(c.out[r]),
                           world_ > 1 ? reinterpret_cast<void*>(c.gathered[r]) : nullptr, c.m, c.chunk_k,
                           context(r, offset, epoch, OpKind::kAgMatmul)};
    return launch_ag_matmul(l, s);
  });
}

Status SimGroup::matmul_rs(const SimMatmul& c) {
  const int elem = 2;
  uint64_t offset = 0;
  JO_RETURN_IF_ERROR(region(kSimRs, matmul_rs_region_bytes(world_, c.batch, c.m, c.n, c.tile, elem), &offset));
  const uint32_t epoch = ++epochs_[offset];
  return run([&](int r, hipStream_t s) {
    const MatmulRsLaunch l{c.operands(r), reinterpret_cast<void*>(c.out[r]), c.m,
                           context(r, offset, epoch, OpKind::kMatmulRs)};
    return launch_matmul_rs(l, s);
  });
}

Status SimGroup::all_gather(const std::vector<uintptr_t>& x, const std::vector<uintptr_t>& gathered, int64_t batch,
                            int64_t m, int64_t row_bytes) {
  uint64_t offset = 0;
  JO_RETURN_IF_ERROR(region(kSimGather, all_gather_region_bytes(world_, batch * m, row_bytes), &offset));
  const uint32_t epoch = ++epochs_[offset];
  return run([&](int r, hipStream_t s) {
    AllGatherLaunch l{};
    l.x = reinterpret_cast<const void*>(x[r]);
    l.gathered = reinterpret_cast<void*>(gathered[r]);
    l.batch = batch;
    l.m = m;
    l.row_bytes = row_bytes;
    l.ctx = context(r, offset, epoch, OpKind::kAllGather);
    return launch_all_gather(l, s);
  });
}

}  // namespace jo
