// The sm90 GEMM's epilogues: y = alpha * acc + bias in the output dtype, for
// one consumer warpgroup's 64 rows of a tile, in one of two ways (Epilogue in
// config.h). Both take the accumulator fragment of wgmma m64nN: warp w of the
// warpgroup holds rows 16 w + lane / 4 (+ 8), columns 8 j + 2 (lane % 4) (+ 1)
// in registers 4 j (+ 1) and 4 j + 2 (+ 1).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "gemm/sm90/config.h"
#include "gemm/sm90/ptx.h"
#include "gemm/sm90/tile_scheduler.h"

namespace jo::gemm::sm90 {

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

// alpha times the operands' tensor scales, read once per consumer thread.
template <class Out>
__device__ __forceinline__ float scale_of(const GemmParams<Out>& p) {
  return p.alpha * (p.x_scale != nullptr ? *p.x_scale : 1.f) * (p.w_scale != nullptr ? *p.w_scale : 1.f);
}

// Straight from the registers: 4- or 8-byte stores of column pairs, each row
// its own segment; the mainloop waits for them.
template <class C, class Out>
struct DirectEpilogue {
  __device__ DirectEpilogue(uint8_t* /*staging*/, const CUtensorMap* /*map_y*/, int /*cw*/) {}

  __device__ static void store_pair(const GemmParams<Out>& p, int row, int col, float v0, float v1) {
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

  // m0: the warpgroup's first row; n0: the tile's first column.
  __device__ __forceinline__ void store(const float (&acc)[C::BN / 2], const GemmParams<Out>& p, float alpha, int m0,
                                        int n0) {
    const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    const int row = m0 + warp * 16 + lane / 4;
#pragma unroll
    for (int j = 0; j < C::BN / 8; ++j) {
      const int col = n0 + 8 * j + 2 * (lane % 4);
      const float b0 = bias_at(p, col), b1 = bias_at(p, col + 1);
      store_pair(p, row, col, acc[4 * j] * alpha + b0, acc[4 * j + 1] * alpha + b1);
      store_pair(p, row + 8, col, acc[4 * j + 2] * alpha + b0, acc[4 * j + 3] * alpha + b1);
    }
  }

  __device__ void finish() {}
};

// Through shared memory: the warpgroup writes its 64 rows in slices of 32
// columns into kEpiBufs staging buffers (row-major, 64 or 128 bytes a row,
// swizzled as the TMA store's tensor map says, so that a warp's writes hit 32
// distinct banks for bf16 and two-way for fp32), then one thread stores them
// with TMA and the warpgroup goes on: the stores drain while the next tile's
// mainloop runs. Before a buffer is rewritten, its last store must have read it
// (a wait that is free when the tile's slices all fit, kEpiBufs = kSlices). The
// TMA store drops the rows and columns past M and N.
template <class C, class Out>
struct TmaStoreEpilogue {
  static constexpr int kRowBytes = C::kSliceCols * int(sizeof(Out));  // 64 or 128
  static constexpr uint32_t kSwizzleMask = kRowBytes / 16 - 1;       // 16-byte chunks swizzled within a row
  uint8_t* bufs;  // this warpgroup's kEpiBufs slices
  const CUtensorMap* map_y;
  uint32_t bar_id;
  bool leader;

  __device__ TmaStoreEpilogue(uint8_t* staging, const CUtensorMap* map, int cw)
      : bufs(staging + cw * C::kEpiBufs * C::kSliceBytes),
        map_y(map),
        bar_id(1 + cw),
        leader(threadIdx.x % 128 == 0) {}

  // Byte offset of (row, byte) in a slice: 16-byte chunk c of row r sits at
  // chunk c ^ (r / (128 / kRowBytes)) % (kRowBytes / 16), the TMA swizzle of
  // that width (CUTLASS's Swizzle<2,4,3> / <3,4,3>).
  __device__ static uint32_t swizzled(int row, int byte) {
    const uint32_t o = uint32_t(row * kRowBytes + byte);
    return o ^ (((o >> 7) & kSwizzleMask) << 4);
  }

  __device__ static void put_pair(uint8_t* slice, int row, int col, float v0, float v1) {
    uint8_t* dst = slice + swizzled(row, col * int(sizeof(Out)));
    if constexpr (std::is_same_v<Out, float>) *reinterpret_cast<float2*>(dst) = make_float2(v0, v1);
    else if constexpr (std::is_same_v<Out, __nv_bfloat16>)
      *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(v0, v1);
    else *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(v0, v1);
  }

  __device__ __forceinline__ void store(const float (&acc)[C::BN / 2], const GemmParams<Out>& p, float alpha, int m0,
                                        int n0) {
    const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
    const int row = warp * 16 + lane / 4;
#pragma unroll
    for (int s0 = 0; s0 < C::kSlices; s0 += C::kEpiBufs) {
      if (leader) bulk_wait_group_read<0>();
      named_barrier_sync(bar_id, 128);
#pragma unroll
      for (int b = 0; b < C::kEpiBufs; ++b) {
        if (s0 + b >= C::kSlices) continue;  // the last round of a tile whose slices do not divide evenly
        uint8_t* slice = bufs + b * C::kSliceBytes;
#pragma unroll
        for (int jj = 0; jj < C::kSliceCols / 8; ++jj) {
          const int j = (s0 + b) * (C::kSliceCols / 8) + jj;  // the 8-column group of the tile
          const int col = 8 * jj + 2 * (lane % 4);
          const float b0 = bias_at(p, n0 + 8 * j + 2 * (lane % 4)), b1 = bias_at(p, n0 + 8 * j + 2 * (lane % 4) + 1);
          put_pair(slice, row, col, acc[4 * j] * alpha + b0, acc[4 * j + 1] * alpha + b1);
          put_pair(slice, row + 8, col, acc[4 * j + 2] * alpha + b0, acc[4 * j + 3] * alpha + b1);
        }
      }
      fence_proxy_async_shared();
      named_barrier_sync(bar_id, 128);
      if (leader) {
#pragma unroll
        for (int b = 0; b < C::kEpiBufs; ++b)
          if (s0 + b < C::kSlices) tma_store_2d(map_y, bufs + b * C::kSliceBytes, n0 + (s0 + b) * C::kSliceCols, m0);
        bulk_commit_group();
      }
    }
  }

  // The CTA's shared memory must outlive the stores' reads of it; waiting for
  // their completion also makes y whole before the kernel ends.
  __device__ void finish() {
    if (leader) bulk_wait_group_all();
  }
};

template <class C, class Out>
using EpilogueOf = std::conditional_t<C::kEpilogue == Epilogue::kTmaStore, TmaStoreEpilogue<C, Out>,
                                      DirectEpilogue<C, Out>>;

}  // namespace jo::gemm::sm90
