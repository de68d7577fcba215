// The mainloop of every GEMM kernel, for both vendors: C[BM x BN] += A[BM x K]
// * B[K x BN] through a STAGES-deep ring of k-tiles in swizzled shared memory.
// A rows are given as row pointers, so callers can map gathered or batched rows
// freely; B is w, [K, N] (kNMajor) or [N, K] (kKMajor). Preconditions checked
// by the callers' dispatch: K % 8 == 0 and N % 8 == 0 (16-byte chunks are
// all-in or all-out of bounds), 16-byte aligned buffers.
#pragma once

#include <type_traits>

#include "gemm/arch_traits.h"
#include "gemm/smem_tile.h"
#include "platform/gpu.h"

namespace jo::gemm {

enum class BLayout : int { kNMajor = 0, kKMajor = 1 };

template <typename T, class Arch_, class Shape, BLayout kBLayout>
struct Mainloop {
  using Elem = T;
  using Arch = Arch_;
  using Atom = typename Arch::template Atom<T>;
  using Copy = typename Arch::Copy;
  using FragA = typename Atom::FragA;
  using FragB = typename Atom::FragB;
  using FragC = typename Atom::FragC;

  static constexpr int BM = Shape::BM;
  static constexpr int BN = Shape::BN;
  static constexpr int BK = Shape::BK;
  static constexpr int WARPS_M = Shape::WARPS_M;
  static constexpr int WARPS_N = Shape::WARPS_N;
  static constexpr int STAGES = Shape::STAGES;
  static constexpr int kThreads = Shape::kThreads;
  static constexpr bool kPipelineFrags = Shape::PIPELINE_FRAGS && Arch::kPipelineFrags;
  static constexpr bool kLaneAddressing = Arch::kLaneAddressing;
  static constexpr bool kBKMajor = kBLayout == BLayout::kKMajor;
  // B's layout in shared memory: as in global memory, unless the arch stages
  // it k-contiguous (AMD: MFMA reads B that way), when an [N, K] w is
  // transposed through registers while it is copied.
  static constexpr bool kBSmemKMajor = kBKMajor || Arch::kStageBKMajor;
  static_assert(kBSmemKMajor || !Atom::kNeedsKMajorB, "this atom reads B k-contiguous only");
  static_assert(!kLaneAddressing || Atom::kHasLaneAddressing, "lane addressing needs the atom's lane coordinates");

  using ATile = SmemTile<T, BM, BK>;                                                           // (BM, BK)
  using BTile = std::conditional_t<kBSmemKMajor, SmemTile<T, BN, BK>, SmemTile<T, BK, BN>>;  // (BN, BK) | (BK, BN)
  static constexpr int kStageElems = ATile::kElems + BTile::kElems;
  static constexpr int kSmemBytes = STAGES * kStageElems * static_cast<int>(sizeof(T));

  static constexpr int WTM = BM / WARPS_M;  // warp tile rows
  static constexpr int WTN = BN / WARPS_N;  // warp tile cols
  static constexpr int MI = WTM / Atom::kM;        // atoms per warp tile, M
  static constexpr int NI = WTN / Atom::kN;        // atoms per warp tile, N
  static_assert(WTM % Atom::kM == 0 && WTN % Atom::kN == 0, "warp tile is whole atoms");
  static_assert(NI % Atom::kBFragsPerLoad == 0, "B fragments load in groups");
  static_assert(BK % Atom::kK == 0, "BK is whole atoms");

  static constexpr int kVec = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte chunk
  static constexpr int kAChunksPerRow = BK / kVec;
  static constexpr int kARowsPerPass = kThreads / kAChunksPerRow;
  static constexpr int kAPasses = BM / kARowsPerPass;
  static_assert(kThreads % kAChunksPerRow == 0 && BM % kARowsPerPass == 0, "A loads tile evenly");
  static constexpr int kBRows = kBKMajor ? BN : BK;
  static constexpr int kBChunksPerRow = (kBKMajor ? BK : BN) / kVec;
  static constexpr int kBRowsPerPass = kThreads / kBChunksPerRow;
  static constexpr int kBPasses = kBRows / kBRowsPerPass;
  static_assert(kThreads % kBChunksPerRow == 0 && kBRows % kBRowsPerPass == 0, "B loads tile evenly");

  struct Acc {
    FragC c[MI][NI];
  };

  // The A rows this thread copies, as pointers to k = 0 (nullptr: no such row,
  // the shared tile gets zeros).
  struct ARows {
    const T* p[kAPasses];
  };

  struct BSource {
    const T* w;
    int64_t ld;  // row stride of w in elements
    int n0;      // first column of the tile
    int N;
  };

  // RowFn(tile_row) -> const T* or nullptr.
  template <class RowFn>
  static __device__ __forceinline__ ARows a_rows(RowFn&& row_fn) {
    ARows rows;
#pragma unroll
    for (int pass = 0; pass < kAPasses; ++pass)
      rows.p[pass] = row_fn(static_cast<int>(threadIdx.x) / kAChunksPerRow + pass * kARowsPerPass);
    return rows;
  }

  static __device__ __forceinline__ void load_stage(T* stage, const ARows& a, const BSource& b, int k0,
                                                    int K) {
    T* sa = stage;
    T* sb = stage + ATile::kElems;
    const int t = static_cast<int>(threadIdx.x);
    {
      const int c = t % kAChunksPerRow;
      const int k = k0 + c * kVec;
#pragma unroll
      for (int pass = 0; pass < kAPasses; ++pass) {
        const int row = t / kAChunksPerRow + pass * kARowsPerPass;
        const bool ok = a.p[pass] != nullptr && k < K;
        Copy::copy16(sa + ATile::offset(row, c * kVec), ok ? a.p[pass] + k : b.w, ok);
      }
    }
    {
      const int c = t % kBChunksPerRow;
#pragma unroll
      for (int pass = 0; pass < kBPasses; ++pass) {
        const int row = t / kBChunksPerRow + pass * kBRowsPerPass;
        int k, n;
        if constexpr (kBKMajor) {
          n = b.n0 + row;
          k = k0 + c * kVec;
        } else {
          k = k0 + row;
          n = b.n0 + c * kVec;
        }
        const bool ok = k < K && n < b.N;
        const T* src = kBKMajor ? b.w + n * b.ld + k : b.w + k * b.ld + n;
        if constexpr (kBSmemKMajor && !kBKMajor) {
          // 8 consecutive n at one k -> 8 rows of the [BN, BK] tile.
          const gpu::Vec16 v = ok ? gpu::load16(src) : gpu::Vec16{{0u, 0u, 0u, 0u}};
          T vals[kVec];
          __builtin_memcpy(vals, &v, sizeof(v));
#pragma unroll
          for (int i = 0; i < kVec; ++i) sb[BTile::offset(c * kVec + i, row)] = vals[i];
        } else {
          Copy::copy16(sb + BTile::offset(row, c * kVec), ok ? src : b.w, ok);
        }
      }
    }
  }

  // Copies of interior tiles (every A row present, all BN columns inside w,
  // K a multiple of BK) need no bounds checks, so each thread keeps running
  // source pointers instead of re-deriving addresses and predicates from
  // (row, k, n) for each 16-byte chunk of every k-tile: in the k-loop that
  // integer work competed with the MMAs for issue slots and registers.
  static constexpr bool kHasFastLoad = !(kBSmemKMajor && !kBKMajor);  // not for B transposed in registers
  // plain_gemm's pipeline across tiles (gemm_tile.h), for the 8-warp tile that
  // has an SM to itself: the 4-warp tile shares its SM with a second
  // workgroup, which hides its epilogue, and ran 22% slower with it
  // (docs/performance.md, "Where the code's constants come from").
  static constexpr bool kCrossTilePipeline = kHasFastLoad && kPipelineFrags;
  // The stream-K tail (gemm/tile_scheduler.h StreamKScheduler) runs inside
  // that pipeline, where the arch has it.
  static constexpr bool kStreamK = kCrossTilePipeline && Arch::kStreamK;

  struct FastCursor {
    const T* a[kAPasses];  // this thread's A chunk of each pass, at the next k-tile
    const T* b;            // its first B chunk, at the next k-tile
    int b_pass;            // elements between its B chunks of consecutive passes
    int b_k_tile;          // elements its B chunks move per k-tile
  };

  static __device__ __forceinline__ FastCursor fast_cursor(const ARows& a, const BSource& b) {
    FastCursor c;
    const int t = static_cast<int>(threadIdx.x);
#pragma unroll
    for (int pass = 0; pass < kAPasses; ++pass) c.a[pass] = a.p[pass] + (t % kAChunksPerRow) * kVec;
    const int row = t / kBChunksPerRow;
    const int col = (t % kBChunksPerRow) * kVec;
    c.b = kBKMajor ? b.w + (b.n0 + row) * b.ld + col : b.w + row * b.ld + b.n0 + col;
    c.b_pass = kBRowsPerPass * static_cast<int>(b.ld);
    c.b_k_tile = kBKMajor ? BK : BK * static_cast<int>(b.ld);
    return c;
  }

  static __device__ __forceinline__ void load_stage_fast(T* stage, FastCursor& c) {
    T* sa = stage;
    T* sb = stage + ATile::kElems;
    const int t = static_cast<int>(threadIdx.x);
#pragma unroll
    for (int pass = 0; pass < kAPasses; ++pass) {
      const int row = t / kAChunksPerRow + pass * kARowsPerPass;
      Copy::copy16(sa + ATile::offset(row, t % kAChunksPerRow * kVec), c.a[pass], true);
      c.a[pass] += BK;
    }
#pragma unroll
    for (int pass = 0; pass < kBPasses; ++pass) {
      const int row = t / kBChunksPerRow + pass * kBRowsPerPass;
      Copy::copy16(sb + BTile::offset(row, t % kBChunksPerRow * kVec), c.b + pass * c.b_pass, true);
    }
    c.b += c.b_k_tile;
  }

  // Whether this tile takes load_stage_fast (uniform across the block; the
  // bound on ld keeps the cursor's element strides in 32 bits).
  static __device__ __forceinline__ bool interior(const ARows& a, const BSource& b, int K) {
    bool rows = true;
#pragma unroll
    for (int pass = 0; pass < kAPasses; ++pass) rows = rows && a.p[pass] != nullptr;
    const bool all_rows = gpu::block_all(rows);
    return all_rows && K % BK == 0 && b.n0 + BN <= b.N && b.ld <= kMaxFastLd;
  }
  static constexpr int64_t kMaxFastLd = (int64_t{1} << 24) / BK;

  // Whether every tile of a rows x n x k GEMM (w's row stride ld) is interior.
  static __host__ __device__ constexpr bool interior_gemm(int64_t rows, int n, int k, int64_t ld) {
    return rows % BM == 0 && n % BN == 0 && k % BK == 0 && ld <= kMaxFastLd;
  }

  // The k-tile loaders a mainloop runs with: load(stage, kt) copies k-tile
  // kt, called for kt = 0, 1, 2, ... in order.
  struct CheckedLoader {
    ARows a;  // copies, not references: a reference gives the struct an address,
    BSource b;  // which puts it in scratch memory on AMD
    int K;
    __device__ __forceinline__ void load(T* stage, int kt) { load_stage(stage, a, b, kt * BK, K); }
  };
  struct FastLoader {
    FastCursor c;
    __device__ __forceinline__ void load(T* stage, int /*kt*/) { load_stage_fast(stage, c); }
  };

  struct Frags {
    FragA a[MI];
    FragB b[NI];
  };

  // Byte offsets, within a stage, of this lane's ldmatrix row for its warp's
  // A fragment 0 and B fragment pair 0 at k-step 0 (kLaneAddressing atoms;
  // zero otherwise). Every other fragment's offset is one of these moved by a
  // constant (frag_a / frag_b): the swizzle permutes 16-byte chunks within
  // aligned groups by the row's low 3 bits, which whole 8-row moves keep, so
  // k-steps (A, K-major B) and column groups (N-major B) enter as XORs of
  // chunk bits and row moves as additions. Computed once per mainloop, they
  // keep the swizzle arithmetic out of the k-loop.
  struct FragOffsets {
    uint32_t a;
    uint32_t b;
  };

  static __host__ __device__ constexpr FragOffsets frag_offsets(int lane, int wm, int wn) {
    if constexpr (kLaneAddressing) {
      const int b_elem = kBSmemKMajor ? BTile::offset(wn * WTN + Atom::template b_row<true>(lane),
                                                      Atom::template b_col<true>(lane))
                                      : BTile::offset(Atom::template b_row<false>(lane),
                                                      wn * WTN + Atom::template b_col<false>(lane));
      return {static_cast<uint32_t>(sizeof(T)) *
                  static_cast<uint32_t>(ATile::offset(wm * WTM + Atom::a_row(lane), Atom::a_col(lane))),
              static_cast<uint32_t>(sizeof(T)) * static_cast<uint32_t>(ATile::kElems + b_elem)};
    } else {
      return {0u, 0u};
    }
  }
  static __host__ __device__ constexpr uint32_t frag_a(FragOffsets o, int i, int step) {
    return (o.a ^ static_cast<uint32_t>(step * Atom::kK * sizeof(T))) + static_cast<uint32_t>(i * Atom::kM * ATile::kRowBytes);
  }
  static __host__ __device__ constexpr uint32_t frag_b(FragOffsets o, int j, int step) {
    return kBSmemKMajor
               ? (o.b ^ static_cast<uint32_t>(step * Atom::kK * sizeof(T))) + static_cast<uint32_t>(j * Atom::kN * BTile::kRowBytes)
               : (o.b ^ static_cast<uint32_t>(j * Atom::kN * sizeof(T))) + static_cast<uint32_t>(step * Atom::kK * BTile::kRowBytes);
  }

  // The identities frag_a / frag_b rest on, checked for every lane, warp,
  // fragment and k-step against the atom's own addressing.
  static constexpr bool frag_offsets_hold() {
    if constexpr (kLaneAddressing) {
      for (int lane = 0; lane < gpu::kWarpSize; ++lane)
        for (int wm = 0; wm < WARPS_M; ++wm)
          for (int wn = 0; wn < WARPS_N; ++wn) {
            const FragOffsets o = frag_offsets(lane, wm, wn);
            for (int step = 0; step < BK / Atom::kK; ++step) {
              const int k0 = step * Atom::kK;
              for (int i = 0; i < MI; ++i) {
                const int want = ATile::offset(wm * WTM + i * Atom::kM + Atom::a_row(lane), k0 + Atom::a_col(lane));
                if (frag_a(o, i, step) != static_cast<uint32_t>(want * sizeof(T))) return false;
              }
              for (int j = 0; j < NI; j += Atom::kBFragsPerLoad) {
                const int n0 = wn * WTN + j * Atom::kN;
                const int want =
                    ATile::kElems +
                    (kBSmemKMajor ? BTile::offset(n0 + Atom::template b_row<true>(lane), k0 + Atom::template b_col<true>(lane))
                                  : BTile::offset(k0 + Atom::template b_row<false>(lane), n0 + Atom::template b_col<false>(lane)));
                if (frag_b(o, j, step) != static_cast<uint32_t>(want * sizeof(T))) return false;
              }
            }
          }
    }
    return true;
  }
  static_assert(frag_offsets_hold(), "fragment offsets: a swizzle or atom layout broke the XOR/add identities");

  static __device__ __forceinline__ FragOffsets frag_offsets() {
    const int warp = static_cast<int>(threadIdx.x) / gpu::kWarpSize;
    return frag_offsets(static_cast<int>(threadIdx.x) % gpu::kWarpSize, warp % WARPS_M, warp / WARPS_M);
  }

  static __device__ __forceinline__ void load_frags(Frags& f, const T* stage, int step, FragOffsets o) {
    if constexpr (kLaneAddressing) {
      const uint32_t base = Atom::smem_addr(stage);
#pragma unroll
      for (int i = 0; i < MI; ++i) Atom::load_a_at(f.a[i], base + frag_a(o, i, step));
#pragma unroll
      for (int j = 0; j < NI; j += Atom::kBFragsPerLoad)
        Atom::template load_b_at<kBSmemKMajor>(&f.b[j], base + frag_b(o, j, step));
    } else {
      const T* sa = stage;
      const T* sb = stage + ATile::kElems;
      const int kk = step * Atom::kK;
      const int warp = static_cast<int>(threadIdx.x) / gpu::kWarpSize;
      const int lane = static_cast<int>(threadIdx.x) % gpu::kWarpSize;
      const int wm = warp % WARPS_M;
      const int wn = warp / WARPS_M;
#pragma unroll
      for (int i = 0; i < MI; ++i) Atom::template load_a<ATile>(f.a[i], sa, wm * WTM + i * Atom::kM, kk, lane);
#pragma unroll
      for (int j = 0; j < NI; j += Atom::kBFragsPerLoad)
        Atom::template load_b<BTile, kBSmemKMajor>(&f.b[j], sb, wn * WTN + j * Atom::kN, kk, lane);
    }
  }

  static __device__ __forceinline__ void mma_frags(Acc& acc, const Frags& f) {
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int j = 0; j < NI; ++j) Atom::mma(acc.c[i][j], f.a[i], f.b[j]);
  }

  static __device__ __forceinline__ void zero(Acc& acc) {
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
      for (int j = 0; j < NI; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc.c[i][j].r[r] = 0.f;
  }

  // acc = A_tile @ B_tile over K. wait_a(kt) runs, uniformly across the block,
  // before the A operand of k-tile kt is copied: the hook in which fused
  // kernels wait for staged rows to arrive. Leaves shared memory free for the
  // next tile.
  template <class WaitA>
  static __device__ __forceinline__ void run(Acc& acc, T* smem, const ARows& a, const BSource& b, int K,
                                                  WaitA&& wait_a) {
    zero(acc);
    const int k_tiles = (K + BK - 1) / BK;
    auto run = [&](auto loader) {
      fill(smem, loader, k_tiles, wait_a);
      compute(acc, smem, loader, k_tiles, wait_a);
    };
    if constexpr (kHasFastLoad) {
      if (interior(a, b, K)) {  // block-uniform
        run(FastLoader{fast_cursor(a, b)});
        return;
      }
    }
    run(CheckedLoader{a, b, K});
  }

  // Software pipeline, in two calls so that a caller can run other work (the
  // previous tile's epilogue) while the first copies are in flight:
  // fill() copies k-tiles 0 .. STAGES - 2 into ring stages 0 .. STAGES - 2
  // (shared memory must be free: run/compute leave it so); compute() runs the
  // k-loop, in which global->shared copies run STAGES-1 k-tiles ahead and,
  // with kPipelineFrags, the fragments of the next atom k-step are read
  // from shared memory while the MMAs of the current one issue. compute()
  // adds to acc.
  //
  // Ring stages rotate: k-tile kt is in stage kt % STAGES, and the copy issued
  // in iteration kt (k-tile kt + STAGES - 1) refills the stage of k-tile
  // kt - 1, which every warp finished reading at iteration kt - 1's barrier.
  // The stage indices are carried from iteration to iteration (a compare and
  // select each) rather than derived from kt.
  template <class Loader, class WaitA>
  static __device__ __forceinline__ void fill(T* smem, Loader& loader, int k_tiles, WaitA&& wait_a) {
#pragma unroll
    for (int kt = 0; kt < STAGES - 1; ++kt) {
      if (kt < k_tiles) {
        wait_a(kt);
        loader.load(smem + kt * kStageElems, kt);
      }
      Copy::commit();
    }
  }

  template <class Loader, class WaitA>
  static __device__ __forceinline__ void compute(Acc& acc, T* smem, Loader& loader, int k_tiles, WaitA&& wait_a) {
    constexpr int kSteps = BK / Atom::kK;  // atom k-steps per k-tile
    static_assert(kSteps % 2 == 0, "fragment buffers alternate, so each k-tile starts on buffer 0");
    const FragOffsets fo = frag_offsets();
    auto next_stage = [](int s) { return s + 1 == STAGES ? 0 : s + 1; };
    auto stage_at = [&](int s) { return smem + s * kStageElems; };
    // Every iteration commits one group (possibly empty), so before
    // iteration kt's wait STAGES - 1 + kt + 1 groups are committed; k-tile
    // kt + 1 is complete once at most STAGES - 2 of them are pending.
    Copy::template wait<STAGES - 2>();
    __syncthreads();
    auto copy = [&](int kt, int s) {
      const int pf = kt + STAGES - 1;
      if (pf < k_tiles) {
        wait_a(pf);
        loader.load(stage_at(s), pf);
      }
      Copy::commit();
    };
    int cur = 0;              // stage of k-tile kt
    int refill = STAGES - 1;  // stage of k-tile kt - 1 (mod STAGES)

    if constexpr (!kPipelineFrags) {
      for (int kt = 0; kt < k_tiles; ++kt) {
        if (kt > 0) {
          Copy::template wait<STAGES - 2>();
          __syncthreads();
        }
        copy(kt, refill);
        const T* stage = stage_at(cur);
#pragma unroll
        for (int step = 0; step < kSteps; ++step) {
          Frags f;
          load_frags(f, stage, step, fo);
          mma_frags(acc, f);
        }
        refill = cur;
        cur = next_stage(cur);
      }
    } else {
      // Fragments of the next atom k-step are read from shared memory while
      // the MMAs of the current one issue.
      Frags frags[2];
      load_frags(frags[0], stage_at(0), 0, fo);
      for (int kt = 0; kt < k_tiles; ++kt) {
        const T* stage = stage_at(cur);
        const int nxt = next_stage(cur);
#pragma unroll
        for (int step = 0; step < kSteps; ++step) {
          if (step == kSteps - 1) {
            // Next k-tile must have landed, and every warp must be done reading
            // the stage of k-tile kt - 1, before anyone refills it below.
            Copy::template wait<STAGES - 2>();
            __syncthreads();
          }
          if (step < kSteps - 1) {
            load_frags(frags[(step + 1) % 2], stage, step + 1, fo);
          } else if (kt + 1 < k_tiles) {
            load_frags(frags[(step + 1) % 2], stage_at(nxt), 0, fo);
          }
          if (step == 0) copy(kt, refill);
          mma_frags(acc, frags[step % 2]);
        }
        refill = cur;
        cur = nxt;
      }
    }
    Copy::template wait<0>();
    __syncthreads();
  }
};

struct NoWait {
  __device__ __forceinline__ void operator()(int) const {}
};

}  // namespace jo::gemm
