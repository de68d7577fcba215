// What differs between the vendors' GEMM data paths, in one place. An
// ArchTraits names the MMA atom, the copy mode of the stage ring, how
// fragments are addressed and staged, whether they are pipelined, whether a
// group-of-one GEMM may end in the stream-K tail, and the block tiles compiled
// for it. Everything else in gemm/ is written once against these traits.
//
// A CUDA build compiles NvidiaArch's tiles and, as extra tile indices, the AMD
// data path (AmdArch) on the mma.sync atom: B transposed through registers,
// per-load fragment addressing, synchronous copies, no fragment pipelining, no
// stream-K tail, the AMD tile list. The GPU tests run those kernels on NVIDIA,
// so every line of the AMD build but the MFMA atom and the scopes runs
// somewhere (the AMD build itself is compile- and ISA-checked only).
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

// A block tile: BM x BN outputs per workgroup, BK deep k-tiles, WARPS_M x
// WARPS_N warps (waves) of BM/WARPS_M x BN/WARPS_N outputs each, a STAGES-deep
// ring of k-tiles in shared memory. PIPELINE_FRAGS: read the next atom
// k-step's fragments from shared memory while the current MMAs issue (two
// register buffers), where the arch allows it (ArchTraits::kPipelineFrags).
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
// NVIDIA (sm_80+ instructions, run on sm_90). The large tile is 8 warps of
// 64x64, 128x256x64, 3 stages, fragments pipelined: in benchmarks/gemm_engine
// on the H200 (2026-11-29, 16384x3584x8192) it runs 2.04 ms, inside the fused
// kernels too; 4 stages measured the same (2.04) or slower (spill reloads in
// the k-loop); 256x128 moved between 2.29 and 2.67 ms with the loader's
// register use. Pipelined fragments paid for it (+12%) and cost the 4-warp
// 128x128x32 tile (-6%), which gives small row counts more workgroups.
struct NvidiaArch {
  static constexpr const char* kName = "nvidia";
  template <typename T>
  using Atom = MmaSyncAtom<T>;
  using Copy = CpAsyncCopy;
  // Fragment addresses from two per-lane offsets computed once per mainloop
  // (gemm/mainloop.h frag_offsets): k-loop 308 -> 284 instructions.
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
