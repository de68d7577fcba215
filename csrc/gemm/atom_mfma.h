// AMD MMA atom (gfx942 / gfx950, wave64): v_mfma_f32_16x16x16{bf16_1k,f16},
// fp32 accumulate. Same interface as MmaSyncAtom. Compile-checked and
// ISA-inspected in CI; it has not run on AMD hardware. Included by
// gemm/arch_traits.h in HIP builds.
//
// Operand layouts (lane l of 64):
//   A: A[l % 16][4 * (l / 16) + j], j = 0..3   (4 consecutive k)
//   B: B[4 * (l / 16) + j][l % 16], j = 0..3
//   C: C[4 * (l / 16) + j][l % 16], j = 0..3
#pragma once

#include <cstdint>
#include <type_traits>

namespace jo::gemm {

template <typename T>
struct MfmaAtom {
  static constexpr int kM = 16;
  static constexpr int kN = 16;
  static constexpr int kK = 16;
  static constexpr int kBFragsPerLoad = 1;
  // B fragments are 4 consecutive k per lane: B must be staged k-contiguous.
  static constexpr bool kNeedsKMajorB = true;
  // Fragment addresses are computed per load (the precomputed-address path is
  // for the mma.sync atom's ldmatrix layout).
  static constexpr bool kHasLaneAddressing = false;
  // Accumulator: lane holds C[4 * (lane / 16) + g][lane % 16], one column.
  static constexpr int kCGroups = 4;
  static constexpr int kCVec = 1;

  using Bits4 = short __attribute__((ext_vector_type(4)));
  using Half4 = _Float16 __attribute__((ext_vector_type(4)));
  using Float4 = float __attribute__((ext_vector_type(4)));

  struct FragA {
    Bits4 v;
  };
  struct FragB {
    Bits4 v;
  };
  struct FragC {
    float r[4];
  };

  static __device__ __forceinline__ int c_row(int lane, int g) { return 4 * (lane / 16) + g; }
  static __device__ __forceinline__ int c_col(int lane) { return lane % 16; }

  template <class Tile>
  static __device__ __forceinline__ void load_a(FragA& a, const T* tile, int m0, int k0, int lane) {
    // 4 consecutive k of one row: 8 bytes inside one swizzled 16-byte chunk.
    a.v = *reinterpret_cast<const Bits4*>(tile + Tile::offset(m0 + lane % 16, k0 + 4 * (lane / 16)));
  }

  // B is always staged k-contiguous for this atom (kNeedsKMajorB):
  // Tile is [BN][BK] (row n, col k), one 8-byte read per lane.
  template <class Tile, bool kKMajor>
  static __device__ __forceinline__ void load_b(FragB* b, const T* tile, int n0, int k0, int lane) {
    static_assert(kKMajor, "MFMA reads B k-contiguous from shared memory");
    b[0].v = *reinterpret_cast<const Bits4*>(tile + Tile::offset(n0 + lane % 16, k0 + 4 * (lane / 16)));
  }

  static __device__ __forceinline__ void mma(FragC& c, const FragA& a, const FragB& b) {
    Float4 acc = {c.r[0], c.r[1], c.r[2], c.r[3]};
    if constexpr (std::is_same_v<T, __bf16>) {
      acc = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(a.v, b.v, acc, 0, 0, 0);
    } else {
      static_assert(std::is_same_v<T, _Float16>, "MFMA atom takes bf16 or fp16");
      acc = __builtin_amdgcn_mfma_f32_16x16x16f16(__builtin_bit_cast(Half4, a.v),
                                                  __builtin_bit_cast(Half4, b.v), acc, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) c.r[j] = acc[j];
  }
};

}  // namespace jo::gemm
