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

// plain_gemm's stream-K tail for workgroup `first` of `stride`: piece(t, kb,
// ke, acc) computes tile t over k-tiles [kb, ke), store(acc, coord) writes it.
template <class Eng, class Piece, class Store, class OnTile>
__device__ __forceinline__ void plain_gemm_tail(int first, int stride, int tiles, int k_tiles, const TailSplit& split,
                                                Piece&& piece, Store&& store, OnTile&& on_tile) {
  // This workgroup's range of the tail's k-tiles.
  const int64_t total = static_cast<int64_t>(tiles - split.dp_tiles) * k_tiles;
  int64_t a = total * first / stride;
  const int64_t end = total * (first + 1) / stride;
  constexpr int kVecs = Eng::MI * Eng::NI;  // 16-byte accumulator groups per thread
  while (a < end) {
    const uint64_t t0 = gpu::timer_ticks();
    const int t = split.dp_tiles + static_cast<int>(a / k_tiles);
    const int kb = static_cast<int>(a % k_tiles);
    const int ke = end - a < k_tiles - kb ? kb + static_cast<int>(end - a) : k_tiles;
    typename Eng::Acc acc;
    const TileCoord tc = piece(t, kb, ke, acc);
    if (kb > 0) {
      // The tile's tail (this range starts inside it): publish the partial in
      // this workgroup's slot, laid out so a warp's stores are contiguous.
      gpu::Vec16* slot = reinterpret_cast<gpu::Vec16*>(split.partials + int64_t(first) * Eng::BM * Eng::BN);
#pragma unroll
      for (int q = 0; q < kVecs; ++q) {
        gpu::Vec16 v;
        __builtin_memcpy(&v, acc.c[q / Eng::NI][q % Eng::NI].r, sizeof(v));
        gpu::store16(&slot[q * Eng::kThreads + threadIdx.x], v);
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence();
        gpu::store_release_dev(&split.flags[first], 1u);
      }
    } else {
      if (ke < k_tiles) {
        // The tile's head (this range ends inside it, the last piece this
        // workgroup runs): the next workgroup computed the tail first thing.
        // All workgroups are co-resident (persistent grid), so it arrives.
        const gpu::Vec16* slot =
            reinterpret_cast<const gpu::Vec16*>(split.partials + int64_t(first + 1) * Eng::BM * Eng::BN);
        if (threadIdx.x == 0)
          while (gpu::load_acquire_dev(&split.flags[first + 1]) == 0u) gpu::backoff();
        __syncthreads();
#pragma unroll
        for (int q = 0; q < kVecs; ++q) {
          const gpu::Vec16 v = gpu::load16_uncached(&slot[q * Eng::kThreads + threadIdx.x]);
          float tail[4];
          __builtin_memcpy(tail, &v, sizeof(tail));
          float* r = acc.c[q / Eng::NI][q % Eng::NI].r;
#pragma unroll
          for (int e = 0; e < 4; ++e) r[e] += tail[e];
        }
      }
      store(acc, tc);
    }
    on_tile(t, t0);
    a += ke - kb;
  }
}

// A persistent workgroup's share of a PlainGemm: tiles in band order, whole
// tiles first (t = first, first + stride, ... below split.dp_tiles), then its
// range of the stream-K tail (tile_order.h TailSplit). `first` is the
// workgroup's index and `stride` the grid: the tail's ranges and slots are per
// workgroup. on_tile(t, start_ticks) runs after each tile or piece (tracing).
// Each tile starts its pipeline afresh: carrying the stage ring from one tile
// into the next measured 5% slower on the H200 (benchmarks/results/NOTES.md).
template <class Eng, typename T, class OnTile>
__device__ __forceinline__ void plain_gemm(const PlainGemm<T>& g, T* smem, int first, int stride,
                                           const TailSplit& split, OnTile&& on_tile) {
  const int row_tiles = static_cast<int>((g.rows + Eng::BM - 1) / Eng::BM);
  const int col_tiles = (g.n + Eng::BN - 1) / Eng::BN;
  const int tiles = row_tiles * col_tiles;
  const int k_tiles = (g.k + Eng::BK - 1) / Eng::BK;
  const int64_t ldb = Eng::kBKMajor ? g.k : g.n;
  // Tile t over k-tiles [kb, ke): A and w from k-tile kb on, as a GEMM of
  // depth min(ke * BK, k) - kb * BK.
  auto piece = [&](int t, int kb, int ke, typename Eng::Acc& acc) {
    const TileCoord tc = tile_coord(t, row_tiles, col_tiles, g.group_cols);
    const int r0 = tc.row * Eng::BM;
    const int k0 = kb * Eng::BK;
    const int depth = (ke * Eng::BK < g.k ? ke * Eng::BK : g.k) - k0;
    const T* w = g.w + (Eng::kBKMajor ? k0 : static_cast<int64_t>(k0) * g.n);
    Eng::mainloop(
        acc, smem,
        Eng::a_rows([&](int r) -> const T* { return r0 + r < g.rows ? g.x + int64_t(r0 + r) * g.k + k0 : nullptr; }),
        typename Eng::BSource{w, ldb, tc.col * Eng::BN, g.n}, depth, NoWait{});
    return tc;
  };
  auto store = [&](const typename Eng::Acc& acc, TileCoord tc) {
    const int r0 = tc.row * Eng::BM;
    Eng::store(acc, [&](int r) -> T* { return r0 + r < g.rows ? g.y + int64_t(r0 + r) * g.n : nullptr; },
               tc.col * Eng::BN, g.n, g.bias);
  };
  for (int t = first; t < split.dp_tiles; t += stride) {
    const uint64_t t0 = gpu::timer_ticks();
    typename Eng::Acc acc;
    store(acc, piece(t, 0, k_tiles, acc));
    on_tile(t, t0);
  }
  if constexpr (kTailSplitCompiled) {
    if (split.dp_tiles < tiles) plain_gemm_tail<Eng>(first, stride, tiles, k_tiles, split, piece, store, on_tile);
  }
}

}  // namespace jo::gemm
