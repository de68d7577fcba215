// The sm90 GEMM's mainloop: the producer (one thread: the chunk gate, then TMA
// loads into a kStages-deep ring of shared memory) and the consumers' wgmma
// loop over one tile, with the mbarrier protocol between them.
//
// Each ring slot s has two mbarriers in every CTA:
// - full[s] (count 1): the own producer's arrive.expect_tx of the slot's bytes
//   (x's tile and w's tile), completed by the TMA loads that land in this CTA,
//   its own and, in a cluster, the peer's multicast half;
// - empty[s] (count kSlotReaders x cluster size): each consumer warpgroup that
//   read the slot (both, cooperative; the slot's tile's one, ping-pong) of
//   each CTA of the cluster arrives on every CTA's empty[s] once its wgmmas
//   are done, since a producer's multicast writes the slot in both CTAs.
// Both CTAs of a cluster walk the same cluster tiles with the same K, so their
// slot and phase sequences agree. A CTA leaves only after its producer has
// seen its last kStages slots released (the producer tail): every arrival that
// targets its barriers, and every multicast into its ring (which its own
// consumers waited for), has landed by then.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "gemm/sm90/config.h"
#include "gemm/sm90/ptx.h"
#include "gemm/sm90/tile_scheduler.h"

namespace jo::gemm::sm90 {

struct RingPos {
  int stage = 0;
  uint32_t phase = 0;
  template <int kStages>
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
  // n slots on: a ping-pong consumer passes over the other one's tile.
  template <int kStages>
  __device__ __forceinline__ void skip(int n) {
    const int to = stage + n;
    stage = to % kStages;
    phase ^= (to / kStages) & 1;
  }
};

struct Ring {
  uint8_t* a;       // kStages x (BM, 128 B), 128-byte swizzle
  uint8_t* b;       // kStages x (BN, 128 B)
  uint64_t* full;   // [kStages]
  uint64_t* empty;  // [kStages]
};

// The chunk gate: waits until the flags of every chunk that rows [m0, m0 + rows)
// touch are released (flags[c] >= epoch, modulo 2^32: epochs are monotonic, so
// a later call's flags may land while this one runs). `ready` caches the
// chunks already seen released: a flag only grows within a launch. If the
// flags are not all released watchdog_ns (globaltimer time) after the gate
// first found one below the epoch, 1 + the chunk waited on goes to *error and
// the wait ends (the output is then invalid; the host reads the word); once the
// word is set, later gates stop waiting, so one missing peer costs one
// watchdog period, not one per chunk. The bound is on the whole gate of a
// tile, in elapsed time, because the consumers' waits for that tile's first
// slot are bounded by watchdog_ns + 1 s of elapsed time (gemm.h): a gate that
// outlasted them would have a missing flag reported as an mbarrier hang.
template <class Out>
__device__ __forceinline__ void wait_for_rows(const GemmParams<Out>& p, int m0, int rows, uint64_t& ready) {
  const int end = min(m0 + rows, p.M);
  if (m0 >= end) return;
  bool waited = false, timing = false;
  uint64_t start = 0;
  for (int c = m0 / p.chunk_rows; c <= (end - 1) / p.chunk_rows; ++c) {
    if ((ready >> c) & 1) continue;
    while (int32_t(load_acquire_sys(p.flags + c) - p.epoch) < 0) {
      const uint64_t now = globaltimer_ns();
      if (!timing) {
        timing = true;
        start = now;
      } else if (now - start >= p.watchdog_ns) {
        atomicCAS(p.error, 0u, 1u + c);
        break;
      }
      if (*reinterpret_cast<volatile uint32_t*>(p.error) != 0) break;
      __nanosleep(128);
    }
    ready |= uint64_t(1) << c;
    waited = true;
  }
  // The acquire ordered this thread's later reads after the chunk's data; the
  // proxy fence extends that to the TMA (async proxy) loads it issues.
  if (waited) fence_proxy_async_global();
}

// The producer thread. With clusters, before the first load of a cluster tile
// it waits for every chunk that either CTA's rows touch: a multicast load
// writes both CTAs' slots, so neither producer issues one before the rows of
// the whole cluster tile are released.
template <class C, class In, class Out>
__device__ __forceinline__ void produce(const CUtensorMap* map_a, const CUtensorMap* map_b, const GemmParams<Out>& p,
                                        const Ring& ring, int first_tile, int tile_step, uint32_t rank,
                                        uint64_t hang_ns) {
  using Sched = PersistentScheduler<C::BM, C::BN, C::kClusterM, C::kClusterN>;
  const Sched sched(p.M, p.N, p.own_chunk * p.chunk_rows, p.raster_group);
  const int k_tiles = (p.K + C::BK - 1) / C::BK;
  constexpr uint16_t kAllCtas = (1u << C::kClusterSize) - 1;
  tma_prefetch_descriptor(map_a);
  tma_prefetch_descriptor(map_b);
  uint64_t ready = 0;
  RingPos pos;
  for (int t = first_tile; t < sched.tiles(); t += tile_step) {
    const TileCoord ct = sched.cluster_tile(t);
    if (p.flags != nullptr) wait_for_rows(p, ct.m0, Sched::kRows, ready);
    const TileCoord tc = Sched::cta_tile(ct, rank);
    for (int k = 0; k < k_tiles; ++k) {
      mbar_wait(&ring.empty[pos.stage], pos.phase ^ 1, p.error, hang_ns, kHangProducerEmpty);
      uint64_t* full = &ring.full[pos.stage];
      uint8_t* sa = ring.a + pos.stage * C::kABytes;
      uint8_t* sb = ring.b + pos.stage * C::kBBytes;
      mbar_arrive_expect_tx(full, C::kABytes + C::kBBytes);
      if constexpr (C::kClusterN > 1)
        tma_load_2d_multicast(sa + rank * C::kAPartBytes, map_a, full, k * C::BK, tc.m0 + int(rank) * C::BM / 2,
                              kAllCtas);
      else
        tma_load_2d(sa, map_a, full, k * C::BK, tc.m0);
      if constexpr (C::kClusterM > 1)
        tma_load_2d_multicast(sb + rank * C::kBPartBytes, map_b, full, k * C::BK, tc.n0 + int(rank) * C::BN / 2,
                              kAllCtas);
      else
        tma_load_2d(sb, map_b, full, k * C::BK, tc.n0);
      pos.template advance<C::kStages>();
    }
  }
  if constexpr (C::kClusterSize > 1) {
    for (int s = 0; s < C::kStages; ++s) {
      mbar_wait(&ring.empty[pos.stage], pos.phase ^ 1, p.error, hang_ns, kHangProducerTail);
      pos.template advance<C::kStages>();
    }
  }
}

// A consumer warpgroup's release of a slot it has finished reading.
template <class C>
__device__ __forceinline__ void release(const Ring& ring, int stage) {
  const int t = threadIdx.x % 128;
  if constexpr (C::kClusterSize == 1) {
    if (t == 0) mbar_arrive(&ring.empty[stage]);
  } else {
    if (t < C::kClusterSize) mbar_arrive_cluster(&ring.empty[stage], t);  // thread t signals CTA t
  }
}

// One tile's mainloop for consumer warpgroup cw (cooperative: rows 64 cw to
// 64 cw + 63 of the tile; ping-pong: its own 64-row tile): acc = x_tile
// w_tile^T over all of K. kMmaDepth k-tiles of wgmmas stay in flight; a slot
// is released once the wgmmas that read it are done.
template <class C, class In>
__device__ __forceinline__ void mma_tile(float (&acc)[C::BN / 2], const Ring& ring, RingPos& pos, int k_tiles,
                                         int cw, uint32_t* error, uint64_t hang_ns) {
  RingPos rel = pos;  // the oldest slot not yet released
  for (int k = 0; k < k_tiles; ++k) {
    mbar_wait(&ring.full[pos.stage], pos.phase, error, hang_ns, kHangConsumerFull);
    const uint64_t da = smem_desc_k128b(ring.a + pos.stage * C::kABytes + (C::kPingpong ? 0 : cw * 64 * 128));
    const uint64_t db = smem_desc_k128b(ring.b + pos.stage * C::kBBytes);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < 4; ++s) InTraits<In>::template mma<C::BN>(acc, da + 2 * s, db + 2 * s, k > 0 || s > 0);
    wgmma_commit();
    wgmma_wait<C::kMmaDepth>();
    if (k >= C::kMmaDepth) {
      release<C>(ring, rel.stage);
      rel.template advance<C::kStages>();
    }
    pos.template advance<C::kStages>();
  }
  wgmma_wait<0>();
  for (int i = 0; i < min(k_tiles, C::kMmaDepth); ++i) {
    release<C>(ring, rel.stage);
    rel.template advance<C::kStages>();
  }
}

}  // namespace jo::gemm::sm90
