// Output tiles of y = a_rows @ w (+ bias): the mainloop plus the epilogue.
// gemm_tile is one tile; plain_gemm a persistent workgroup's share of a plain
// GEMM (the world-1 path of both fused kernels, and the engine benchmark).
#pragma once

#include "gemm/tile_engine.h"
#include "gemm/tile_order.h"

namespace jo::gemm {

// RowFn(tile_row) -> const T* (row start) or nullptr; OutRowFn(tile_row) ->
// T* (output row start) or nullptr for rows beyond the matrix.
template <class Eng, typename T, class RowFn, class OutRowFn, class WaitA>
__device__ __forceinline__ void gemm_tile(T* smem, RowFn&& a_row, const typename Eng::BSource& b, int K,
                                          OutRowFn&& out_row, const T* bias, WaitA&& wait_a) {
  typename Eng::Acc acc;
  Eng::mainloop(acc, smem, Eng::a_rows(a_row), b, K, wait_a);
  Eng::store(acc, out_row, b.n0, b.N, bias);
}

// y[rows, n] = x[rows, k] @ w (+ bias), row-major, w [k, n] or (kKMajor) [n, k].
template <typename T>
struct PlainGemm {
  const T* x;
  const T* w;
  const T* bias;  // [n] or nullptr
  T* y;
  int64_t rows;
  int n;
  int k;
  int group_cols;  // tile columns per band (tile_order.h)
};

// Tiles first, first + stride, ... of a PlainGemm in band order;
// on_tile(t, start_ticks) runs after each (tracing). Carrying the stage ring
// from one tile into the next (the next tile's first k-tiles copied during
// this one's last) measured 5% slower on the H200 (benchmarks/results/NOTES.md):
// each tile starts its pipeline afresh.
template <class Eng, typename T, class OnTile>
__device__ __forceinline__ void plain_gemm(const PlainGemm<T>& g, T* smem, int first, int stride, OnTile&& on_tile) {
  const int row_tiles = static_cast<int>((g.rows + Eng::BM - 1) / Eng::BM);
  const int col_tiles = (g.n + Eng::BN - 1) / Eng::BN;
  const int64_t ldb = Eng::kBKMajor ? g.k : g.n;
  for (int t = first; t < row_tiles * col_tiles; t += stride) {
    const uint64_t t0 = gpu::timer_ticks();
    const TileCoord tc = tile_coord(t, row_tiles, col_tiles, g.group_cols);
    const int r0 = tc.row * Eng::BM;
    gemm_tile<Eng>(
        smem, [&](int r) -> const T* { return r0 + r < g.rows ? g.x + int64_t(r0 + r) * g.k : nullptr; },
        typename Eng::BSource{g.w, ldb, tc.col * Eng::BN, g.n}, g.k,
        [&](int r) -> T* { return r0 + r < g.rows ? g.y + int64_t(r0 + r) * g.n : nullptr; }, g.bias, NoWait{});
    on_tile(t, t0);
  }
}

}  // namespace jo::gemm
