// Output tiles of y = a_rows @ w (+ bias): a mainloop (gemm/mainloop.h), a
// tile scheduler (gemm/tile_scheduler.h) and an epilogue (gemm/epilogue.h)
// put together. gemm_tile is one tile; plain_gemm is a persistent workgroup's
// share of a plain GEMM (the world-1 path of both fused kernels, and the
// engine benchmark).
#pragma once

#include "gemm/epilogue.h"
#include "gemm/mainloop.h"
#include "gemm/tile_order.h"
#include "gemm/tile_scheduler.h"

namespace jo::gemm {

// RowFn(tile_row) -> const T* (row start) or nullptr; OutRowFn(tile_row) ->
// T* (output row start) or nullptr for rows beyond the matrix.
template <class ML, typename T, class RowFn, class OutRowFn, class WaitA>
__device__ __forceinline__ void gemm_tile(T* smem, RowFn&& a_row, const typename ML::BSource& b, int K,
                                          OutRowFn&& out_row, const T* bias, WaitA&& wait_a) {
  typename ML::Acc acc;
  ML::run(acc, smem, ML::a_rows(a_row), b, K, wait_a);
  StoreTile<ML>::apply(acc, out_row, b.n0, b.N, bias);
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

// plain_gemm over interior tiles with the pipeline across units: each unit's
// first k-tiles are copied (fill) before the previous unit's epilogue, whose
// stores then overlap the copies' latency instead of preceding it.
template <class ML, class Scheduler, class Coord, class ARowsAt, class BSourceAt, class Store, class OnTile,
          class OnStall>
__device__ __forceinline__ void pipelined_units(Scheduler& sched, typename ML::Elem* smem, Coord&& coord,
                                                ARowsAt&& a_rows, BSourceAt&& b_source, Store&& store,
                                                OnTile&& on_tile, OnStall&& on_stall) {
  // The epilogue of unit u: the scheduler's fixup, then the store if the
  // unit finished its tile.
  auto finish = [&](typename ML::Acc& acc, const TileRange& u, uint64_t t0) {
    if (!sched.fixup(acc, u, on_stall)) {  // a published tail piece
      on_tile(u.tile, t0);
      return;
    }
    store(acc, coord(u.tile));
    on_tile(u.tile, t0);
  };

  TileRange u, prev;
  bool have = sched.next(u);
  bool pending = false;  // acc holds prev's sums, not yet finished
  uint64_t prev_t0 = 0;
  typename ML::Acc acc;
  while (have || pending) {
    const uint64_t t0 = gpu::timer_ticks();
    typename ML::FastLoader loader{};
    if (have) {
      const TileCoord tc = coord(u.tile);
      const int k0 = u.kb * ML::BK;
      loader.c = ML::fast_cursor(a_rows(tc, k0), b_source(tc, k0));
      ML::fill(smem, loader, u.ke - u.kb, NoWait{});
    }
    if (pending) finish(acc, prev, prev_t0);
    pending = false;
    if (have) {
      ML::zero(acc);
      ML::compute(acc, smem, loader, u.ke - u.kb, NoWait{});
      prev = u;
      prev_t0 = t0;
      pending = true;
      have = sched.next(u);
    }
  }
}

// A persistent workgroup's share of a PlainGemm: tiles in band order.
// `first` is the workgroup's index and `stride` the grid; on_tile(t,
// start_ticks) runs after each tile or piece (tracing); on_stall(waited_ticks)
// when a stream-K head waited past the split's timeout (StreamKScheduler).
//
// When every tile is interior (rows, n and k whole tiles) and the tile
// pipelines its fragments (ML::kCrossTilePipeline), the tiles take the fast
// loader, the stream-K tail (StreamKScheduler) when the launch has one, and
// the pipeline across units (pipelined_units), which overlaps only the fill
// with the previous epilogue: carrying the whole stage ring into the next tile
// ran 5% slower (docs/performance.md). Other GEMMs run whole tiles, one after
// the other (BandScheduler).
template <class ML, typename T, class OnTile, class OnStall>
__device__ __forceinline__ void plain_gemm(const PlainGemm<T>& g, T* smem, int first, int stride,
                                           const TailSplit& split, OnTile&& on_tile, OnStall&& on_stall) {
  const int row_tiles = static_cast<int>((g.rows + ML::BM - 1) / ML::BM);
  const int col_tiles = (g.n + ML::BN - 1) / ML::BN;
  const int k_tiles = (g.k + ML::BK - 1) / ML::BK;
  const int64_t ldb = ML::kBKMajor ? g.k : g.n;
  auto coord = [&](int t) { return tile_coord(t, row_tiles, col_tiles, g.group_cols); };
  // Tile tc's operands from k = k0 on.
  auto a_rows = [&](TileCoord tc, int k0) {
    const int64_t r0 = static_cast<int64_t>(tc.row) * ML::BM;
    return ML::a_rows([&](int r) -> const T* { return r0 + r < g.rows ? g.x + (r0 + r) * g.k + k0 : nullptr; });
  };
  auto b_source = [&](TileCoord tc, int k0) {
    return typename ML::BSource{g.w + (ML::kBKMajor ? k0 : static_cast<int64_t>(k0) * g.n), ldb, tc.col * ML::BN,
                                g.n};
  };
  auto store = [&](const typename ML::Acc& acc, TileCoord tc) {
    const int64_t r0 = static_cast<int64_t>(tc.row) * ML::BM;
    StoreTile<ML>::apply(acc, [&](int r) -> T* { return r0 + r < g.rows ? g.y + (r0 + r) * g.n : nullptr; },
                         tc.col * ML::BN, g.n, g.bias);
  };

  if constexpr (ML::kCrossTilePipeline) {
    if (ML::interior_gemm(g.rows, g.n, g.k, ldb)) {
      StreamKScheduler<ML> sched(split, first, stride, row_tiles * col_tiles, k_tiles);
      pipelined_units<ML>(sched, smem, coord, a_rows, b_source, store, on_tile, on_stall);
      return;
    }
  }
  BandScheduler sched = BandScheduler::starting_at(first, stride, row_tiles * col_tiles);
  for (int t; sched.next(t);) {
    const uint64_t t0 = gpu::timer_ticks();
    const TileCoord tc = coord(t);
    typename ML::Acc acc;
    ML::run(acc, smem, a_rows(tc, 0), b_source(tc, 0), g.k, NoWait{});
    store(acc, tc);
    on_tile(t, t0);
  }
}

}  // namespace jo::gemm
