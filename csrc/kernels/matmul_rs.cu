// Fused GEMM + reduce-scatter (see matmul_rs.h).
//
// GEMM workgroups compute the partial product of every rank's row block, in
// the order rank + 1, rank + 2, ..., rank (own block last, so peers can start
// reducing early), store each tile to this rank's staging slot and release
// its ready flag at system scope. Reducer workgroups [0, workers) take the
// tiles of this rank's block, wait until every rank has staged the tile, sum
// the world partials in rank order 0..world-1 in fp32 (bitwise reproducible),
// add the bias once and write the output, then tell each rank its slot tile
// may be reused. With world == 1 the GEMM writes the output directly.
#include "kernels/matmul_rs.h"

#include "gemm/gemm_tile.h"
#include "gemm/tile_order.h"
#include "gemm/tile_shapes.h"
#include "kernels/gemm_variant.h"
#include "kernels/launch.h"
#include "kernels/protocol.h"

namespace jo {
namespace {

template <typename T>
struct MatmulRsArgs {
  const T* x;
  const T* w;
  const T* bias;
  T* out;
  int64_t m_total;     // rows of x per batch element
  int64_t m_block;     // m_total / world
  int64_t block_rows;  // batch * m_block: rows of one rank's block
  int k;
  int n;
  int workers;
  int group_cols;  // tile columns per band (gemm/tile_order.h)
  ReduceLayout layout;
  Peers peers;
  uint32_t epoch;
  Watchdog wd;
  TraceSink trace;
  gemm::TailSplit tail;  // world 1
};

template <class Eng, typename T>
__device__ void rs_gemm_role(const MatmulRsArgs<T>& a, T* smem, int worker, int workers) {
  const int world = a.peers.world;
  const int rank = a.peers.rank;
  const int parity = static_cast<int>(a.epoch & 1u);
  const int col_tiles = (a.n + Eng::BN - 1) / Eng::BN;
  const int row_tiles = static_cast<int>((a.block_rows + Eng::BM - 1) / Eng::BM);
  const int per_block = row_tiles * col_tiles;
  char* mine = a.peers.region(rank);
  const int64_t ldb = Eng::kBKMajor ? a.k : a.n;

  for (int t = worker; t < per_block * world; t += workers) {
    const uint64_t t0 = gpu::timer_ticks();
    const int block = (rank + 1 + t / per_block) % world;
    const gemm::TileCoord tc = gemm::tile_coord(t % per_block, row_tiles, col_tiles, a.group_cols);
    const int tile = tc.row * col_tiles + tc.col;  // flag index: row-major, as the reducers count
    const int64_t r0 = static_cast<int64_t>(tc.row) * Eng::BM;
    const int ct = tc.col;
    auto a_row = [&](int r) -> const T* {
      const int64_t l = r0 + r;  // row of the block: l = b * m_block + i
      if (l >= a.block_rows) return nullptr;
      const uint32_t b = static_cast<uint32_t>(l) / static_cast<uint32_t>(a.m_block);  // see gathered_row
      return a.x + (b * a.m_total + block * a.m_block + (l - static_cast<int64_t>(b) * a.m_block)) * a.k;
    };
    const typename Eng::BSource b{a.w, ldb, ct * Eng::BN, a.n};
    // The tile goes to this rank's staging slot for the block, which the
    // block's owner sums (and adds the bias to).
    bool ok = true;
    if (threadIdx.x == 0 && a.epoch > 2)  // the block's owner read this slot tile two epochs ago
      ok = spin_until<Scope::kSystem>(a.layout.done_flag(mine, parity, block, tile), a.epoch - 2, a.wd, rank, block,
                                      world, a.epoch, WaitOn::kReadersDone);
    if (!block_agree(ok)) return;
    T* dst = reinterpret_cast<T*>(a.layout.block_data(mine, parity, block));
    auto out_row = [&](int r) -> T* { return r0 + r < a.block_rows ? dst + (r0 + r) * a.n : nullptr; };
    gemm::gemm_tile<Eng>(smem, a_row, b, a.k, out_row, static_cast<const T*>(nullptr), gemm::NoWait{});
    __syncthreads();
    if (threadIdx.x == 0) gpu::store_release_sys(a.layout.ready_flag(mine, parity, block, tile), a.epoch);
    trace_event(a.trace, TraceKind::kGemmTile, t0, static_cast<uint32_t>(tile), static_cast<uint32_t>(block));
  }
}

template <class Eng, typename T>
__device__ void rs_reduce_role(const MatmulRsArgs<T>& a, int worker, int workers) {
  constexpr int kVec = 16 / sizeof(T);
  const int world = a.peers.world;
  const int rank = a.peers.rank;
  const int parity = static_cast<int>(a.epoch & 1u);
  const int col_tiles = (a.n + Eng::BN - 1) / Eng::BN;
  const int per_block = static_cast<int>((a.block_rows + Eng::BM - 1) / Eng::BM) * col_tiles;

  for (int tile = worker; tile < per_block; tile += workers) {
    const uint64_t t0 = gpu::timer_ticks();
    bool ok = true;
    if (threadIdx.x == 0) {
      for (int p = 0; p < world && ok; ++p)
        ok = spin_until<Scope::kSystem>(a.layout.ready_flag(a.peers.region(p), parity, rank, tile), a.epoch, a.wd,
                                        rank, p, world, a.epoch, WaitOn::kPartialReady);
    }
    if (!block_agree(ok)) return;
    const int64_t r0 = static_cast<int64_t>(tile / col_tiles) * Eng::BM;
    const int64_t c0 = static_cast<int64_t>(tile % col_tiles) * Eng::BN;
    const int nrows = static_cast<int>(a.block_rows - r0 < Eng::BM ? a.block_rows - r0 : Eng::BM);
    const int vecs = static_cast<int>((a.n - c0 < Eng::BN ? a.n - c0 : Eng::BN) / kVec);
    // Thread t owns vector column t % vecs of rows t / vecs, t / vecs + rows_per_pass, ...
    const int rows_per_pass = static_cast<int>(blockDim.x) / vecs;
    const int vc = static_cast<int>(threadIdx.x) % vecs;
    const int64_t col = c0 + static_cast<int64_t>(vc) * kVec;
    float bias[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) bias[i] = a.bias != nullptr ? gpu::to_float(a.bias[col + i]) : 0.f;
    const int first_row = static_cast<int>(threadIdx.x) < rows_per_pass * vecs ? static_cast<int>(threadIdx.x) / vecs
                                                                                 : nrows;
    // kRows rows per pass, all their loads from one peer in flight together (a
    // peer's memory is microseconds away); each element still sums the ranks
    // in fixed order 0..world-1, so the result is bitwise reproducible.
    constexpr int kRows = 4;
    for (int row0 = first_row; row0 < nrows; row0 += kRows * rows_per_pass) {
      float acc[kRows][kVec];
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[r][i] = 0.f;
      for (int p = 0; p < world; ++p) {
        const T* src = reinterpret_cast<const T*>(a.layout.block_data(a.peers.region(p), parity, rank));
        gpu::Vec16 raw[kRows];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const int row = row0 + r * rows_per_pass;
          raw[r] = row < nrows ? gpu::load16_uncached(src + (r0 + row) * a.n + col) : gpu::Vec16{};
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          T vals[kVec];
          __builtin_memcpy(vals, &raw[r], sizeof(raw[r]));
#pragma unroll
          for (int i = 0; i < kVec; ++i) acc[r][i] += gpu::to_float(vals[i]);
        }
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int row = row0 + r * rows_per_pass;
        if (row >= nrows) break;
        T outv[kVec];
#pragma unroll
        for (int i = 0; i < kVec; ++i) outv[i] = gpu::from_float<T>(acc[r][i] + bias[i]);  // the bias, once
        gpu::Vec16 packed;
        __builtin_memcpy(&packed, outv, sizeof(packed));
        gpu::store16(a.out + (r0 + row) * a.n + col, packed);
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int p = 0; p < world; ++p)
        gpu::store_release_sys(a.layout.done_flag(a.peers.region(p), parity, rank, tile), a.epoch);
    }
    trace_event(a.trace, TraceKind::kReduce, t0, static_cast<uint32_t>(tile), static_cast<uint32_t>(rank));
  }
}

// kPeers == false (world 1): the plain GEMM (gemm/gemm_tile.h plain_gemm)
// writes the output; no staging, no reducers, no protocol registers.
template <typename T, class Shape, gemm::BLayout L, bool kPeers>
__global__ __launch_bounds__(Shape::kThreads) void matmul_rs_kernel(MatmulRsArgs<T> a) {
  using Eng = gemm::TileEngine<T, Shape, L>;
  extern __shared__ gpu::Vec16 smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  if constexpr (!kPeers) {
    const gemm::PlainGemm<T> g{a.x, a.w, a.bias, a.out, a.block_rows, a.n, a.k, a.group_cols};
    gemm::plain_gemm<Eng>(g, smem, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x), a.tail,
                          [&](int t, uint64_t t0) { trace_event(a.trace, TraceKind::kGemmTile, t0, t, 0); });
  } else if (static_cast<int>(blockIdx.x) < a.workers) {
    rs_reduce_role<Eng>(a, static_cast<int>(blockIdx.x), a.workers);
  } else {
    rs_gemm_role<Eng>(a, smem, static_cast<int>(blockIdx.x) - a.workers, static_cast<int>(gridDim.x) - a.workers);
  }
}

template <class Shape>
ReduceLayout rs_layout(int world, int64_t block_rows, int64_t n, int elem_bytes) {
  const int tiles = static_cast<int>(ceil_div(block_rows, Shape::BM) * ceil_div(n, Shape::BN));
  return ReduceLayout::make(world, block_rows, n, tiles, elem_bytes);
}

template <typename T, class Shape, gemm::BLayout L, bool kPeers>
hipError_t launch_typed(const MatmulRsLaunch& l, hipStream_t stream) {
  using Eng = gemm::TileEngine<T, Shape, L>;
  constexpr auto kernel = matmul_rs_kernel<T, Shape, L, kPeers>;
  const GemmOperands& op = l.op;
  const int world = l.ctx.peers.world;
  const int workers = kPeers ? op.workers : 0;
  const int64_t m_block = l.m_total / world;
  const int64_t block_rows = op.batch * m_block;
  int grid = 0, group_cols = 0;
  const hipError_t e = gemm_grid<kernel, Eng>(l.ctx.limits, workers,
                                              ceil_div(block_rows, Shape::BM) * ceil_div(op.n, Shape::BN) * world,
                                              op.n, op.k, &grid, &group_cols);
  if (e != hipSuccess) return e;
  MatmulRsArgs<T> a{static_cast<const T*>(op.x), static_cast<const T*>(op.w), static_cast<const T*>(op.bias),
                    static_cast<T*>(l.out), l.m_total, m_block, block_rows, static_cast<int>(op.k),
                    static_cast<int>(op.n), workers, group_cols, rs_layout<Shape>(world, block_rows, op.n, sizeof(T)),
                    l.ctx.peers, l.ctx.epoch, l.ctx.wd, l.ctx.trace,
                    tail_split<Eng>(kPeers ? TailScratch{} : l.tail,
                                    ceil_div(block_rows, Shape::BM) * ceil_div(op.n, Shape::BN), grid)};
  kernel<<<grid, Shape::kThreads, Eng::kSmemBytes, stream>>>(a);
  return hipGetLastError();
}

}  // namespace

uint64_t matmul_rs_region_bytes(int world, int64_t batch, int64_t m_total, int64_t n, int tile, int elem_bytes) {
  if (world <= 1) return 0;
  uint64_t bytes = 0;
  gemm::with_tile_shape(tile, [&](auto shape) {
    bytes = rs_layout<decltype(shape)>(world, batch * (m_total / world), n, elem_bytes).total;
  });
  return bytes;
}

hipError_t launch_matmul_rs(const MatmulRsLaunch& l, hipStream_t stream) {
  return with_gemm_variant(l.op, l.ctx.peers.world > 1, [&](auto type, auto shape, auto layout, auto peers) {
    return launch_typed<typename decltype(type)::type, decltype(shape), decltype(layout)::value,
                        decltype(peers)::value>(l, stream);
  });
}

}  // namespace jo
