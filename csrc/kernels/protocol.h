// Device side of the cross-GPU protocol: bounded waits on epoch flags, the
// watchdog record, trace events, and the gather role (publish this rank's
// shard, pull every peer's) shared by ag_matmul and all_gather.
#pragma once

#include <cstdint>

#include "kernels/params.h"
#include "kernels/region_layout.h"
#include "platform/gpu.h"

namespace jo {

enum class Scope { kDevice, kSystem };

template <Scope S>
__device__ __forceinline__ uint32_t load_acquire(const uint32_t* p) {
  if constexpr (S == Scope::kSystem) {
    return gpu::load_acquire_sys(p);
  } else {
    return gpu::load_acquire_dev(p);
  }
}

__device__ __forceinline__ bool watchdog_fired(const Watchdog& wd) {
  return *static_cast<volatile uint32_t*>(wd.abort) != 0;
}

__device__ __forceinline__ void record_timeout(const Watchdog& wd, uint32_t rank, uint32_t peer, uint32_t world,
                                               uint32_t epoch, WaitOn what, uint64_t waited) {
  *static_cast<volatile uint32_t*>(wd.abort) = 1u;  // every waiter of this kernel leaves
  ErrorRecord* r = wd.record;
  if (gpu::atomic_cas_sys(&r->claimed, 0u, 1u) != 0u) return;  // someone else reported first
  r->op = wd.op;
  r->rank = rank;
  r->peer = peer;
  r->world = world;
  r->epoch = epoch;
  r->what = static_cast<uint32_t>(what);
  r->waited_ticks = waited;
  gpu::store_release_sys(&r->valid, 1u);
}

// Single-thread spin until *flag matches `expected` (a flag_value). False
// when this wait timed out or found another call site's release (both
// recorded), or another workgroup's wait failed (the kernel is abandoning the call).
template <Scope S>
__device__ __forceinline__ bool spin_until(const uint32_t* flag, uint32_t expected, const Watchdog& wd,
                                        uint32_t rank, uint32_t peer, uint32_t world, uint32_t epoch,
                                        WaitOn what) {
  Match m = match(load_acquire<S>(flag), expected);
  if (m == Match::kNo) {
    const uint64_t t0 = gpu::timer_ticks();
    for (uint32_t it = 1; m == Match::kNo; ++it) {
      gpu::backoff();
      m = match(load_acquire<S>(flag), expected);
      if ((it & 63) == 0 && m == Match::kNo) {
        if (watchdog_fired(wd)) return false;
        const uint64_t waited = gpu::timer_ticks() - t0;
        if (waited > wd.timeout_ticks) {
          record_timeout(wd, rank, peer, world, epoch, what, waited);
          return false;
        }
      }
    }
  }
  if (m == Match::kYes) return true;
  record_timeout(wd, rank, peer, world, epoch, WaitOn::kCallSite, 0);
  return false;
}

// Broadcast of thread 0's verdict to the whole workgroup.
__device__ __forceinline__ bool block_agree(bool thread0_ok) {
  __shared__ int ok;
  if (threadIdx.x == 0) ok = thread0_ok ? 1 : 0;
  __syncthreads();
  const bool result = ok != 0;
  __syncthreads();  // `ok` is reused by the next call
  return result;
}

__device__ __forceinline__ void trace_event(const TraceSink& t, TraceKind kind, uint64_t start, uint32_t arg0,
                                            uint32_t arg1) {
  if (t.events == nullptr || threadIdx.x != 0 || *static_cast<const volatile uint32_t*>(t.enabled) == 0) return;
  const uint32_t i = gpu::atomic_add_dev(t.count, 1u);
  if (i < t.capacity) t.events[i] = TraceEvent{start, gpu::timer_ticks(), blockIdx.x, static_cast<uint32_t>(kind), arg0, arg1};
}

// Row `local_row` (batch folded in: local_row = b * m + i) of shard `shard`
// in the gathered [batch, world * m, cols] layout: rows of each batch element
// are ordered by shard, as all_gather(axis=-2, tiled=True) orders them.
__device__ __forceinline__ int64_t gathered_row(int64_t local_row, int shard, int64_t m, int world) {
  // 32-bit division (a shard has < 2^32 rows): a 64-bit one is several times longer, and this
  // runs for every row a tile loads or stores.
  const uint32_t l = static_cast<uint32_t>(local_row);
  const uint32_t mm = static_cast<uint32_t>(m);
  const uint32_t b = l / mm;
  return (static_cast<int64_t>(b) * world + shard) * m + (l - b * mm);
}

struct GatherArgs {
  const char* x;   // [rows, row_bytes]: this rank's shard (rows = batch * m)
  char* gathered;  // [batch, world * m, row_bytes]
  int64_t m;
  GatherLayout layout;
  Peers peers;
  uint32_t epoch;  // the low bits of CallContext::epoch
  uint32_t site;   // this call site's number among those sharing the region (flag_value)
  bool slot_used;  // CallContext::slot_used: wait for the readers of this epoch's parity slot
  Watchdog wd;
  TraceSink trace;
};

// Copy chunk `chunk` of a [rows, row_bytes] shard from src into the gathered
// rows of `shard` (and into pub, when given). The chunk's 16-byte vectors are
// one flat index space over the workgroup, kUnroll loads in flight per thread
// before their stores: a peer's memory is microseconds away, and further
// while both GPUs' GEMMs load their memory systems, so the bytes in flight,
// not the instruction count, set the pull rate (64 KiB per 256-thread
// workgroup here; benchmarks/p2p measures the rate against it).
__device__ __forceinline__ void copy_chunk(const GatherArgs& g, const char* src, bool src_remote, int chunk,
                                           int shard, char* pub) {
  constexpr int kUnroll = 16;
  const GatherLayout& l = g.layout;
  const int rc = chunk / l.col_chunks;
  const int cc = chunk % l.col_chunks;
  const int64_t r0 = static_cast<int64_t>(rc) * l.chunk_rows;
  const int64_t c0 = static_cast<int64_t>(cc) * l.chunk_bytes;
  const int nrows = static_cast<int>((l.rows - r0) < l.chunk_rows ? (l.rows - r0) : l.chunk_rows);
  const int vecs = static_cast<int>(((l.row_bytes - c0) < l.chunk_bytes ? (l.row_bytes - c0) : l.chunk_bytes) / 16);
  const int items = nrows * vecs;
  const int step = static_cast<int>(blockDim.x);
  for (int i0 = static_cast<int>(threadIdx.x); i0 < items; i0 += kUnroll * step) {
    gpu::Vec16 val[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = i0 + u * step;
      if (i < items) {
        const int r = i / vecs;
        const char* s = src + (r0 + r) * l.row_bytes + c0 + static_cast<int64_t>(i - r * vecs) * 16;
        val[u] = src_remote ? gpu::load16_uncached(s) : gpu::load16(s);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = i0 + u * step;
      if (i < items) {
        const int r = i / vecs;
        const int64_t col = c0 + static_cast<int64_t>(i - r * vecs) * 16;
        gpu::store16(g.gathered + gathered_row(r0 + r, shard, g.m, l.world) * l.row_bytes + col, val[u]);
        if (pub != nullptr) gpu::store16(pub + (r0 + r) * l.row_bytes + col, val[u]);
      }
    }
  }
}

// Fetcher role. Publish: copy this rank's chunks into its public slot (and its
// own gathered rows) and release each with the epoch. Pull: for each peer in
// ring order from rank + 1 (so peers are read by one rank at a time), wait for
// each chunk, copy it into the gathered rows, release the local staged flag
// (for this GPU's GEMM workgroups) and the peer's done flag (so it may reuse
// the slot two epochs later). Returns false if the watchdog fired.
__device__ __forceinline__ bool gather_role(const GatherArgs& g, int worker, int workers) {
  const GatherLayout& l = g.layout;
  const Peers& p = g.peers;
  const int parity = static_cast<int>(g.epoch & 1u);
  char* mine = p.region(p.rank);
  char* my_slot = l.slot(mine, parity);
  const int chunks = l.chunks();

  for (int j = worker; j < chunks; j += workers) {
    const uint64_t t0 = gpu::timer_ticks();
    bool ok = true;
    if (threadIdx.x == 0 && g.slot_used) {
      // Readers of this slot two epochs ago; done already unless a peer lags.
      for (int q = 0; q < p.world && ok; ++q) {
        if (q == p.rank) continue;
        ok = spin_until<Scope::kSystem>(l.done_flag(mine, parity, q, j), flag_value(g.epoch - 2, 0), g.wd, p.rank, q,
                                        p.world, g.epoch, WaitOn::kReadersDone);
      }
    }
    if (!block_agree(ok)) return false;
    copy_chunk(g, g.x, /*src_remote=*/false, j, p.rank, my_slot);
    __syncthreads();
    if (threadIdx.x == 0) gpu::store_release_sys(l.pub_flag(mine, parity, j), flag_value(g.epoch, g.site));
    trace_event(g.trace, TraceKind::kPublish, t0, static_cast<uint32_t>(j), static_cast<uint32_t>(p.rank));
  }

  for (int i = 1; i < p.world; ++i) {
    const int s = (p.rank + i) % p.world;
    char* theirs = p.region(s);
    for (int j = worker; j < chunks; j += workers) {
      const uint64_t t0 = gpu::timer_ticks();
      bool ok = true;
      if (threadIdx.x == 0)
        ok = spin_until<Scope::kSystem>(l.pub_flag(theirs, parity, j), flag_value(g.epoch, g.site), g.wd, p.rank, s,
                                        p.world, g.epoch, WaitOn::kPublished);
      if (!block_agree(ok)) return false;
      copy_chunk(g, l.slot(theirs, parity), /*src_remote=*/true, j, s, nullptr);
      __syncthreads();
      if (threadIdx.x == 0) {
        gpu::store_release_dev(l.staged_flag(mine, s, j), flag_value(g.epoch, g.site));
        gpu::store_release_sys(l.done_flag(theirs, parity, p.rank, j), flag_value(g.epoch, g.site));
      }
      trace_event(g.trace, TraceKind::kFetch, t0, static_cast<uint32_t>(j), static_cast<uint32_t>(s));
    }
  }
  return true;
}

}  // namespace jo
