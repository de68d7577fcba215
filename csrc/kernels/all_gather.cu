// The runtime's all-gather (see all_gather.h): every workgroup is a fetcher.
#include "kernels/all_gather.h"

#include "kernels/launch.h"
#include "kernels/protocol.h"

namespace jo {
namespace {

// Rows and bytes per flag: 64 rows x up to 64 KiB, so small shards still
// spread over several workgroups.
constexpr int kChunkRows = 64;
constexpr int64_t kChunkBytes = 64 * 1024;
constexpr int kThreads = 256;

__global__ __launch_bounds__(kThreads) void all_gather_kernel(GatherArgs g) {
  gather_role(g, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x));
}

GatherLayout layout(int world, int64_t rows, int64_t row_bytes) {
  return GatherLayout::make(world, rows, row_bytes, kChunkRows, row_bytes < kChunkBytes ? row_bytes : kChunkBytes);
}

}  // namespace

uint64_t all_gather_region_bytes(int world, int64_t rows, int64_t row_bytes) {
  return world <= 1 ? 0 : layout(world, rows, row_bytes).total;
}

// One fetcher per chunk, as many as stay co-resident.
hipError_t launch_all_gather(const AllGatherLaunch& l, hipStream_t stream) {
  int per_sm = 0;
  const hipError_t e = workgroups_per_sm<all_gather_kernel>(kThreads, 0, &per_sm);
  if (e != hipSuccess) return e;
  const GatherLayout lay = layout(l.ctx.peers.world, l.batch * l.m, l.row_bytes);
  const int grid = std::min(co_resident_workgroups(per_sm, l.ctx.limits), std::max(lay.chunks(), 1));
  if (grid < 1 || l.row_bytes % 16 != 0) return hipErrorInvalidValue;
  GatherArgs g{};
  g.x = static_cast<const char*>(l.x);
  g.gathered = static_cast<char*>(l.gathered);
  g.m = l.m;
  g.layout = lay;
  g.peers = l.ctx.peers;
  g.epoch = static_cast<uint32_t>(l.ctx.epoch);
  g.site = l.ctx.site;
  g.slot_used = l.ctx.slot_used;
  g.wd = l.ctx.wd;
  g.trace = l.ctx.trace;
  return launch_persistent<all_gather_kernel>(grid, kThreads, 0, g, stream);
}

}  // namespace jo
