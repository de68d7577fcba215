// The world-1 body of both fused kernels (kPeers == false): no movers and no
// protocol registers, only the plain GEMM (gemm/gemm_tile.h plain_gemm) of
// the call's operands, its tiles traced and a stalled stream-K head recorded
// in the watchdog record (gemm/tile_scheduler.h).
#pragma once

#include <cstdint>

#include "gemm/gemm_tile.h"
#include "kernels/launch.h"
#include "kernels/protocol.h"

namespace jo {

// y: the kernel's `rows` output rows. A stream-K head that waited past the
// watchdog for its tail is a bug of this launch, not a peer's: recorded, the
// call fails as a peer's timeout does, where a trap would end the GPU context.
template <class ML>
__device__ __forceinline__ void local_gemm_role(const FusedGemmArgs<typename ML::Elem>& a, typename ML::Elem* y,
                                                int64_t rows, typename ML::Elem* smem) {
  const gemm::PlainGemm<typename ML::Elem> g{a.x, a.w, a.bias, y, rows, a.n, a.k, a.group_cols};
  gemm::plain_gemm<ML>(g, smem, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x), a.tail,
                       [&](int t, uint64_t t0) { trace_event(a.trace, TraceKind::kGemmTile, t0, t, 0); },
                       [&](uint64_t waited) { record_timeout(a.wd, 0, 0, 1, 0, WaitOn::kTailPartial, waited); });
}

}  // namespace jo
