// The sm90 (Hopper, sm_90a) persistent GEMM: y[M,N] = alpha x_scale w_scale
// x[M,K] w[N,K]^T (+ bias[N]), both operands K-major, fp32 accumulation;
// bf16 or fp8 e4m3 operands, bf16 / fp16 / fp32 out.
//
// One CTA per SM, 384 threads: warpgroup 0 is the producer (one thread issues
// TMA loads into a kStages-deep shared-memory ring, completing on mbarriers:
// mainloop.h), warpgroups 1 and 2 are the consumers (wgmma from shared memory,
// then the epilogue: epilogue.h): cooperative, rows 0-63 and 64-127 of one
// 128-row tile; ping-pong, 64-row tiles taken in turn (the CTA's tiles 0, 2, ...
// and 1, 3, ...), each consumer skipping the other's slots of the ring.
// setmaxnreg gives the consumers the producer's registers. Tiles come from the
// persistent walk of tile_scheduler.h. The knobs of a variant (tile width, ring
// depth, clusters of two with TMA multicast, epilogue, wgmma depth) are
// config.h's Variant; the benchmark compares them side by side.
//
// The chunk gate: with p.flags set, x's rows come in chunks of p.chunk_rows,
// chunk c ready once flags[c] >= p.epoch. Before the first load of a (cluster)
// tile the producer acquires the flags of every chunk the tile's rows touch
// (mainloop.h); flags not all released p.watchdog_ns after the tile's gate began
// waiting record 1 + a missing chunk in *p.error and the wait ends (the output is then
// invalid: the host reads *p.error after the launch), so no launch hangs on a
// peer that never comes. Flags must be written by copy engines (memcpy,
// memset), never by a kernel: one would starve behind this grid, which holds
// every SM.
//
// The error word after a launch: 0; or 1 + the chunk whose flag never came;
// or kErrorBarrierHang | HangSite (ptx.h) where an mbarrier wait outlasted
// p.watchdog_ns (with flags) + 1 s, a protocol bug: the grid then drains
// instead of hanging, its output garbage. Without an error word such a wait
// traps.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

#include "gemm/sm90/config.h"
#include "gemm/sm90/epilogue.h"
#include "gemm/sm90/mainloop.h"
#include "gemm/sm90/ptx.h"
#include "gemm/sm90/tensor_map.h"
#include "gemm/sm90/tile_scheduler.h"

namespace jo::gemm::sm90 {

// map_y is read only by the TMA-store epilogue.
template <class In, class Out, class V>
__global__ __launch_bounds__(384, 1) void gemm_kernel(const __grid_constant__ CUtensorMap map_a,
                                                      const __grid_constant__ CUtensorMap map_b,
                                                      const __grid_constant__ CUtensorMap map_y,
                                                      const GemmParams<Out> p) {
  using C = Config<In, Out, V>;
  using Sched = PersistentScheduler<C::BM, C::BN, C::kClusterM, C::kClusterN>;
  extern __shared__ uint8_t smem_raw[];
  // The ring, then the epilogue's staging, then the barriers; every tile and
  // slice on a 1024-byte boundary (the 128-byte swizzle's atom).
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + C::kRingBytes + C::kEpiBytes);
  const Ring ring{smem, smem + C::kStages * C::kABytes, bars, bars + C::kStages};
  if (threadIdx.x == 0) {
    for (int s = 0; s < C::kStages; ++s) {
      mbar_init(&ring.full[s], 1);
      mbar_init(&ring.empty[s], C::kSlotReaders * C::kClusterSize);
    }
    mbar_init_fence();
  }
  // The peer's barriers must be initialized before this CTA's first arrival
  // on them or multicast into its ring.
  if constexpr (C::kClusterSize > 1) cluster_sync();
  else __syncthreads();

  const uint32_t rank = C::kClusterSize > 1 ? cluster_ctarank() : 0;
  const int first_tile = blockIdx.x / C::kClusterSize, tile_step = gridDim.x / C::kClusterSize;
  const uint64_t hang_ns = (p.flags != nullptr ? uint64_t(p.watchdog_ns) : 0) + 1000000000ull;
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<40>();
    if (threadIdx.x == 0) produce<C, In>(&map_a, &map_b, p, ring, first_tile, tile_step, rank, hang_ns);
    return;
  }

  setmaxnreg_inc<232>();
  const int cw = wg - 1;  // this consumer warpgroup
  const Sched sched(p.M, p.N, p.own_chunk * p.chunk_rows, p.raster_group);
  const int k_tiles = (p.K + C::BK - 1) / C::BK;
  const float alpha = scale_of(p);
  EpilogueOf<C, Out> epi(smem + C::kRingBytes, &map_y, cw);
  float acc[C::BN / 2];
  RingPos pos;
  // Ping-pong: this warpgroup takes every other tile of the CTA's walk, and its
  // ring position passes over the other's k_tiles slots. The mainloops take
  // turns (named barrier 3 + w: warpgroup w may start its next one), which
  // also keeps the mbarrier phases exact: a consumer that skipped the other's
  // slots waits on a slot only after the other has consumed its previous use,
  // so it is never two phases ahead of a barrier (its parity would alias).
  constexpr int kTurns = C::kPingpong ? 2 : 1;
  const int turn = C::kPingpong ? cw : 0;
  if (turn > 0) pos.template skip<C::kStages>(k_tiles);
  bool first = true;
  for (int t = first_tile + turn * tile_step; t < sched.tiles(); t += kTurns * tile_step) {
    const TileCoord tc = Sched::cta_tile(sched.cluster_tile(t), rank);
    if constexpr (C::kPingpong) {
      if (cw == 1 || !first) named_barrier_sync(3 + cw, 256);
    }
    mma_tile<C, In>(acc, ring, pos, k_tiles, cw, p.error, hang_ns);
    if constexpr (C::kPingpong) {
      named_barrier_arrive(3 + (1 - cw), 256);
      pos.template skip<C::kStages>(k_tiles);
    }
    epi.store(acc, p, alpha, tc.m0 + (C::kPingpong ? 0 : cw * 64), tc.n0);
    first = false;
  }
  epi.finish();
}

// Host launcher. x [M, K] and w [N, K] row-major (K contiguous). `max_ctas`
// caps the persistent grid (the SM count); with clusters the grid is also
// capped at the clusters that fit at once, so that none waits for a second
// wave. Returns 0, or -1 with the reason in `err`.
template <class In, class Out, class V>
struct Gemm {
  using C = Config<In, Out, V>;
  using Sched = PersistentScheduler<C::BM, C::BN, C::kClusterM, C::kClusterN>;

  static int check(const GemmParams<Out>& p, char* err, size_t err_len) {
    if (p.M <= 0 || p.N <= 0 || p.K <= 0) {
      std::snprintf(err, err_len, "sm90 gemm: M, N, K must be positive, got %d, %d, %d", p.M, p.N, p.K);
      return -1;
    }
    if (p.raster_group <= 0) {
      std::snprintf(err, err_len, "sm90 gemm: raster_group must be positive, got %d", p.raster_group);
      return -1;
    }
    if (p.flags != nullptr) {
      const int chunks = p.chunk_rows > 0 ? (p.M + p.chunk_rows - 1) / p.chunk_rows : 0;
      if (p.chunk_rows <= 0 || chunks > 64 || p.own_chunk < 0 || p.own_chunk >= chunks || p.error == nullptr) {
        std::snprintf(err, err_len,
                      "sm90 gemm: the chunk gate needs chunk_rows > 0 with 1 to 64 chunks of the %d rows, "
                      "own_chunk among them and an error word; got chunk_rows %d, own_chunk %d, error %p",
                      p.M, p.chunk_rows, p.own_chunk, static_cast<void*>(p.error));
        return -1;
      }
    } else if (p.own_chunk != 0 || p.chunk_rows <= 0) {
      std::snprintf(err, err_len,
                    "sm90 gemm: without flags chunk_rows must be positive and own_chunk 0 (the walk's start), "
                    "got chunk_rows %d, own_chunk %d",
                    p.chunk_rows, p.own_chunk);
      return -1;
    }
    return 0;
  }

  // The most clusters of this variant that are resident at once (0 on error).
  static int max_active_clusters(int max_ctas) {
    cudaLaunchConfig_t cfg{};
    cudaLaunchAttribute attr[1];
    cfg.gridDim = dim3(max_ctas / C::kClusterSize * C::kClusterSize);
    cfg.blockDim = dim3(C::kThreads);
    cfg.dynamicSmemBytes = C::kSmemBytes;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = C::kClusterSize;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, gemm_kernel<In, Out, V>, &cfg) != cudaSuccess) return 0;
    return clusters;
  }

  static int launch(const In* x, const In* w, const GemmParams<Out>& p, int max_ctas, cudaStream_t stream, char* err,
                    size_t err_len) {
    if (check(p, err, err_len)) return -1;
    CUtensorMap map_a, map_b, map_y;
    std::memset(&map_y, 0, sizeof(map_y));
    if (make_tensor_map_2d(&map_a, x, InTraits<In>::kMapType, sizeof(In), p.M, p.K, C::BM / C::kClusterN, 128, "x",
                           err, err_len) ||
        make_tensor_map_2d(&map_b, w, InTraits<In>::kMapType, sizeof(In), p.N, p.K, C::BN / C::kClusterM, 128, "w",
                           err, err_len))
      return -1;
    if constexpr (C::kEpilogue == Epilogue::kTmaStore) {
      if (make_tensor_map_2d(&map_y, p.y, OutTraits<Out>::kMapType, sizeof(Out), p.M, p.N, 64,
                             C::kSliceCols * int(sizeof(Out)), "y (the TMA-store epilogue; the direct one takes any N)",
                             err, err_len))
        return -1;
    }
    static const cudaError_t configured = cudaFuncSetAttribute(
        gemm_kernel<In, Out, V>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
    if (configured != cudaSuccess) {
      std::snprintf(err, err_len, "sm90 gemm: cannot raise shared memory to %d bytes: %s", C::kSmemBytes,
                    cudaGetErrorString(configured));
      return -1;
    }
    int clusters = max_ctas / C::kClusterSize;
    if constexpr (C::kClusterSize > 1) {
      static const int resident = max_active_clusters(max_ctas);
      if (resident <= 0) {
        std::snprintf(err, err_len, "sm90 gemm: no cluster of %d CTAs with %d bytes of shared memory fits",
                      C::kClusterSize, C::kSmemBytes);
        return -1;
      }
      clusters = clusters < resident ? clusters : resident;
    }
    const int tiles = Sched(p.M, p.N, 0, p.raster_group).tiles();
    clusters = clusters < tiles ? clusters : tiles;
    cudaLaunchConfig_t cfg{};
    cudaLaunchAttribute attr[1];
    cfg.gridDim = dim3(clusters * C::kClusterSize);
    cfg.blockDim = dim3(C::kThreads);
    cfg.dynamicSmemBytes = C::kSmemBytes;
    cfg.stream = stream;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = C::kClusterSize;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = C::kClusterSize > 1 ? 1 : 0;
    const cudaError_t e = cudaLaunchKernelEx(&cfg, gemm_kernel<In, Out, V>, map_a, map_b, map_y, p);
    if (e != cudaSuccess) {
      std::snprintf(err, err_len, "sm90 gemm: launch failed: %s", cudaGetErrorString(e));
      return -1;
    }
    return 0;
  }
};

}  // namespace jo::gemm::sm90
