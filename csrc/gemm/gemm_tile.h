// Output tiles of y = a_rows @ w (+ bias): the mainloop plus the epilogue.
// gemm_tile runs one tile on its own (the fused kernels' paths with peers);
// plain_gemm runs a persistent workgroup's share of a plain GEMM with its
// stage ring carried from tile to tile (world 1 and the engine benchmark).
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

// Tiles first, first + stride, ... of a PlainGemm in band order. Each tile's
// last STAGES - 1 k-iterations already copy the next tile's first k-tiles, so
// that tile starts without a prologue and this one's epilogue overlaps those
// copies. on_tile(t, start_ticks) runs after each tile (tracing).
template <class Eng, typename T, class OnTile>
__device__ __forceinline__ void plain_gemm(const PlainGemm<T>& g, T* smem, int first, int stride, OnTile&& on_tile) {
  const int row_tiles = static_cast<int>((g.rows + Eng::BM - 1) / Eng::BM);
  const int col_tiles = (g.n + Eng::BN - 1) / Eng::BN;
  const int tiles = row_tiles * col_tiles;
  const int64_t ldb = Eng::kBKMajor ? g.k : g.n;
  auto a_rows = [&](TileCoord tc) {
    const int64_t r0 = static_cast<int64_t>(tc.row) * Eng::BM;
    return Eng::a_rows([&](int r) -> const T* { return r0 + r < g.rows ? g.x + (r0 + r) * g.k : nullptr; });
  };
  auto b_source = [&](TileCoord tc) { return typename Eng::BSource{g.w, ldb, tc.col * Eng::BN, g.n}; };
  typename Eng::Ring ring;
  for (int t = first; t < tiles; t += stride) {
    const uint64_t t0 = gpu::timer_ticks();
    const TileCoord tc = tile_coord(t, row_tiles, col_tiles, g.group_cols);
    const int next = t + stride;
    // Recomputed per call (two per tile): holding the next tile's row
    // pointers through the k-loop would cost registers there.
    auto prefetch = [&](T* stage, int kt) {
      const TileCoord nc = tile_coord(next, row_tiles, col_tiles, g.group_cols);
      Eng::load_stage(stage, a_rows(nc), b_source(nc), kt * Eng::BK, g.k);
    };
    typename Eng::Acc acc;
    Eng::mainloop(acc, smem, a_rows(tc), b_source(tc), g.k, NoWait{}, ring, next < tiles, prefetch);
    const int64_t r0 = static_cast<int64_t>(tc.row) * Eng::BM;
    Eng::store(acc, [&](int r) -> T* { return r0 + r < g.rows ? g.y + (r0 + r) * g.n : nullptr; }, tc.col * Eng::BN,
               g.n, g.bias);
    on_tile(t, t0);
  }
}

}  // namespace jo::gemm
