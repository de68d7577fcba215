// Shared-memory (LDS) tile layout used by every MMA atom: ROWS x COLS elements,
// COLS contiguous, stored in 16-byte chunks whose chunk index is XOR-swizzled
// by the row so that 8 consecutive rows at the same logical chunk land in 8
// distinct 16-byte bank groups. That is what an 8x8 ldmatrix (NVIDIA) or a
// column of 16 lanes' 8-byte reads (AMD) touches, so both are conflict-free.
#pragma once

#include <cstdint>

namespace jo::gemm {

template <typename T, int ROWS, int COLS>
struct SmemTile {
  static constexpr int kRows = ROWS;
  static constexpr int kCols = COLS;
  static constexpr int kElemsPerChunk = 16 / static_cast<int>(sizeof(T));
  static constexpr int kChunksPerRow = COLS / kElemsPerChunk;
  static constexpr int kRowBytes = COLS * static_cast<int>(sizeof(T));
  static constexpr int kElems = ROWS * COLS;
  static constexpr int kBytes = ROWS * kRowBytes;
  static_assert(COLS % kElemsPerChunk == 0, "rows are whole 16-byte chunks");
  static_assert(kRowBytes >= 64, "swizzle needs rows of at least 64 bytes");

  // Rows of >= 128 bytes: XOR the low 3 chunk bits with row % 8. Rows of 64
  // bytes hold 2 rows per 128-byte line: XOR the low 2 bits with (row / 2) % 4.
  static constexpr __host__ __device__ __forceinline__ int chunk(int row, int c) {
    return kRowBytes >= 128 ? (c ^ (row & 7)) : (c ^ ((row >> 1) & 3));
  }
  // Element offset of (row, col); col may point inside a chunk.
  static constexpr __host__ __device__ __forceinline__ int offset(int row, int col) {
    return row * COLS + chunk(row, col / kElemsPerChunk) * kElemsPerChunk + col % kElemsPerChunk;
  }
};

}  // namespace jo::gemm
