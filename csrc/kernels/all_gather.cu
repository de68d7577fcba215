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

hipError_t launch_all_gather(const AllGatherLaunch& l, hipStream_t stream) {
  int cap = 0;
  hipError_t e = co_resident_grid<all_gather_kernel>(kThreads, 0, l.ctx.limits, &cap);
  if (e != hipSuccess) return e;
  const GatherLayout lay = layout(l.ctx.peers.world, l.batch * l.m, l.row_bytes);
  const int grid = std::min(cap, std::max(lay.chunks(), 1));
  if (grid < 1 || l.row_bytes % 16 != 0) return hipErrorInvalidValue;
  GatherArgs g{static_cast<const char*>(l.x), static_cast<char*>(l.gathered), l.m, lay, l.ctx.peers, l.ctx.epoch,
               l.ctx.wd, l.ctx.trace};
  all_gather_kernel<<<grid, kThreads, 0, stream>>>(g);
  return hipGetLastError();
}

}  // namespace jo
