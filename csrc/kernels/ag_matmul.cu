// Fused all-gather + GEMM (see ag_matmul.h).
//
// Workgroups [0, fetchers) are fetchers (protocol.h gather_role): they publish
// this rank's shard and pull peers' shards into `gathered`, releasing one
// staged flag per (shard, row tile, k-chunk). The rest are GEMM workgroups:
// they walk output tiles shard by shard in arrival order (own shard first,
// read straight from x, then rank + 1, rank + 2, ...: gemm::shard_ordered)
// and, before copying the A operand of a k-tile that starts a new chunk, wait
// for its staged flag.
#include "kernels/ag_matmul.h"

#include "gemm/gemm_tile.h"
#include "gemm/tile_scheduler.h"
#include "gemm/tile_shapes.h"
#include "kernels/gemm_variant.h"
#include "kernels/launch.h"
#include "kernels/local_gemm.h"
#include "kernels/protocol.h"

namespace jo {
namespace {

// A wait on a staged flag longer than this is a trace event (2 us on either vendor).
constexpr uint64_t kTraceWaitTicks = 2 * gpu::kNominalTicksPerMicrosecond;

template <typename T>
struct AgMatmulArgs : FusedGemmArgs<T> {
  T* y;
  T* gathered;
  int64_t m;
  int64_t rows;  // batch * m
  int chunk_k;
  int fetchers;
  GatherLayout layout;
};

template <class ML, typename T>
__device__ void ag_gemm_role(const AgMatmulArgs<T>& a, T* smem, int gemm_index, int gemm_workgroups) {
  const int world = a.peers.world;
  const int rank = a.peers.rank;
  const int row_tiles = static_cast<int>((a.rows + ML::BM - 1) / ML::BM);
  const int col_tiles = (a.n + ML::BN - 1) / ML::BN;
  const int k_tiles_per_chunk = a.chunk_k / ML::BK;
  const int64_t ldb = ML::kBKMajor ? a.k : a.n;

  gemm::GroupScheduler sched =
      gemm::shard_ordered(gemm_index, gemm_workgroups, rank, world, row_tiles, col_tiles, a.group_cols);
  for (gemm::GroupWork work; sched.next(work);) {
    const uint64_t t0 = gpu::timer_ticks();
    const int shard = work.group;
    const gemm::TileCoord tc = work.coord;
    const int64_t r0 = static_cast<int64_t>(tc.row) * ML::BM;
    auto out_row = [&](int r) -> T* {
      const int64_t l = r0 + r;
      return l < a.rows ? a.y + gathered_row(l, shard, a.m, world) * a.n : nullptr;
    };
    const typename ML::BSource b{a.w, ldb, tc.col * ML::BN, a.n};
    bool aborted = false;
    if (shard == rank) {
      // Own shard: straight from x, nothing to wait for, in a mainloop of its
      // own that keeps the wait hook's state out of its registers.
      auto a_row = [&](int r) -> const T* { return r0 + r < a.rows ? a.x + (r0 + r) * a.k : nullptr; };
      gemm::gemm_tile<ML>(smem, a_row, b, a.k, out_row, a.bias, gemm::NoWait{});
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
          ok = spin_until<Scope::kDevice>(flags + kt / k_tiles_per_chunk, flag_value(a.epoch, 0), a.wd, rank, shard,
                                          world, a.epoch, WaitOn::kStaged);
        if (!block_agree(ok)) aborted = true;
        if (gpu::timer_ticks() - w0 > kTraceWaitTicks)
          trace_event(a.trace, TraceKind::kWait, w0, tc.row * a.layout.col_chunks + kt / k_tiles_per_chunk, shard);
      };
      gemm::gemm_tile<ML>(smem, a_row, b, a.k, out_row, a.bias, wait_a);
    }
    trace_event(a.trace, TraceKind::kGemmTile, t0, static_cast<uint32_t>(work.unit), static_cast<uint32_t>(shard));
    if (aborted) return;
  }
}

// kPeers == false (world 1): no fetchers and no staged rows, so the kernel is
// the plain GEMM (gemm/gemm_tile.h plain_gemm) without the protocol's registers.
template <typename T, class Config, gemm::BLayout L, bool kPeers>
__global__ __launch_bounds__(Config::Shape::kThreads) void ag_matmul_kernel(AgMatmulArgs<T> a) {
  using ML = gemm::MainloopOf<T, Config, L>;
  extern __shared__ gpu::Vec16 smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  if constexpr (!kPeers) {
    local_gemm_role<ML>(a, a.y, a.rows, smem);
  } else if (static_cast<int>(blockIdx.x) < a.fetchers) {
    const GatherArgs g{reinterpret_cast<const char*>(a.x), reinterpret_cast<char*>(a.gathered), a.m, a.layout,
                       a.peers, a.epoch, a.site, a.slot_used, a.wd, a.trace};
    gather_role(g, static_cast<int>(blockIdx.x), a.fetchers);
  } else {
    ag_gemm_role<ML>(a, smem, static_cast<int>(blockIdx.x) - a.fetchers, static_cast<int>(gridDim.x) - a.fetchers);
  }
}

template <class Shape>
GatherLayout ag_layout(int world, int64_t rows, int64_t k, int chunk_k, int elem_bytes) {
  return GatherLayout::make(world, rows, k * elem_bytes, Shape::BM, static_cast<int64_t>(chunk_k) * elem_bytes);
}

// The launch of l (its pointers unused) with per_sm workgroups per SM, or
// the kernel's occupancy when per_sm == 0.
template <class V>
hipError_t geometry_typed(const AgMatmulLaunch& l, int per_sm, GemmGeometry* geo) {
  using T = typename V::Elem;
  const int world = l.ctx.peers.world;
  const int64_t rows = l.op.batch * l.m;
  const hipError_t e = gemm_geometry<ag_matmul_kernel<T, typename V::Config, V::kLayout, V::kPeers>,
                                     typename V::Mainloop>(per_sm, l.ctx.limits, V::kPeers ? l.op.comm_workgroups : 0,
                                                           world, rows, l.op.n, l.op.k, geo);
  geo->region_bytes = V::kPeers && l.chunk_k > 0
                          ? ag_layout<typename V::Config::Shape>(world, rows, l.op.k, l.chunk_k, sizeof(T)).total
                          : 0;
  return e;
}

template <class V>
hipError_t launch_typed(const AgMatmulLaunch& l, hipStream_t stream) {
  using T = typename V::Elem;
  using Config = typename V::Config;
  constexpr bool kPeers = V::kPeers;
  using ML = typename V::Mainloop;
  if (l.chunk_k % ML::BK != 0) return hipErrorInvalidValue;
  GemmGeometry geo{};
  const hipError_t e = geometry_typed<V>(l, 0, &geo);
  if (e != hipSuccess) return e;
  const GemmOperands& op = l.op;
  AgMatmulArgs<T> a{};
  set_gemm_args(a, op, l.ctx, geo);
  a.y = static_cast<T*>(l.y);
  a.gathered = static_cast<T*>(l.gathered);
  a.m = l.m;
  a.rows = op.batch * l.m;
  a.chunk_k = l.chunk_k;
  a.fetchers = geo.comm_workgroups;
  if constexpr (kPeers) a.layout = ag_layout<typename Config::Shape>(l.ctx.peers.world, a.rows, op.k, l.chunk_k, sizeof(T));
  a.tail = tail_split<ML>(kPeers ? TailScratch{} : l.tail, geo.tiles, geo.grid);
  return launch_persistent<ag_matmul_kernel<T, Config, V::kLayout, kPeers>>(geo.grid, ML::kThreads, ML::kSmemBytes,
                                                                          a, stream);
}

}  // namespace

uint64_t ag_matmul_region_bytes(int world, int64_t rows, int64_t k, int tile, int chunk_k, int elem_bytes) {
  if (world <= 1) return 0;
  uint64_t bytes = 0;
  gemm::with_tile_config(tile, [&](auto config) {
    bytes = ag_layout<typename decltype(config)::Shape>(world, rows, k, chunk_k, elem_bytes).total;
  });
  return bytes;
}

hipError_t ag_matmul_geometry(const AgMatmulLaunch& l, int per_sm, GemmGeometry* geo) {
  return with_gemm_variant(l.op, l.ctx.peers.world > 1,
                           [&](auto v) { return geometry_typed<decltype(v)>(l, per_sm, geo); });
}

hipError_t launch_ag_matmul(const AgMatmulLaunch& l, hipStream_t stream) {
  return with_gemm_variant(l.op, l.ctx.peers.world > 1, [&](auto v) { return launch_typed<decltype(v)>(l, stream); });
}

}  // namespace jo
