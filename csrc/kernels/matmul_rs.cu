// Fused GEMM + reduce-scatter (see matmul_rs.h).
//
// GEMM workgroups compute the partial product of every rank's row block, in
// the order rank + 1, rank + 2, ..., rank (own block last, so peers can start
// reducing early: gemm::block_ordered), store each tile to this rank's staging
// slot and release its ready flag at system scope (StageAndRelease). Reducer
// workgroups [0, reducers) take the
// tiles of this rank's block, wait until every rank has staged the tile, sum
// the world partials in rank order 0..world-1 in fp32 (bitwise reproducible),
// add the bias once and write the output, then tell each rank its slot tile
// may be reused. With world == 1 the GEMM writes the output directly.
#include "kernels/matmul_rs.h"

#include "gemm/gemm_tile.h"
#include "gemm/tile_scheduler.h"
#include "gemm/tile_shapes.h"
#include "kernels/gemm_variant.h"
#include "kernels/launch.h"
#include "kernels/local_gemm.h"
#include "kernels/protocol.h"

namespace jo {
namespace {

template <typename T>
struct MatmulRsArgs : FusedGemmArgs<T> {
  T* out;
  int64_t m_total;     // rows of x per batch element
  int64_t m_block;     // m_total / world
  int64_t block_rows;  // batch * m_block: rows of one rank's block
  int reducers;
  ReduceLayout layout;
};

// The epilogue of the GEMM workgroups: a tile of the partial product of row
// block `block` goes to this rank's staging slot for the block, which the
// block's owner sums (and adds the bias to), and its ready flag is released
// at system scope.
template <class ML, typename T>
struct StageAndRelease {
  const MatmulRsArgs<T>& a;
  char* mine;  // this rank's region
  int parity;

  // Before the tile's mainloop: the block's owner read this staging tile two
  // epochs ago (same parity); wait until it said so. False: the watchdog fired.
  __device__ bool claim(int block, int tile) const {
    bool ok = true;
    if (threadIdx.x == 0 && a.slot_used)
      ok = spin_until<Scope::kSystem>(a.layout.done_flag(mine, parity, block, tile), flag_value(a.epoch - 2, 0), a.wd,
                                      a.peers.rank, block, a.peers.world, a.epoch, WaitOn::kReadersDone);
    return block_agree(ok);
  }

  __device__ void apply(const typename ML::Acc& acc, int block, int tile, gemm::TileCoord tc) const {
    T* dst = reinterpret_cast<T*>(a.layout.block_data(mine, parity, block));
    const int64_t r0 = static_cast<int64_t>(tc.row) * ML::BM;
    auto out_row = [&](int r) -> T* { return r0 + r < a.block_rows ? dst + (r0 + r) * a.n : nullptr; };
    gemm::StoreTile<ML>::apply(acc, out_row, tc.col * ML::BN, a.n, static_cast<const T*>(nullptr));
    __syncthreads();
    if (threadIdx.x == 0)
      gpu::store_release_sys(a.layout.ready_flag(mine, parity, block, tile), flag_value(a.epoch, a.site));
  }
};

template <class ML, typename T>
__device__ void rs_gemm_role(const MatmulRsArgs<T>& a, T* smem, int gemm_index, int gemm_workgroups) {
  const int world = a.peers.world;
  const int rank = a.peers.rank;
  const int col_tiles = (a.n + ML::BN - 1) / ML::BN;
  const int row_tiles = static_cast<int>((a.block_rows + ML::BM - 1) / ML::BM);
  const int64_t ldb = ML::kBKMajor ? a.k : a.n;
  const StageAndRelease<ML, T> epilogue{a, a.peers.region(rank), static_cast<int>(a.epoch & 1u)};

  gemm::GroupScheduler sched =
      gemm::block_ordered(gemm_index, gemm_workgroups, rank, world, row_tiles, col_tiles, a.group_cols);
  for (gemm::GroupWork work; sched.next(work);) {
    const uint64_t t0 = gpu::timer_ticks();
    const int block = work.group;
    const gemm::TileCoord tc = work.coord;
    const int tile = tc.row * col_tiles + tc.col;  // flag index: row-major, as the reducers count
    const int64_t r0 = static_cast<int64_t>(tc.row) * ML::BM;
    auto a_row = [&](int r) -> const T* {
      const int64_t l = r0 + r;  // row of the block: l = b * m_block + i
      if (l >= a.block_rows) return nullptr;
      const uint32_t b = static_cast<uint32_t>(l) / static_cast<uint32_t>(a.m_block);  // see gathered_row
      return a.x + (b * a.m_total + block * a.m_block + (l - static_cast<int64_t>(b) * a.m_block)) * a.k;
    };
    const typename ML::BSource b{a.w, ldb, tc.col * ML::BN, a.n};
    if (!epilogue.claim(block, tile)) return;
    typename ML::Acc acc;
    ML::run(acc, smem, ML::a_rows(a_row), b, a.k, gemm::NoWait{});
    epilogue.apply(acc, block, tile, tc);
    trace_event(a.trace, TraceKind::kGemmTile, t0, static_cast<uint32_t>(tile), static_cast<uint32_t>(block));
  }
}

template <class ML, typename T>
__device__ void rs_reduce_role(const MatmulRsArgs<T>& a, int reducer, int reducers) {
  constexpr int kVec = 16 / sizeof(T);
  const int world = a.peers.world;
  const int rank = a.peers.rank;
  const int parity = static_cast<int>(a.epoch & 1u);
  const int col_tiles = (a.n + ML::BN - 1) / ML::BN;
  const int per_block = static_cast<int>((a.block_rows + ML::BM - 1) / ML::BM) * col_tiles;

  for (int tile = reducer; tile < per_block; tile += reducers) {
    const uint64_t t0 = gpu::timer_ticks();
    bool ok = true;
    if (threadIdx.x == 0) {
      for (int p = 0; p < world && ok; ++p)
        ok = spin_until<Scope::kSystem>(a.layout.ready_flag(a.peers.region(p), parity, rank, tile),
                                        flag_value(a.epoch, a.site), a.wd, rank, p, world, a.epoch,
                                        WaitOn::kPartialReady);
    }
    if (!block_agree(ok)) return;
    const int64_t r0 = static_cast<int64_t>(tile / col_tiles) * ML::BM;
    const int64_t c0 = static_cast<int64_t>(tile % col_tiles) * ML::BN;
    const int nrows = static_cast<int>(a.block_rows - r0 < ML::BM ? a.block_rows - r0 : ML::BM);
    const int vecs = static_cast<int>((a.n - c0 < ML::BN ? a.n - c0 : ML::BN) / kVec);
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
        gpu::store_release_sys(a.layout.done_flag(a.peers.region(p), parity, rank, tile), flag_value(a.epoch, a.site));
    }
    trace_event(a.trace, TraceKind::kReduce, t0, static_cast<uint32_t>(tile), static_cast<uint32_t>(rank));
  }
}

// kPeers == false (world 1): the plain GEMM (gemm/gemm_tile.h plain_gemm)
// writes the output; no staging, no reducers, no protocol registers.
template <typename T, class Config, gemm::BLayout L, bool kPeers>
__global__ __launch_bounds__(Config::Shape::kThreads) void matmul_rs_kernel(MatmulRsArgs<T> a) {
  using ML = gemm::MainloopOf<T, Config, L>;
  extern __shared__ gpu::Vec16 smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  if constexpr (!kPeers) {
    local_gemm_role<ML>(a, a.out, a.block_rows, smem);
  } else if (static_cast<int>(blockIdx.x) < a.reducers) {
    rs_reduce_role<ML>(a, static_cast<int>(blockIdx.x), a.reducers);
  } else {
    rs_gemm_role<ML>(a, smem, static_cast<int>(blockIdx.x) - a.reducers, static_cast<int>(gridDim.x) - a.reducers);
  }
}

template <class Shape>
ReduceLayout rs_layout(int world, int64_t block_rows, int64_t n, int elem_bytes) {
  const int tiles = static_cast<int>(ceil_div(block_rows, Shape::BM) * ceil_div(n, Shape::BN));
  return ReduceLayout::make(world, block_rows, n, tiles, elem_bytes);
}

// The launch of l (its pointers unused) with per_sm workgroups per SM, or
// the kernel's occupancy when per_sm == 0.
template <class V>
hipError_t geometry_typed(const MatmulRsLaunch& l, int per_sm, GemmGeometry* geo) {
  const int world = l.ctx.peers.world;
  const int64_t block_rows = l.op.batch * (l.m_total / world);
  const hipError_t e = gemm_geometry<matmul_rs_kernel<typename V::Elem, typename V::Config, V::kLayout, V::kPeers>,
                                     typename V::Mainloop>(per_sm, l.ctx.limits, V::kPeers ? l.op.comm_workgroups : 0,
                                                           world, block_rows, l.op.n, l.op.k, geo);
  geo->region_bytes =
      V::kPeers ? rs_layout<typename V::Config::Shape>(world, block_rows, l.op.n, sizeof(typename V::Elem)).total : 0;
  return e;
}

template <class V>
hipError_t launch_typed(const MatmulRsLaunch& l, hipStream_t stream) {
  using T = typename V::Elem;
  using Config = typename V::Config;
  constexpr bool kPeers = V::kPeers;
  using ML = typename V::Mainloop;
  GemmGeometry geo{};
  const hipError_t e = geometry_typed<V>(l, 0, &geo);
  if (e != hipSuccess) return e;
  const GemmOperands& op = l.op;
  const int world = l.ctx.peers.world;
  MatmulRsArgs<T> a{};
  set_gemm_args(a, op, l.ctx, geo);
  a.out = static_cast<T*>(l.out);
  a.m_total = l.m_total;
  a.m_block = l.m_total / world;
  a.block_rows = op.batch * a.m_block;
  a.reducers = geo.comm_workgroups;
  a.layout = rs_layout<typename Config::Shape>(world, a.block_rows, op.n, sizeof(T));
  a.tail = tail_split<ML>(kPeers ? TailScratch{} : l.tail, geo.tiles, geo.grid);
  return launch_persistent<matmul_rs_kernel<T, Config, V::kLayout, kPeers>>(geo.grid, ML::kThreads, ML::kSmemBytes,
                                                                          a, stream);
}

}  // namespace

uint64_t matmul_rs_region_bytes(int world, int64_t batch, int64_t m_total, int64_t n, int tile, int elem_bytes) {
  if (world <= 1) return 0;
  uint64_t bytes = 0;
  gemm::with_tile_config(tile, [&](auto config) {
    bytes = rs_layout<typename decltype(config)::Shape>(world, batch * (m_total / world), n, elem_bytes).total;
  });
  return bytes;
}

hipError_t matmul_rs_geometry(const MatmulRsLaunch& l, int per_sm, GemmGeometry* geo) {
  return with_gemm_variant(l.op, l.ctx.peers.world > 1,
                           [&](auto v) { return geometry_typed<decltype(v)>(l, per_sm, geo); });
}

hipError_t launch_matmul_rs(const MatmulRsLaunch& l, hipStream_t stream) {
  return with_gemm_variant(l.op, l.ctx.peers.world > 1, [&](auto v) { return launch_typed<decltype(v)>(l, stream); });
}

}  // namespace jo
