// What one sm90 GEMM launch computes (GemmParams), the compile-time knobs of
// a kernel variant (Variant), and what they imply for the tile, the
// shared-memory ring and the epilogue's staging (Config).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "gemm/sm90/wgmma.h"

namespace jo::gemm::sm90 {

template <class Out>
struct GemmParams {
  Out* y = nullptr;                // [M, N] row-major
  const Out* bias = nullptr;       // [N] or nullptr
  float alpha = 1.f;               // y = alpha * x_scale * w_scale * (x w^T) + bias
  const float* x_scale = nullptr;  // device scalars (fp8 tensor scales), nullptr: 1
  const float* w_scale = nullptr;
  int M = 0, N = 0, K = 0;
  const uint32_t* flags = nullptr;  // [ceil(M / chunk_rows)] or nullptr: no gate
  uint32_t epoch = 0;
  int chunk_rows = 0;
  int own_chunk = 0;           // the walk starts at this chunk's rows
  uint32_t* error = nullptr;   // 0, or what went wrong (gemm.h); needed with flags
  uint32_t watchdog_ns = 0;    // how long the gate waits for one tile's flags (elapsed time)
  int raster_group = 8;        // cluster-tile rows walked together (tile_scheduler.h)
};

// How the consumers write the output tile.
enum class Epilogue {
  kDirect,    // from the accumulator registers straight to global memory
  kTmaStore,  // through shared memory, by TMA stores that run on while the next tile's mainloop starts
};

// How the two consumer warpgroups share the work.
enum class Schedule {
  kCooperative,  // both on one 128-row tile, 64 rows each; the epilogue between two mainloops
  kPingpong,     // each on its own 64-row tiles, alternately: one's epilogue runs under the other's mainloop
};

// A kernel variant. BN: the tile's columns (128, 224 or 256; the tile has 128
// rows, 64 with ping-pong). kStages: depth of the operand ring. kClusterM /
// kClusterN: 2 makes clusters of two CTAs whose tiles are neighbours along M
// (sharing w's tile, which each CTA loads half of and multicasts) or along N
// (sharing x's tile). kMmaDepth: k-tiles of wgmmas each consumer keeps in
// flight before it waits.
template <int BN_, int kStages_, int kClusterM_ = 1, int kClusterN_ = 1, Epilogue kEpilogue_ = Epilogue::kDirect,
          int kMmaDepth_ = 1, Schedule kSchedule_ = Schedule::kCooperative>
struct Variant {
  static constexpr int BN = BN_, kStages = kStages_, kClusterM = kClusterM_, kClusterN = kClusterN_;
  static constexpr Epilogue kEpilogue = kEpilogue_;
  static constexpr int kMmaDepth = kMmaDepth_;
  static constexpr Schedule kSchedule = kSchedule_;
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
    else if constexpr (BN == 224) wgmma_m64n224k16_bf16(d, a, b, scale_d);
    else wgmma_m64n128k16_bf16(d, a, b, scale_d);
  }
};

template <>
struct InTraits<__nv_fp8_e4m3> {
  static constexpr CUtensorMapDataType kMapType = CU_TENSOR_MAP_DATA_TYPE_UINT8;
  template <int BN>
  __device__ static void mma(float (&d)[BN / 2], uint64_t a, uint64_t b, int scale_d) {
    if constexpr (BN == 256) wgmma_m64n256k32_e4m3(d, a, b, scale_d);
    else if constexpr (BN == 224) wgmma_m64n224k32_e4m3(d, a, b, scale_d);
    else wgmma_m64n128k32_e4m3(d, a, b, scale_d);
  }
};

template <class Out>
struct OutTraits;
template <>
struct OutTraits<__nv_bfloat16> {
  static constexpr CUtensorMapDataType kMapType = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
};
template <>
struct OutTraits<__half> {
  static constexpr CUtensorMapDataType kMapType = CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
};
template <>
struct OutTraits<float> {
  static constexpr CUtensorMapDataType kMapType = CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
};

constexpr int kMaxSmemPerBlock = 232448;  // Hopper's 227 KB opt-in limit per block

template <class In, class Out, class V>
struct Config : V {
  using V::BN, V::kStages, V::kClusterM, V::kClusterN, V::kEpilogue, V::kMmaDepth, V::kSchedule;
  static constexpr bool kPingpong = kSchedule == Schedule::kPingpong;
  static constexpr int BM = kPingpong ? 64 : 128;  // a tile's rows
  static constexpr int BK = 128 / int(sizeof(In));
  static constexpr int kConsumers = 2;  // warpgroups, each 64 rows of a tile
  static constexpr int kSlotReaders = kPingpong ? 1 : kConsumers;  // consumer warpgroups that read one ring slot
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kClusterSize = kClusterM * kClusterN;
  static constexpr int kABytes = BM * 128, kBBytes = BN * 128;  // one k-tile: (BM, 128 B), (BN, 128 B)
  // The part of a shared tile each CTA of a cluster loads and multicasts.
  static constexpr int kAPartBytes = kABytes / kClusterN, kBPartBytes = kBBytes / kClusterM;
  static constexpr int kRingBytes = kStages * (kABytes + kBBytes);
  static constexpr int kBarrierBytes = 2 * kStages * 8;
  // The TMA-store epilogue stages a consumer's 64 rows in slices of 32 columns
  // (64 or 128 bytes a row, stored with that width's swizzle), as many slices
  // at once as the shared memory left by the ring holds (at most the tile's).
  static constexpr int kSliceCols = 32;
  static constexpr int kSliceBytes = 64 * kSliceCols * int(sizeof(Out));
  static constexpr int kSlices = BN / kSliceCols;
  static constexpr int kEpiFit = (kMaxSmemPerBlock - 1024 - kBarrierBytes - kRingBytes) / (kConsumers * kSliceBytes);
  static constexpr int kEpiBufs =
      kEpilogue == Epilogue::kTmaStore ? (kEpiFit < kSlices ? kEpiFit : kSlices) : 0;  // slices per consumer
  static constexpr int kEpiBytes = kConsumers * kEpiBufs * kSliceBytes;
  static constexpr int kSmemBytes = kRingBytes + kEpiBytes + kBarrierBytes + 1024;  // + alignment slack

  static_assert(BN == 128 || BN == 224 || BN == 256, "sm90 gemm: BN is 128, 224 or 256 (wgmma.h's shapes)");
  static_assert(kClusterM >= 1 && kClusterN >= 1 && kClusterSize <= 2,
                "sm90 gemm: clusters of one CTA, or two along M or N");
  // Each multicast part starts on a 1024-byte swizzle atom (8 rows of 128 B),
  // so the halves land where one box of the whole tile would have put them.
  static_assert(kAPartBytes % 1024 == 0 && kBPartBytes % 1024 == 0, "sm90 gemm: a multicast part is whole atoms");
  static_assert(kMmaDepth >= 1 && kMmaDepth < kStages, "sm90 gemm: wgmma depth 1 to kStages - 1");
  static_assert(kEpilogue != Epilogue::kTmaStore || kEpiBufs >= 1,
                "sm90 gemm: no shared memory left beside the ring for the TMA-store epilogue");
  static_assert(kSmemBytes <= kMaxSmemPerBlock, "sm90 gemm: ring and staging exceed Hopper's 227 KB per block");
};

}  // namespace jo::gemm::sm90
