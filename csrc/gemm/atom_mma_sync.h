// NVIDIA MMA atom (sm_80+, used on sm_90): mma.sync.m16n8k16, fp32 accumulate,
// fragments loaded from swizzled shared memory with ldmatrix. The
// mainloop sees the interface shared with MfmaAtom (kM/kN/kK, fragment types,
// load_a, load_b, mma, the accumulator coordinates for the epilogue) and, as
// this atom has them (kHasLaneAddressing), the lane coordinates and
// address-taking loads with which NvidiaArch keeps fragment addresses out of
// the k-loop. Included by gemm/arch_traits.h in CUDA builds.
#pragma once

#include <cstdint>
#include <type_traits>

namespace jo::gemm {

template <typename T>
struct MmaSyncAtom {
  static constexpr int kM = 16;
  static constexpr int kN = 8;
  static constexpr int kK = 16;
  // One ldmatrix.x4 for B yields two n8 fragments.
  static constexpr int kBFragsPerLoad = 2;
  // ldmatrix(.trans) reads B in either shared layout.
  static constexpr bool kNeedsKMajorB = false;
  static constexpr bool kHasLaneAddressing = true;
  // Accumulator: lane holds C[lane/4 + 8*g][2*(lane%4) + v], g, v in {0, 1}.
  static constexpr int kCGroups = 2;
  static constexpr int kCVec = 2;

  struct FragA {
    uint32_t r[4];
  };
  struct FragB {
    uint32_t r[2];
  };
  struct FragC {
    float r[4];
  };

  static __device__ __forceinline__ int c_row(int lane, int g) { return lane / 4 + 8 * g; }
  static __device__ __forceinline__ int c_col(int lane) { return 2 * (lane % 4); }

  static __device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
  }

  // The tile element each lane's ldmatrix row pointer addresses, for the
  // fragment at the tile origin. A: Tile is [BM][BK] (row m, col k); matrices
  // of the x4 load, in mma order: (rows 0-7, k 0-7), (rows 8-15, k 0-7),
  // (rows 0-7, k 8-15), (rows 8-15, k 8-15).
  static constexpr __host__ __device__ int a_row(int lane) { return (lane & 7) + ((lane >> 3) & 1) * 8; }
  static constexpr __host__ __device__ int a_col(int lane) { return (lane >> 4) * 8; }
  // B for columns 0..15 and k 0..15, as two n8 fragments.
  // kKMajor == false: Tile is [BK][BN] (row k, col n), read transposed;
  //   matrices (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15).
  // kKMajor == true:  Tile is [BN][BK] (row n, col k), read as is;
  //   matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15).
  template <bool kKMajor>
  static constexpr __host__ __device__ int b_row(int lane) {
    return kKMajor ? (lane & 7) + (lane >> 4) * 8 : (lane & 7) + ((lane >> 3) & 1) * 8;
  }
  template <bool kKMajor>
  static constexpr __host__ __device__ int b_col(int lane) {
    return kKMajor ? ((lane >> 3) & 1) * 8 : (lane >> 4) * 8;
  }

  // A fragment from the shared-memory address of this lane's row.
  static __device__ __forceinline__ void load_a_at(FragA& a, uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(a.r[0]), "=r"(a.r[1]), "=r"(a.r[2]), "=r"(a.r[3])
                 : "r"(addr));
  }

  // Two n8 B fragments from the shared-memory address of this lane's row.
  template <bool kKMajor>
  static __device__ __forceinline__ void load_b_at(FragB* b, uint32_t addr) {
    uint32_t x0, x1, x2, x3;
    if constexpr (kKMajor) {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                   : "=r"(x0), "=r"(x1), "=r"(x2), "=r"(x3)
                   : "r"(addr));
    } else {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                   : "=r"(x0), "=r"(x1), "=r"(x2), "=r"(x3)
                   : "r"(addr));
    }
    b[0].r[0] = x0;
    b[0].r[1] = x1;
    b[1].r[0] = x2;
    b[1].r[1] = x3;
  }

  template <class Tile>
  static __device__ __forceinline__ void load_a(FragA& a, const T* tile, int m0, int k0, int lane) {
    load_a_at(a, smem_addr(tile + Tile::offset(m0 + a_row(lane), k0 + a_col(lane))));
  }

  template <class Tile, bool kKMajor>
  static __device__ __forceinline__ void load_b(FragB* b, const T* tile, int n0, int k0, int lane) {
    const int row = kKMajor ? n0 + b_row<true>(lane) : k0 + b_row<false>(lane);
    const int col = kKMajor ? k0 + b_col<true>(lane) : n0 + b_col<false>(lane);
    load_b_at<kKMajor>(b, smem_addr(tile + Tile::offset(row, col)));
  }

  static __device__ __forceinline__ void mma(FragC& c, const FragA& a, const FragB& b) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
          "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
          : "+f"(c.r[0]), "+f"(c.r[1]), "+f"(c.r[2]), "+f"(c.r[3])
          : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[0]), "r"(b.r[1]));
    } else {
      static_assert(std::is_same_v<T, __half>, "mma.sync atom takes bf16 or fp16");
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
          "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
          : "+f"(c.r[0]), "+f"(c.r[1]), "+f"(c.r[2]), "+f"(c.r[3])
          : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[0]), "r"(b.r[1]));
    }
  }
};

}  // namespace jo::gemm
