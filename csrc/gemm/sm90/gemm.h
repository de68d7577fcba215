// The sm90 (Hopper, sm_90a) persistent GEMM: y[M,N] = alpha * x[M,K] w[N,K]^T
// (+ bias[N]), both operands K-major, fp32 accumulation.
//
// One CTA per SM, 384 threads: warpgroup 0 is the producer (one thread issues
// TMA loads into a kStages-deep shared-memory ring, completing on mbarriers),
// warpgroups 1 and 2 are the consumers (rows 0-63 and 64-127 of the 128-row
// tile, wgmma from shared memory, then the epilogue straight from registers to
// global memory). setmaxnreg gives the consumers the producer's registers.
//
// The chunk gate: with p.flags set, x's rows come in chunks of p.chunk_rows,
// chunk c ready once flags[c] >= p.epoch (epochs are monotonic, so a later
// call's flags may land while this one runs). Before the first load of a tile
// the producer acquires the flags of every chunk the tile's rows touch; a flag
// that stays below the epoch for about p.watchdog_ns records 1 + its chunk in
// *p.error and the wait ends (the output is then invalid: the host reads
// *p.error after the launch), so no launch hangs on a peer that never comes.
// Flags must be written by copy engines (memcpy, memset), never by a kernel:
// one would starve behind this grid, which holds every SM.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <type_traits>

#include "gemm/sm90/ptx.h"
#include "gemm/sm90/tensor_map.h"
#include "gemm/sm90/tile_scheduler.h"
#include "gemm/sm90/wgmma.h"

namespace jo::gemm::sm90 {

template <class Out>
struct GemmParams {
  Out* y;                 // [M, N] row-major
  const Out* bias;        // [N] or nullptr
  float alpha;            // the product of the operands' tensor scales (1 for bf16)
  int M, N, K;
  const uint32_t* flags;  // [ceil(M / chunk_rows)] or nullptr: no gate
  uint32_t epoch;
  int chunk_rows;
  int own_chunk;          // the walk starts at this chunk's rows
  uint32_t* error;        // 0, or 1 + the chunk whose flag never came (needed with flags)
  uint32_t watchdog_ns;
};

// One k-tile is 128 bytes of K per row: the 128-byte swizzle's row, and four
// wgmma k-slices of 32 bytes.
template <class In>
struct InTraits;

template <>
struct InTraits<__nv_bfloat16> {
  static constexpr CUtensorMapDataType kMapType = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  template <int BN>
  __device__ static void mma(float (&d)[BN / 2], uint64_t a, uint64_t b, int scale_d) {
    if constexpr (BN == 256) wgmma_m64n256k16_bf16(d, a, b, scale_d);
    else wgmma_m64n128k16_bf16(d, a, b, scale_d);
  }
};

template <>
struct InTraits<__nv_fp8_e4m3> {
  static constexpr CUtensorMapDataType kMapType = CU_TENSOR_MAP_DATA_TYPE_UINT8;
  template <int BN>
  __device__ static void mma(float (&d)[BN / 2], uint64_t a, uint64_t b, int scale_d) {
    if constexpr (BN == 256) wgmma_m64n256k32_e4m3(d, a, b, scale_d);
    else wgmma_m64n128k32_e4m3(d, a, b, scale_d);
  }
};

template <class In, int BN_, int kStages_>
struct Config {
  static constexpr int BM = 128, BN = BN_, kStages = kStages_;
  static constexpr int BK = 128 / int(sizeof(In));
  static constexpr int kThreads = 384;
  static constexpr int kABytes = BM * 128, kBBytes = BN * 128;
  static constexpr int kSmemBytes = kStages * (kABytes + kBBytes) + 2 * kStages * 8 + 1024;  // + alignment slack
  static_assert(BN == 128 || BN == 256, "sm90 gemm: BN is 128 or 256");
  static_assert(kSmemBytes <= 232448, "sm90 gemm: the ring exceeds Hopper's 227 KB of shared memory per block");
};

template <class Out>
__device__ __forceinline__ Out to_out(float v) {
  if constexpr (std::is_same_v<Out, __nv_bfloat16>) return __float2bfloat16_rn(v);
  else if constexpr (std::is_same_v<Out, __half>) return __float2half_rn(v);
  else return v;
}

template <class Out>
__device__ __forceinline__ float bias_at(const GemmParams<Out>& p, int col) {
  return p.bias != nullptr && col < p.N ? static_cast<float>(p.bias[col]) : 0.f;
}

template <class Out>
__device__ __forceinline__ void store_pair(const GemmParams<Out>& p, int row, int col, float v0, float v1) {
  if (row >= p.M) return;
  Out* dst = p.y + int64_t(row) * p.N + col;
  if (col + 1 < p.N && (p.N & 1) == 0) {  // an even N keeps every pair aligned
    if constexpr (std::is_same_v<Out, float>) *reinterpret_cast<float2*>(dst) = make_float2(v0, v1);
    else if constexpr (std::is_same_v<Out, __nv_bfloat16>)
      *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(v0, v1);
    else *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(v0, v1);
  } else {
    if (col < p.N) dst[0] = to_out<Out>(v0);
    if (col + 1 < p.N) dst[1] = to_out<Out>(v1);
  }
}

// The producer's gate (see the file comment). `ready` caches the chunks already
// seen released: a flag only grows within a launch.
template <class Out>
__device__ void wait_for_rows(const GemmParams<Out>& p, int m0, int BM, uint64_t& ready) {
  const int last = (min(m0 + BM, p.M) - 1) / p.chunk_rows;
  bool waited = false;
  for (int c = m0 / p.chunk_rows; c <= last; ++c) {
    if ((ready >> c) & 1) continue;
    uint64_t slept = 0;
    while (int32_t(load_acquire_sys(p.flags + c) - p.epoch) < 0) {  // >= modulo 2^32
      if (slept >= p.watchdog_ns) {
        atomicCAS(p.error, 0u, 1u + c);
        break;
      }
      __nanosleep(128);
      slept += 128;
    }
    ready |= uint64_t(1) << c;
    waited = true;
  }
  if (waited) fence_proxy_async_global();
}

template <class In, class Out, int BN, int kStages>
__global__ __launch_bounds__(384, 1) void gemm_kernel(const __grid_constant__ CUtensorMap map_a,
                                                      const __grid_constant__ CUtensorMap map_b,
                                                      const GemmParams<Out> p) {
  using C = Config<In, BN, kStages>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* sa = smem;
  uint8_t* sb = smem + kStages * C::kABytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(sb + kStages * C::kBBytes);
  uint64_t* empty = full + kStages;
  constexpr int kConsumers = 2;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kConsumers);
    }
    mbar_init_fence();
  }
  __syncthreads();

  const PersistentScheduler<C::BM, BN> sched(p.M, p.N, p.own_chunk * p.chunk_rows);
  const int k_tiles = (p.K + C::BK - 1) / C::BK;
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    setmaxnreg_dec<40>();
    if (threadIdx.x != 0) return;
    tma_prefetch_descriptor(&map_a);
    tma_prefetch_descriptor(&map_b);
    uint64_t ready = 0;
    int stage = 0;
    uint32_t phase = 0;
    for (int t = blockIdx.x; t < sched.tiles(); t += gridDim.x) {
      const TileCoord tc = sched.coord(t);
      if (p.flags != nullptr) wait_for_rows(p, tc.m0, C::BM, ready);
      for (int k = 0; k < k_tiles; ++k) {
        mbar_wait(&empty[stage], phase ^ 1);
        mbar_arrive_expect_tx(&full[stage], C::kABytes + C::kBBytes);
        tma_load_2d(sa + stage * C::kABytes, &map_a, &full[stage], k * C::BK, tc.m0);
        tma_load_2d(sb + stage * C::kBBytes, &map_b, &full[stage], k * C::BK, tc.n0);
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1;
        }
      }
    }
    return;
  }

  setmaxnreg_inc<232>();
  const int cw = wg - 1;  // this warpgroup's 64 rows of the tile
  const bool signals = threadIdx.x % 128 == 0;
  const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  float acc[BN / 2];
  int stage = 0;
  uint32_t phase = 0;
  for (int t = blockIdx.x; t < sched.tiles(); t += gridDim.x) {
    const TileCoord tc = sched.coord(t);
    int prev = 0;
    for (int k = 0; k < k_tiles; ++k) {
      mbar_wait(&full[stage], phase);
      const uint64_t da = smem_desc_k128b(sa + stage * C::kABytes + cw * 64 * 128);
      const uint64_t db = smem_desc_k128b(sb + stage * C::kBBytes);
      wgmma_fence();
#pragma unroll
      for (int s = 0; s < 4; ++s) InTraits<In>::template mma<BN>(acc, da + 2 * s, db + 2 * s, k > 0 || s > 0);
      wgmma_commit();
      // One k-tile's wgmmas stay in flight; the one before has read its slot.
      wgmma_wait<1>();
      if (k > 0 && signals) mbar_arrive(&empty[prev]);
      prev = stage;
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
    wgmma_wait<0>();
    if (signals) mbar_arrive(&empty[prev]);

    // Accumulator fragment of wgmma m64nN: warp w holds rows 16w + lane/4 (+ 8),
    // columns 8j + 2 (lane % 4) (+ 1) in registers 4j (+ 1) and 4j + 2 (+ 1).
    const int row = tc.m0 + cw * 64 + warp * 16 + lane / 4;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      const int col = tc.n0 + 8 * j + 2 * (lane % 4);
      const float b0 = bias_at(p, col), b1 = bias_at(p, col + 1);
      store_pair(p, row, col, acc[4 * j] * p.alpha + b0, acc[4 * j + 1] * p.alpha + b1);
      store_pair(p, row + 8, col, acc[4 * j + 2] * p.alpha + b0, acc[4 * j + 3] * p.alpha + b1);
    }
  }
}

// Host launcher. x [M, K] and w [N, K] row-major (K contiguous). Returns 0, or
// -1 with the reason in `err`.
template <class In, class Out, int BN, int kStages>
struct Gemm {
  using C = Config<In, BN, kStages>;

  static int launch(const In* x, const In* w, const GemmParams<Out>& p, int grid, cudaStream_t stream, char* err,
                    size_t err_len) {
    if (p.M <= 0 || p.N <= 0 || p.K <= 0) {
      std::snprintf(err, err_len, "sm90 gemm: M, N, K must be positive, got %d, %d, %d", p.M, p.N, p.K);
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
    CUtensorMap map_a, map_b;
    if (make_tensor_map_k128b(&map_a, x, InTraits<In>::kMapType, sizeof(In), p.M, p.K, C::BM, err, err_len) ||
        make_tensor_map_k128b(&map_b, w, InTraits<In>::kMapType, sizeof(In), p.N, p.K, BN, err, err_len))
      return -1;
    static const cudaError_t configured = cudaFuncSetAttribute(
        gemm_kernel<In, Out, BN, kStages>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
    if (configured != cudaSuccess) {
      std::snprintf(err, err_len, "sm90 gemm: cannot raise shared memory to %d bytes: %s", C::kSmemBytes,
                    cudaGetErrorString(configured));
      return -1;
    }
    const int tiles = PersistentScheduler<C::BM, BN>(p.M, p.N, 0).tiles();
    gemm_kernel<In, Out, BN, kStages><<<grid < tiles ? grid : tiles, C::kThreads, C::kSmemBytes, stream>>>(
        map_a, map_b, p);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
      std::snprintf(err, err_len, "sm90 gemm: launch failed: %s", cudaGetErrorString(e));
      return -1;
    }
    return 0;
  }
};

}  // namespace jo::gemm::sm90
