// What differs between the vendors' GEMM data paths, in one place; the rest
// of gemm/ is written once against these traits.
//
// A CUDA build also compiles the AMD data path (AmdArch) on the mma.sync atom,
// as extra tile indices, so the GPU tests run every line of the AMD build but
// the MFMA atom and the scopes (the AMD build is compile- and ISA-checked only).
#pragma once

#include "gemm/copy.h"
#include "platform/gpu.h"

#if JO_PLATFORM_HIP
#include "gemm/atom_mfma.h"
#else
#include "gemm/atom_mma_sync.h"
#include "gemm/copy_cp_async.h"
#endif

namespace jo::gemm {

// PIPELINE_FRAGS: read the next atom k-step's fragments from shared memory
// while the current MMAs issue (two register buffers), where the arch allows.
template <int BM_, int BN_, int BK_, int WARPS_M_, int WARPS_N_, int STAGES_, bool PIPELINE_FRAGS_>
struct TileShape {
  static constexpr int BM = BM_;
  static constexpr int BN = BN_;
  static constexpr int BK = BK_;
  static constexpr int WARPS_M = WARPS_M_;
  static constexpr int WARPS_N = WARPS_N_;
  static constexpr int STAGES = STAGES_;
  static constexpr bool PIPELINE_FRAGS = PIPELINE_FRAGS_;
  static constexpr int kThreads = WARPS_M * WARPS_N * gpu::kWarpSize;
  static_assert(STAGES >= 2, "the ring needs one stage in flight while one is computed");
};

template <class... Shapes>
struct TileList {
  static constexpr int kCount = sizeof...(Shapes);
};

#if !JO_PLATFORM_HIP
// NVIDIA (sm_80+ instructions, run on sm_90). The large tile's shape, stages
// and pipelined fragments were the fastest measured (docs/performance.md);
// pipelining cost the 4-warp 128x128x32 tile, which gives small row counts
// more workgroups.
struct NvidiaArch {
  static constexpr const char* kName = "nvidia";
  template <typename T>
  using Atom = MmaSyncAtom<T>;
  using Copy = CpAsyncCopy;
  // Fragment addresses from per-lane offsets computed once per mainloop
  // (frag_offsets): fewer k-loop instructions.
  static constexpr bool kLaneAddressing = true;
  // B stays in w's layout in shared memory (ldmatrix.trans reads N-major B).
  static constexpr bool kStageBKMajor = false;
  static constexpr bool kPipelineFrags = true;
  static constexpr bool kStreamK = true;
  //                       BM   BN   BK  WARPS_M WARPS_N STAGES PIPELINE_FRAGS
  using Tiles = TileList<TileShape<128, 256, 64, 2, 4, 3, true>,  //
                         TileShape<128, 128, 32, 2, 2, 4, false>>;
};
#endif

// AMD gfx942 / gfx950 (wave64), on Atom: MfmaAtom in HIP builds, the mma.sync
// atom in CUDA builds (where the same tiles run as warps of 32 lanes: the same
// warp tiles, half the threads per workgroup).
// - B is staged k-contiguous, an [N, K] w transposed through registers while
//   it is copied (MFMA reads B k-contiguous).
// - Fragment addresses are computed per load (the lane-offset path is for
//   ldmatrix's layout).
// - Copies are synchronous (no cp.async on AMD).
// - Fragments are not pipelined: register double-buffering ran gfx942/gfx950
//   out of VGPRs with 8-wave tiles (scratch in the ISA check), and nothing
//   measured says it pays there.
// - No stream-K tail: its code put the 256x128 tile's accumulators in scratch
//   memory (tools/check_isa.py); group-of-one GEMMs run whole tiles.
// - The large tile is 256x128x64 (8 waves of 64x64), which passes the
//   no-scratch ISA check that 128x256 does not; 128x128x32 fits a 64 KiB LDS.
template <template <typename> class AtomT>
struct AmdArch {
  static constexpr const char* kName = "amd";
  template <typename T>
  using Atom = AtomT<T>;
  using Copy = SyncCopy;
  static constexpr bool kLaneAddressing = false;
  static constexpr bool kStageBKMajor = true;
  static constexpr bool kPipelineFrags = false;
  static constexpr bool kStreamK = false;
  //                       BM   BN   BK  WARPS_M WARPS_N STAGES PIPELINE_FRAGS
  using Tiles = TileList<TileShape<256, 128, 64, 4, 2, 3, true>,  //
                         TileShape<128, 128, 32, 2, 2, 4, false>>;
};

template <class... Archs>
struct ArchList {};

// The archs whose tiles this build compiles, the build's own first.
#if JO_PLATFORM_HIP
using NativeArch = AmdArch<MfmaAtom>;
using BuiltArchs = ArchList<NativeArch>;
#else
using NativeArch = NvidiaArch;
using BuiltArchs = ArchList<NativeArch, AmdArch<MmaSyncAtom>>;
#endif

}  // namespace jo::gemm
