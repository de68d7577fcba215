// Launch geometry of the persistent kernels, and their one launcher. The
// geometry functions here are the only place that decides a launch's grid,
// co-resident workgroups, tiles and stream-K tail: the launchers use them, and
// the planner reads the same figures through the Python module
// (bindings/fused.cc gemm_geometry -> jax_overlap/runtime/backend.py GemmGeometry).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "gemm/tile_order.h"
#include "gemm/tile_scheduler.h"
#include "kernels/params.h"
#include "platform/gpu.h"

namespace jo {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Workgroups of kKernel that one SM runs at once (its occupancy with
// smem_bytes of dynamic shared memory). The kernel's shared-memory limit and
// occupancy are set up once per device (they cost microseconds; this is on
// every call's path). kKernel is a template argument so that every kernel has
// its own cache.
template <auto kKernel>
hipError_t workgroups_per_sm(int threads, int smem_bytes, int* per_sm) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices];  // 0: not queried yet on that device
  int device = 0;
  hipError_t e = hipGetDevice(&device);
  if (e != hipSuccess) return e;
  *per_sm = device < kMaxDevices ? cached[device].load(std::memory_order_relaxed) : 0;
  if (*per_sm == 0) {
    const void* fn = reinterpret_cast<const void*>(kKernel);
    e = hipFuncSetAttribute(fn, hipFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (e != hipSuccess) return e;
    e = hipOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, fn, threads, static_cast<size_t>(smem_bytes));
    if (e != hipSuccess) return e;
    if (device < kMaxDevices) cached[device].store(*per_sm, std::memory_order_relaxed);
  }
  return hipSuccess;
}

// The largest grid that stays co-resident on this rank's share of the GPU:
// workgroups of a persistent kernel wait on each other, so all of them must
// run at once.
inline int co_resident_workgroups(int per_sm, const LaunchLimits& limits) {
  return per_sm * limits.sm_count / std::max(limits.ranks_per_gpu, 1);
}

// A persistent GEMM launch of mainloop ML over `groups` GEMMs of rows x n x k
// (the world's shards or row blocks): comm_workgroups movers in front of one
// GEMM workgroup per output tile at most, tile bands (gemm/tile_order.h)
// sized from this rank's share of the L2, and, for a group of one whose tiles
// are all interior and leave a partial last wave, a stream-K tail with one
// scratch slot per workgroup (gemm/tile_scheduler.h). per_sm workgroups per
// SM, or kKernel's occupancy when per_sm == 0. hipErrorInvalidValue when no
// GEMM workgroup is left.
template <auto kKernel, class ML>
hipError_t gemm_geometry(int per_sm, const LaunchLimits& limits, int comm_workgroups, int groups, int64_t rows,
                         int64_t n, int64_t k, GemmGeometry* geo) {
  if (per_sm == 0) {
    const hipError_t e = workgroups_per_sm<kKernel>(ML::kThreads, ML::kSmemBytes, &per_sm);
    if (e != hipSuccess) return e;
  }
  const int64_t tiles = ceil_div(rows, ML::BM) * ceil_div(n, ML::BN) * groups;
  GemmGeometry g{};
  g.workgroups_per_sm = per_sm;
  g.co_resident = co_resident_workgroups(per_sm, limits);
  g.comm_workgroups = comm_workgroups;
  g.grid = static_cast<int>(std::min<int64_t>(g.co_resident, comm_workgroups + tiles));
  g.tiles = tiles;
  g.group_cols = gemm::band_columns(static_cast<int>(ceil_div(n, ML::BN)), ML::BN, k, sizeof(typename ML::Elem),
                                    limits.l2_bytes / std::max(limits.ranks_per_gpu, 1));
  const int64_t ldb = ML::kBKMajor ? k : n;
  if (ML::kStreamK && groups == 1 && ML::interior_gemm(rows, static_cast<int>(n), static_cast<int>(k), ldb) &&
      tiles > g.grid && tiles % g.grid != 0)
    g.tail_slots = g.grid;
  g.tail_scratch_bytes = gemm::tail_scratch_bytes(g.tail_slots, ML::BM * ML::BN);
  *geo = g;
  return g.grid > comm_workgroups ? hipSuccess : hipErrorInvalidValue;
}

// The stream-K tail of a group-of-one launch of `grid` workgroups over
// `tiles` tiles in the scratch the call was given (none for tiles without it).
template <class ML>
gemm::TailSplit tail_split(const TailScratch& scratch, int64_t tiles, int grid) {
  if (!ML::kStreamK) return {static_cast<int>(tiles), nullptr, nullptr, 0};
  return gemm::tail_split(static_cast<int>(tiles), grid, scratch.data, scratch.slots, scratch.timeout_ticks);
}

// The fields every fused GEMM kernel's argument struct starts with: the
// operands, the band width, the call's protocol context and, at world 1, the
// stream-K tail.
template <typename T>
struct FusedGemmArgs {
  const T* x;
  const T* w;
  const T* bias;
  int k;
  int n;
  int group_cols;  // tile columns per band (gemm/tile_order.h)
  Peers peers;
  uint32_t epoch;  // the low bits of CallContext::epoch (region_layout.h flag_value)
  uint32_t site;  // this call site's number among those sharing the region (region_layout.h flag_value)
  bool slot_used;  // CallContext::slot_used: wait for the readers of this epoch's parity slots
  Watchdog wd;
  TraceSink trace;
  gemm::TailSplit tail;  // world 1
};

// FusedGemmArgs from a launch and its geometry (the tail is the launcher's).
template <typename T>
void set_gemm_args(FusedGemmArgs<T>& a, const GemmOperands& op, const CallContext& ctx, const GemmGeometry& geo) {
  a.x = static_cast<decltype(a.x)>(op.x);
  a.w = static_cast<decltype(a.w)>(op.w);
  a.bias = static_cast<decltype(a.bias)>(op.bias);
  a.k = static_cast<int>(op.k);
  a.n = static_cast<int>(op.n);
  a.group_cols = geo.group_cols;
  a.peers = ctx.peers;
  a.epoch = static_cast<uint32_t>(ctx.epoch);
  a.site = ctx.site;
  a.slot_used = ctx.slot_used;
  a.wd = ctx.wd;
  a.trace = ctx.trace;
}

// The one launcher of the persistent kernels.
template <auto kKernel, class Args>
hipError_t launch_persistent(int grid, int threads, int smem_bytes, const Args& args, hipStream_t stream) {
  kKernel<<<grid, threads, smem_bytes, stream>>>(args);
  return hipGetLastError();
}

}  // namespace jo
