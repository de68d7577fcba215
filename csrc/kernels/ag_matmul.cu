// Fused all-gather + GEMM (see ag_matmul.h).
//
// Workgroups [0, workers) are fetchers (protocol.h gather_role): they publish
// this rank's shard and pull peers' shards into `gathered`, releasing one
// staged flag per (shard, row tile, k-chunk). The rest are GEMM workgroups:
// they walk output tiles shard by shard in arrival order (own shard first,
// read straight from x, then rank + 1, rank + 2, ...) and, before copying the
// A operand of a k-tile that starts a new chunk, wait for its staged flag.
#include "kernels/ag_matmul.h"

#include "gemm/gemm_tile.h"
#include "gemm/tile_order.h"
#include "gemm/tile_shapes.h"
#include "kernels/gemm_variant.h"
#include "kernels/launch.h"
#include "kernels/protocol.h"

namespace jo {
namespace {

template <typename T>
struct AgMatmulArgs {
  const T* x;
  const T* w;
  const T* bias;
  T* y;
  T* gathered;
  int64_t m;
  int64_t rows;  // batch * m
  int k;
  int n;
  int chunk_k;
  int workers;
  int group_cols;  // tile columns per band (gemm/tile_order.h)
  GatherLayout layout;
  Peers peers;
  uint32_t epoch;
  Watchdog wd;
  TraceSink trace;
  gemm::TailSplit tail;  // world 1
};

template <class Eng, typename T>
__device__ void ag_gemm_role(const AgMatmulArgs<T>& a, T* smem, int worker, int workers) {
  const int world = a.peers.world;
  const int rank = a.peers.rank;
  const int row_tiles = static_cast<int>((a.rows + Eng::BM - 1) / Eng::BM);
  const int col_tiles = (a.n + Eng::BN - 1) / Eng::BN;
  const int per_shard = row_tiles * col_tiles;
  const int k_tiles_per_chunk = a.chunk_k / Eng::BK;
  const int64_t ldb = Eng::kBKMajor ? a.k : a.n;

  for (int t = worker; t < per_shard * world; t += workers) {
    const uint64_t t0 = gpu::timer_ticks();
    const int shard = (rank + t / per_shard) % world;
    const gemm::TileCoord tc = gemm::tile_coord(t % per_shard, row_tiles, col_tiles, a.group_cols);
    const int64_t r0 = static_cast<int64_t>(tc.row) * Eng::BM;
    auto out_row = [&](int r) -> T* {
      const int64_t l = r0 + r;
      return l < a.rows ? a.y + gathered_row(l, shard, a.m, world) * a.n : nullptr;
    };
    const typename Eng::BSource b{a.w, ldb, tc.col * Eng::BN, a.n};
    bool aborted = false;
    if (shard == rank) {
      // Own shard: straight from x, nothing to wait for, in a mainloop of its
      // own that keeps the wait hook's state out of its registers.
      auto a_row = [&](int r) -> const T* { return r0 + r < a.rows ? a.x + (r0 + r) * a.k : nullptr; };
      gemm::gemm_tile<Eng>(smem, a_row, b, a.k, out_row, a.bias, gemm::NoWait{});
    } else {
      auto a_row = [&](int r) -> const T* {
        const int64_t l = r0 + r;
        return l < a.rows ? a.gathered + gathered_row(l, shard, a.m, world) * a.k : nullptr;
      };
      // Flags of this row tile's k-chunks, in k order.
      const uint32_t* flags = a.layout.staged_flag(a.peers.region(rank), shard, tc.row * a.layout.col_chunks);
      auto wait_a = [&](int kt) {
        if (kt % k_tiles_per_chunk != 0) return;
        const uint64_t w0 = gpu::timer_ticks();
        bool ok = true;
        if (threadIdx.x == 0)
          ok = spin_until<Scope::kDevice>(flags + kt / k_tiles_per_chunk, a.epoch, a.wd, rank, shard, world,
                                          a.epoch, WaitOn::kStaged);
        if (!block_agree(ok)) aborted = true;
        if (gpu::timer_ticks() - w0 > 2000)
          trace_event(a.trace, TraceKind::kWait, w0, tc.row * a.layout.col_chunks + kt / k_tiles_per_chunk, shard);
      };
      gemm::gemm_tile<Eng>(smem, a_row, b, a.k, out_row, a.bias, wait_a);
    }
    trace_event(a.trace, TraceKind::kGemmTile, t0, static_cast<uint32_t>(t), static_cast<uint32_t>(shard));
    if (aborted) return;
  }
}

// kPeers == false (world 1): no fetchers and no staged rows, so the kernel is
// the plain GEMM (gemm/gemm_tile.h plain_gemm) without the protocol's registers.
template <typename T, class Shape, gemm::BLayout L, bool kPeers>
__global__ __launch_bounds__(Shape::kThreads) void ag_matmul_kernel(AgMatmulArgs<T> a) {
  using Eng = gemm::TileEngine<T, Shape, L>;
  extern __shared__ gpu::Vec16 smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  if constexpr (!kPeers) {
    const gemm::PlainGemm<T> g{a.x, a.w, a.bias, a.y, a.rows, a.n, a.k, a.group_cols};
    gemm::plain_gemm<Eng>(g, smem, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x), a.tail,
                          [&](int t, uint64_t t0) { trace_event(a.trace, TraceKind::kGemmTile, t0, t, 0); });
  } else if (static_cast<int>(blockIdx.x) < a.workers) {
    const GatherArgs g{reinterpret_cast<const char*>(a.x), reinterpret_cast<char*>(a.gathered), a.m, a.layout,
                       a.peers, a.epoch, a.wd, a.trace};
    gather_role(g, static_cast<int>(blockIdx.x), a.workers);
  } else {
    ag_gemm_role<Eng>(a, smem, static_cast<int>(blockIdx.x) - a.workers, static_cast<int>(gridDim.x) - a.workers);
  }
}

template <class Shape>
GatherLayout ag_layout(int world, int64_t rows, int64_t k, int chunk_k, int elem_bytes) {
  return GatherLayout::make(world, rows, k * elem_bytes, Shape::BM, static_cast<int64_t>(chunk_k) * elem_bytes);
}

template <typename T, class Shape, gemm::BLayout L, bool kPeers>
hipError_t launch_typed(const AgMatmulLaunch& l, hipStream_t stream) {
  using Eng = gemm::TileEngine<T, Shape, L>;
  constexpr auto kernel = ag_matmul_kernel<T, Shape, L, kPeers>;
  const GemmOperands& op = l.op;
  const int world = l.ctx.peers.world;
  const int64_t rows = op.batch * l.m;
  const int workers = kPeers ? op.workers : 0;
  if (l.chunk_k % Shape::BK != 0) return hipErrorInvalidValue;
  int grid = 0, group_cols = 0;
  const hipError_t e = gemm_grid<kernel, Eng>(l.ctx.limits, workers,
                                              ceil_div(rows, Shape::BM) * ceil_div(op.n, Shape::BN) * world, op.n,
                                              op.k, &grid, &group_cols);
  if (e != hipSuccess) return e;
  AgMatmulArgs<T> a{static_cast<const T*>(op.x), static_cast<const T*>(op.w), static_cast<const T*>(op.bias),
                    static_cast<T*>(l.y), static_cast<T*>(l.gathered), l.m, rows, static_cast<int>(op.k),
                    static_cast<int>(op.n), l.chunk_k, workers, group_cols,
                    ag_layout<Shape>(world, rows, op.k, l.chunk_k, sizeof(T)), l.ctx.peers, l.ctx.epoch, l.ctx.wd,
                    l.ctx.trace,
                    tail_split<Eng>(kPeers ? TailScratch{} : l.tail,
                                    ceil_div(rows, Shape::BM) * ceil_div(op.n, Shape::BN), grid)};
  kernel<<<grid, Shape::kThreads, Eng::kSmemBytes, stream>>>(a);
  return hipGetLastError();
}

}  // namespace

bool tile_shape_info(int index, TileShapeInfo* info) {
  return gemm::with_tile_shape(index, [&](auto shape) {
    using S = decltype(shape);
    *info = TileShapeInfo{S::BM, S::BN, S::BK, S::kThreads,
                          gemm::TileEngine<gpu::bf16, S, gemm::BLayout::kNMajor>::kSmemBytes,
                          gemm::kTailSplitCompiled &&
                              gemm::TileEngine<gpu::bf16, S, gemm::BLayout::kNMajor>::kCrossTilePipeline};
  });
}

uint64_t ag_matmul_region_bytes(int world, int64_t rows, int64_t k, int tile, int chunk_k, int elem_bytes) {
  if (world <= 1) return 0;
  uint64_t bytes = 0;
  gemm::with_tile_shape(tile, [&](auto shape) {
    bytes = ag_layout<decltype(shape)>(world, rows, k, chunk_k, elem_bytes).total;
  });
  return bytes;
}

uint64_t tail_scratch_bytes(int tile, int slots) {
  TileShapeInfo info{};
  if (!tile_shape_info(tile, &info) || !info.stream_k) return 0;
  return gemm::tail_scratch_bytes(slots, info.bm * info.bn);
}

hipError_t launch_ag_matmul(const AgMatmulLaunch& l, hipStream_t stream) {
  return with_gemm_variant(l.op, l.ctx.peers.world > 1, [&](auto type, auto shape, auto layout, auto peers) {
    return launch_typed<typename decltype(type)::type, decltype(shape), decltype(layout)::value,
                        decltype(peers)::value>(l, stream);
  });
}

}  // namespace jo
