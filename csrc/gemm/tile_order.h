// Order in which a persistent kernel walks the output tiles of one GEMM: in
// bands of `group_cols` tile columns, all rows of a band before the next, so
// the band's columns of w (group_cols * BN * K elements, sized by the host to
// half the L2) stay in L2 while every row of A streams past them.
#pragma once

#include <cstdint>

#include "platform/gpu.h"

namespace jo::gemm {

struct TileCoord {
  int row;
  int col;
};

JO_HOST_DEVICE TileCoord tile_coord(int t, int row_tiles, int col_tiles, int group_cols) {
  const int band = t / (row_tiles * group_cols);
  const int first_col = band * group_cols;
  const int cols = col_tiles - first_col < group_cols ? col_tiles - first_col : group_cols;
  const int within = t - band * row_tiles * group_cols;
  return TileCoord{within / cols, first_col + within % cols};
}

// Tile columns per band: as many as keep their slice of w within half the L2.
inline int band_columns(int col_tiles, int bn, int64_t k, int elem_bytes, int64_t l2_bytes) {
  const int64_t per_col = static_cast<int64_t>(bn) * k * elem_bytes;
  int64_t cols = per_col > 0 ? (l2_bytes / 2) / per_col : col_tiles;
  if (cols < 1) cols = 1;
  return cols > col_tiles ? col_tiles : static_cast<int>(cols);
}

}  // namespace jo::gemm
