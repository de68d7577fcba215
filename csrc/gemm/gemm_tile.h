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

// A unit of a workgroup's share of a PlainGemm: output tile `tile` over
// k-tiles [kb, ke). Whole tiles have kb == 0 and ke == the k-tile count.
struct TileRange {
  int tile;
  int kb;
  int ke;
};

// plain_gemm over interior tiles: whole tiles first (first, first + stride,
// ... below split.dp_tiles), then this workgroup's range of the stream-K tail;
// one unit's copies start before the previous unit's epilogue.
template <class Eng, class Coord, class ARowsAt, class BSourceAt, class Store, class OnTile>
__device__ __forceinline__ void plain_gemm_interior(int first, int stride, int tiles, int k_tiles,
                                                    const TailSplit& split, typename Eng::Elem* smem, Coord&& coord,
                                                    ARowsAt&& a_rows, BSourceAt&& b_source, Store&& store,
                                                    OnTile&& on_tile) {
  // This workgroup's range [sk, sk_end) of the tail's k-tiles (empty without a tail).
  const int64_t tail_k_tiles = static_cast<int64_t>(tiles - split.dp_tiles) * k_tiles;
  int64_t sk = tail_k_tiles * first / stride;
  const int64_t sk_end = tail_k_tiles * (first + 1) / stride;
  int whole = first;
  auto next = [&](TileRange& u) {
    if (whole < split.dp_tiles) {
      u = TileRange{whole, 0, k_tiles};
      whole += stride;
      return true;
    }
    if (!kTailSplitCompiled || sk >= sk_end) return false;
    const int kb = static_cast<int>(sk % k_tiles);
    u = TileRange{split.dp_tiles + static_cast<int>(sk / k_tiles), kb,
                  sk_end - sk < k_tiles - kb ? kb + static_cast<int>(sk_end - sk) : k_tiles};
    sk += u.ke - u.kb;
    return true;
  };

  // The epilogue of unit u: store the tile, or publish the partial sums of
  // its tail, or add the tail's published sums to its head and store.
  constexpr int kVecs = Eng::MI * Eng::NI;  // 16-byte accumulator groups per thread
  auto finish = [&](typename Eng::Acc& acc, const TileRange& u, uint64_t t0) {
    if constexpr (kTailSplitCompiled) {
      if (u.kb > 0) {
        // Slot `first`, laid out so that a warp's stores are contiguous.
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
          gpu::store_release_dev(&split.flags[first], kPartialReady);
        }
        on_tile(u.tile, t0);
        return;
      }
      if (u.ke < k_tiles) {
        // The head, this workgroup's last unit: workgroup first + 1 computed
        // the tail as its first. Nothing else reads the flag, and the next
        // launch starts after this one ends: it is cleared as soon as seen.
        if (threadIdx.x == 0) {
          const uint64_t w0 = gpu::timer_ticks();
          while (gpu::load_acquire_dev(&split.flags[first + 1]) != kPartialReady) {
            if (gpu::timer_ticks() - w0 > split.timeout_ticks) gpu::trap();
            gpu::backoff();
          }
          split.flags[first + 1] = 0;
        }
        __syncthreads();
        const gpu::Vec16* slot =
            reinterpret_cast<const gpu::Vec16*>(split.partials + int64_t(first + 1) * Eng::BM * Eng::BN);
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
    }
    store(acc, coord(u.tile));
    on_tile(u.tile, t0);
  };

  TileRange u, prev;
  bool have = next(u);
  bool pending = false;  // acc holds prev's sums, not yet finished
  uint64_t prev_t0 = 0;
  typename Eng::Acc acc;
  while (have || pending) {
    const uint64_t t0 = gpu::timer_ticks();
    typename Eng::FastLoader loader{};
    if (have) {
      const TileCoord tc = coord(u.tile);
      const int k0 = u.kb * Eng::BK;
      loader.c = Eng::fast_cursor(a_rows(tc, k0), b_source(tc, k0));
      Eng::fill(smem, loader, u.ke - u.kb, NoWait{});
    }
    if (pending) finish(acc, prev, prev_t0);
    pending = false;
    if (have) {
      Eng::zero(acc);
      Eng::compute(acc, smem, loader, u.ke - u.kb, NoWait{});
      prev = u;
      prev_t0 = t0;
      pending = true;
      have = next(u);
    }
  }
}

// A persistent workgroup's share of a PlainGemm: tiles in band order.
// `first` is the workgroup's index and `stride` the grid; on_tile(t,
// start_ticks) runs after each tile or piece (tracing).
//
// When every tile is interior (rows, n and k whole tiles) and the tile
// pipelines its fragments, the tiles take the fast loader, the stream-K tail
// (tile_order.h TailSplit) when the launch has one, and a pipeline that runs
// across units: each unit's first k-tiles are copied before the previous
// unit's epilogue, whose stores then overlap the copies' latency instead of
// preceding it. (Carrying the whole stage ring from one tile into the next,
// copies issued in the previous tile's last k-iterations, measured 5% slower
// on the H200: benchmarks/results/NOTES.md.) Other GEMMs run whole tiles, one
// after the other.
template <class Eng, typename T, class OnTile>
__device__ __forceinline__ void plain_gemm(const PlainGemm<T>& g, T* smem, int first, int stride,
                                           const TailSplit& split, OnTile&& on_tile) {
  const int row_tiles = static_cast<int>((g.rows + Eng::BM - 1) / Eng::BM);
  const int col_tiles = (g.n + Eng::BN - 1) / Eng::BN;
  const int k_tiles = (g.k + Eng::BK - 1) / Eng::BK;
  const int64_t ldb = Eng::kBKMajor ? g.k : g.n;
  auto coord = [&](int t) { return tile_coord(t, row_tiles, col_tiles, g.group_cols); };
  // Tile tc's operands from k = k0 on.
  auto a_rows = [&](TileCoord tc, int k0) {
    const int64_t r0 = static_cast<int64_t>(tc.row) * Eng::BM;
    return Eng::a_rows([&](int r) -> const T* { return r0 + r < g.rows ? g.x + (r0 + r) * g.k + k0 : nullptr; });
  };
  auto b_source = [&](TileCoord tc, int k0) {
    return typename Eng::BSource{g.w + (Eng::kBKMajor ? k0 : static_cast<int64_t>(k0) * g.n), ldb, tc.col * Eng::BN,
                                 g.n};
  };
  auto store = [&](const typename Eng::Acc& acc, TileCoord tc) {
    const int64_t r0 = static_cast<int64_t>(tc.row) * Eng::BM;
    Eng::store(acc, [&](int r) -> T* { return r0 + r < g.rows ? g.y + (r0 + r) * g.n : nullptr; },
               tc.col * Eng::BN, g.n, g.bias);
  };

  if constexpr (Eng::kCrossTilePipeline) {
    if (Eng::interior_gemm(g.rows, g.n, g.k, ldb)) {
      plain_gemm_interior<Eng>(first, stride, row_tiles * col_tiles, k_tiles, split, smem, coord, a_rows, b_source,
                               store, on_tile);
      return;
    }
  }
  for (int t = first; t < row_tiles * col_tiles; t += stride) {
    const uint64_t t0 = gpu::timer_ticks();
    const TileCoord tc = coord(t);
    typename Eng::Acc acc;
    Eng::mainloop(acc, smem, a_rows(tc, 0), b_source(tc, 0), g.k, NoWait{});
    store(acc, tc);
    on_tile(t, t0);
  }
}

}  // namespace jo::gemm
