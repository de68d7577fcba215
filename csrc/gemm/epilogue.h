// Epilogues: what a workgroup does with a finished tile's accumulators. The
// gemm/ policy is StoreTile (y = acc + bias in T, written to caller-mapped
// rows); the kernels build theirs on it (matmul_rs: stage the partial tile,
// then release its ready flag), and a group of one's stream-K tail first runs
// its scheduler's fixup (gemm/tile_scheduler.h StreamKScheduler).
#pragma once

#include "platform/gpu.h"

namespace jo::gemm {

template <typename T, int kVec>
struct alignas(kVec * sizeof(T)) PackedT {
  T v[kVec];
};

// dst[i] = v[i] + bias[i], converted to T, in one kVec-wide store (4 bytes for
// a pair of 16-bit values).
template <typename T, int kVec>
__device__ __forceinline__ void store_vec(T* dst, const float* v, const float* bias) {
  PackedT<T, kVec> out;
#pragma unroll
  for (int i = 0; i < kVec; ++i) out.v[i] = gpu::from_float<T>(v[i] + bias[i]);
  *reinterpret_cast<PackedT<T, kVec>*>(dst) = out;
}

// y = acc (+ bias) in T for the tile at column n0 of mainloop ML. out_row(r)
// gives row r's output (T*, at column 0) or nullptr for rows past the matrix.
// A thread's columns are the same for all its rows (c_col), so their bounds
// and bias values are read once per tile, and each store is a predicated
// kCVec-wide write.
template <class ML>
struct StoreTile {
  using T = typename ML::Elem;
  using Atom = typename ML::Atom;

  template <class OutRowFn>
  static __device__ __forceinline__ void apply(const typename ML::Acc& acc, OutRowFn&& out_row, int n0, int N,
                                               const T* bias) {
    const int warp = static_cast<int>(threadIdx.x) / gpu::kWarpSize;
    const int lane = static_cast<int>(threadIdx.x) % gpu::kWarpSize;
    const int wm = warp % ML::WARPS_M;
    const int wn = warp / ML::WARPS_M;
    constexpr int kCVec = Atom::kCVec;
    const int col0 = n0 + wn * ML::WTN + Atom::c_col(lane);
    float bias_v[ML::NI][kCVec];
#pragma unroll
    for (int j = 0; j < ML::NI; ++j)
#pragma unroll
      for (int v = 0; v < kCVec; ++v)
        bias_v[j][v] = bias != nullptr && col0 + j * Atom::kN < N ? gpu::to_float(bias[col0 + j * Atom::kN + v]) : 0.f;
#pragma unroll
    for (int i = 0; i < ML::MI; ++i)
#pragma unroll
      for (int g = 0; g < Atom::kCGroups; ++g) {
        T* row = out_row(wm * ML::WTM + i * Atom::kM + Atom::c_row(lane, g));
#pragma unroll
        for (int j = 0; j < ML::NI; ++j) {
          const int col = col0 + j * Atom::kN;
          if (row != nullptr && col < N) store_vec<T, kCVec>(row + col, &acc.c[i][j].r[g * kCVec], bias_v[j]);
        }
      }
  }
};

}  // namespace jo::gemm
