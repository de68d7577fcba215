#include "testing/sim_group.h"

#include <cstring>
#include <thread>

#include "kernels/ag_matmul.h"
#include "kernels/all_gather.h"
#include "kernels/matmul_rs.h"
#include "kernels/region_layout.h"
#include "pipelined/schedule.h"

namespace jo {

Status SimGroup::create(int ordinal, int world, uint64_t bytes_per_rank, double watchdog_seconds,
                        std::unique_ptr<SimGroup>* out) {
  if (world < 1 || world > kMaxWorld) return Status{"SimGroup: world must be in [1, " + std::to_string(kMaxWorld) + "]"};
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
    g->side_streams_.emplace_back();
    JO_RETURN_IF_ERROR(pipelined::SideStreams::create(ordinal, &g->side_streams_.back()));
  }
  JO_RETURN_IF_ERROR(blas::DeviceBlas::prepare(ordinal, &g->blas_));
  for (auto& side : g->side_streams_) JO_RETURN_IF_ERROR(side->attach_blas(*g->blas_));
  JO_RETURN_IF_HIP_ERROR(hipDeviceSynchronize());
  *out = std::move(g);
  return {};
}

SimGroup::~SimGroup() {
  (void)hipSetDevice(ordinal_);
  (void)hipDeviceSynchronize();
  side_streams_.clear();
  for (char* b : bases_) (void)hipFree(b);
  for (ErrorRecord* r : records_host_) (void)hipHostFree(r);
  for (hipStream_t s : streams_) (void)hipStreamDestroy(s);
}

Status SimGroup::region(OpKind op, bool pipelined, uint64_t bytes, uint64_t* offset) {
  const auto key = std::make_tuple(op, pipelined, bytes);
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

Peers SimGroup::peers(int rank, uint64_t offset) const {
  Peers p{};
  p.rank = rank;
  p.world = world_;
  for (int r = 0; r < world_; ++r) p.regions[r] = bases_[r] + offset;
  return p;
}

Watchdog SimGroup::watchdog(int rank, OpKind op) const {
  return Watchdog{records_device_[rank], abort_flag(rank), timeout_ticks_, static_cast<uint32_t>(op)};
}

CallContext SimGroup::context(int rank, uint64_t offset, EpochCounter& epochs, uint32_t site, OpKind op) const {
  const uint64_t epoch = epochs.next();
  return CallContext{peers(rank, offset), epoch, site, epochs.slot_used(epoch), watchdog(rank, op),
                     TraceSink{nullptr, nullptr, nullptr, 0}, LaunchLimits{info_.sm_count, world_, info_.l2_bytes}};
}

GemmOperands SimMatmul::operands(int rank) const {
  return GemmOperands{types.x, tile, w_kmajor, reinterpret_cast<const void*>(x[rank]),
                      reinterpret_cast<const void*>(w[rank]), reinterpret_cast<const void*>(bias[rank]), batch, k, n,
                      comm_workgroups};
}

Status SimGroup::run(uint64_t offset, const std::vector<int>& ranks, bool sync,
                     const std::function<Status(int, hipStream_t, EpochCounter&)>& launch) {
  JO_RETURN_IF_HIP_ERROR(hipSetDevice(ordinal_));
  std::vector<EpochCounter>& epochs = epochs_[offset];
  if (epochs.empty()) {
    epochs.resize(world_);
    for (EpochCounter& c : epochs) c.restart(epoch_origin_);
  }
  std::vector<int> all;
  for (int r = 0; r < world_; ++r) all.push_back(r);
  const std::vector<int>& chosen = ranks.empty() ? all : ranks;
  for (int r : chosen)
    if (r < 0 || r >= world_) return Status{"SimGroup: no rank " + std::to_string(r)};
  // Each rank enqueues from a thread of its own, as ranks do from their own
  // processes: a launch that blocks its host thread (CUDA's lazy loading of a
  // kernel's module waits for the device's running kernels) must not keep
  // the other ranks from enqueuing the releases those kernels wait for.
  std::vector<Status> launched(world_);
  std::vector<std::thread> threads;
  for (int r : chosen) {
    if (r == absent_) continue;
    threads.emplace_back([&, r] {
      const hipError_t set = hipSetDevice(ordinal_);
      launched[r] = set == hipSuccess ? launch(r, streams_[r], epochs[r]) : Status{hipGetErrorString(set)};
    });
  }
  for (std::thread& t : threads) t.join();
  for (const Status& s : launched) JO_RETURN_IF_ERROR(s);
  if (sync)
    for (int r : chosen) JO_RETURN_IF_HIP_ERROR(hipStreamSynchronize(streams_[r]));
  return {};
}

Status SimGroup::synchronize() {
  for (hipStream_t s : streams_) JO_RETURN_IF_HIP_ERROR(hipStreamSynchronize(s));
  return {};
}

Status SimGroup::clear_errors() {
  // As jax_overlap.clear_errors(): stop every rank's waits, then zero every
  // rank's regions and epochs, then forget the records: the ranks restart in step.
  JO_RETURN_IF_HIP_ERROR(hipSetDevice(ordinal_));
  for (int r = 0; r < world_; ++r) JO_RETURN_IF_HIP_ERROR(hipMemset(abort_flag(r), 0xFF, sizeof(uint32_t)));
  JO_RETURN_IF_HIP_ERROR(hipDeviceSynchronize());
  for (int r = 0; r < world_; ++r) JO_RETURN_IF_HIP_ERROR(hipMemset(bases_[r] + kHeaderBytes, 0, bytes_ - kHeaderBytes));
  epochs_.clear();
  for (int r = 0; r < world_; ++r)
    JO_RETURN_IF_ERROR(clear_watchdog(ordinal_, records_host_[r], abort_flag(r)));
  return {};
}

std::vector<std::string> SimGroup::errors() const {
  std::vector<std::string> out;
  for (ErrorRecord* r : records_host_)
    if (error_recorded(*r)) out.push_back(describe_error(*r, info_.ticks_per_second));
  return out;
}

Status SimGroup::ag_matmul(const SimMatmul& c) {
  uint64_t offset = 0;
  JO_RETURN_IF_ERROR(region(OpKind::kAgMatmul, /*pipelined=*/false,
                            ag_matmul_region_bytes(world_, c.batch * c.m, c.k, c.tile, c.chunk_k,
                                                   element_bytes(c.types.x)),
                            &offset));
  return run(offset, c.ranks, c.sync, [&](int r, hipStream_t s, EpochCounter& epochs) -> Status {
    const AgMatmulLaunch l{c.operands(r), reinterpret_cast<void*>(c.out[r]),
                           world_ > 1 ? reinterpret_cast<void*>(c.gathered[r]) : nullptr, c.m, c.chunk_k,
                           context(r, offset, epochs, c.site, OpKind::kAgMatmul)};
    JO_RETURN_IF_HIP_ERROR(launch_ag_matmul(l, s));
    return {};
  });
}

Status SimGroup::matmul_rs(const SimMatmul& c) {
  uint64_t offset = 0;
  JO_RETURN_IF_ERROR(region(OpKind::kMatmulRs, /*pipelined=*/false,
                            matmul_rs_region_bytes(world_, c.batch, c.m, c.n, c.tile, element_bytes(c.types.x)),
                            &offset));
  return run(offset, c.ranks, c.sync, [&](int r, hipStream_t s, EpochCounter& epochs) -> Status {
    const MatmulRsLaunch l{c.operands(r), reinterpret_cast<void*>(c.out[r]), c.m,
                           context(r, offset, epochs, c.site, OpKind::kMatmulRs)};
    JO_RETURN_IF_HIP_ERROR(launch_matmul_rs(l, s));
    return {};
  });
}

Status SimGroup::all_gather(const std::vector<uintptr_t>& x, const std::vector<uintptr_t>& gathered, int64_t batch,
                            int64_t m, int64_t row_bytes) {
  uint64_t offset = 0;
  JO_RETURN_IF_ERROR(
      region(OpKind::kAllGather, /*pipelined=*/false, all_gather_region_bytes(world_, batch * m, row_bytes), &offset));
  return run(offset, {}, true, [&](int r, hipStream_t s, EpochCounter& epochs) -> Status {
    AllGatherLaunch l{};
    l.x = reinterpret_cast<const void*>(x[r]);
    l.gathered = reinterpret_cast<void*>(gathered[r]);
    l.batch = batch;
    l.m = m;
    l.row_bytes = row_bytes;
    l.ctx = context(r, offset, epochs, /*site=*/1, OpKind::kAllGather);
    JO_RETURN_IF_HIP_ERROR(launch_all_gather(l, s));
    return {};
  });
}

Status SimGroup::pipelined(OpKind op, const SimMatmul& c) {
  uint64_t offset = 0;
  const GemmTypes& t = c.types;
  JO_RETURN_IF_ERROR(region(op, /*pipelined=*/true,
                            pipelined::region_bytes(op, world_, c.batch, c.m, c.k, c.n, element_bytes(t.x),
                                                    element_bytes(partial_dtype(t.out)), t.scaled, t.blocks),
                            &offset));
  JO_RETURN_IF_ERROR(pipelined::check_stages(op, world_, c.stages.data(), static_cast<int>(c.stages.size())));
  bool gathers = false;  // the op fills c.gathered
  const size_t scales = t.scaled ? static_cast<size_t>(world_) : 0;
  if (c.x_scale.size() != scales || c.w_scale.size() != scales)
    return Status{"SimGroup: a scaled call takes an x_scale and a w_scale per rank, an unscaled one none"};
  switch (op) {
    case OpKind::kAgMatmul:
      gathers = true;
      if (c.gathered_scales.size() != scales) return Status{"SimGroup: a scaled ag_matmul takes gathered_scales"};
      break;
    case OpKind::kMatmulRs:
      if (c.m % world_ != 0) return Status{"SimGroup: rows must be a multiple of the world size"};
      break;
    case OpKind::kAllGather: return Status{"SimGroup: all_gather has no pipelined schedule"};
  }
  return run(offset, c.ranks, c.sync, [&](int r, hipStream_t s, EpochCounter& epochs) {
    pipelined::Operands o{};
    o.gemm = GemmProblem::dense(t, c.batch, c.m, c.k, c.n, c.w_kmajor, c.bias[r] != 0);
    o.x = reinterpret_cast<const void*>(c.x[r]);
    o.w = reinterpret_cast<const void*>(c.w[r]);
    o.bias = reinterpret_cast<const void*>(c.bias[r]);
    if (t.scaled) {
      o.x_scale = reinterpret_cast<const float*>(c.x_scale[r]);
      o.w_scale = reinterpret_cast<const float*>(c.w_scale[r]);
      o.gathered_scales = gathers ? reinterpret_cast<float*>(c.gathered_scales[r]) : nullptr;
    }
    o.out = reinterpret_cast<void*>(c.out[r]);
    o.gathered = gathers ? reinterpret_cast<void*>(c.gathered[r]) : nullptr;
    o.scratch = reinterpret_cast<void*>(c.scratch[r]);
    o.stages = c.stages.data();
    o.stage_count = static_cast<int>(c.stages.size());
    // The epoch is run_call's to take (after the plans).
    const pipelined::Context ctx{side_streams_[r].get(), blas_, peers(r, offset), 0, c.site, false, watchdog(r, op),
                                 info_.sm_count, false};
    return pipelined::run_call(op, o, ctx, epochs, s);
  });
}

}  // namespace jo
