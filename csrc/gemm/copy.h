// Global -> shared 16-byte copies of the mainloop's stages, by copy mode (an
// ArchTraits' Copy). Every mode has the same three calls: copy16 (zero-filled
// when !valid), commit (closes a group of copies) and wait<kPending> (until at
// most kPending committed groups are still in flight), so the mainloop's
// software pipeline is written once.
#pragma once

#include "platform/gpu.h"

namespace jo::gemm {

// Register-staged load and shared-memory store: the copy has landed when
// copy16 returns, so commit and wait are no-ops and the stage ring degenerates
// to synchronous staging (AMD; gfx950's LDS-direct loads are the upgrade path).
struct SyncCopy {
  static __device__ __forceinline__ void copy16(void* smem, const void* gmem, bool valid) {
    gpu::copy16(smem, gmem, valid);
  }
  static __device__ __forceinline__ void commit() {}
  template <int kPending>
  static __device__ __forceinline__ void wait() {}
};

}  // namespace jo::gemm
