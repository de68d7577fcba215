// float8 block scales (DeepSeek-style: x scaled per 1 x 128 block of a row, w per 128 x 128 block), laid out
// as cuBLASLt 13.1 reads them (blas/gemm.cc sets the modes):
//   x scales  float32 [k/128][rows], rows fastest: x[r, 128 b : 128 (b + 1)]'s at b * rows + r, over the
//             GEMM's own rows (VEC128_32F on B), so a GEMM over a chunk of rows needs its chunk's scales
//             contiguous in this layout. rows a multiple of 4 (130 rows had no algorithm).
//   w scales  float32 [n/128][kb_pad] for w K-major ([n, k]): w[128 c :, 128 b :]'s at c * kb_pad + b, with
//             kb_pad = k/128 rounded up to a multiple of 4 (BLK128x128_32F on A; k/128 = 5 read a row stride
//             of 8).
// k and n are multiples of 128; each scale pointer is 16-byte aligned, as tensor scales are (blas::kScaleAlign).
#pragma once

#include <cstdint>

namespace jo {

// jax_overlap/quantization/scaling.py mirrors these three; a CPU test compares them.
inline constexpr int64_t kScaleBlock = 128;
inline constexpr int64_t kScaleRowMultiple = 4;
// w's scale rows are padded to a multiple of this many blocks of k.
inline constexpr int64_t kWScaleRowAlign = 4;

constexpr int64_t k_blocks(int64_t k) { return k / kScaleBlock; }
// Floats from one 128-column block of w's scales to the next (kb_pad: k/128 rounded up to a multiple of 4).
constexpr int64_t w_scale_row_stride(int64_t k) {
  return (k_blocks(k) + kWScaleRowAlign - 1) / kWScaleRowAlign * kWScaleRowAlign;
}
constexpr int64_t x_block_scales(int64_t rows, int64_t k) { return k_blocks(k) * rows; }
constexpr int64_t w_block_scales(int64_t n, int64_t k) { return n / kScaleBlock * w_scale_row_stride(k); }

}  // namespace jo
