// Persistent tile order of the sm90 GEMM: CTA b takes tiles b, b + grid, ...
// of one walk over the output tiles. The walk is shard-major with the own
// shard first: row tiles are taken in row order starting at the one holding
// the own chunk's first row and wrapping, so the tiles that need no remote rows
// run while the other chunks are still arriving. Within that order, kGroup
// row tiles at a time are walked column by column, so the CTAs in flight share
// the A rows and B columns they read in L2.
#pragma once

namespace jo::gemm::sm90 {

struct TileCoord {
  int m0;  // first output row
  int n0;  // first output column
};

template <int BM, int BN, int kGroup = 8>
struct PersistentScheduler {
  int tiles_m;
  int tiles_n;
  int first_tile_m;  // the row tile holding the own chunk's first row

  __host__ __device__ PersistentScheduler(int M, int N, int own_row0)
      : tiles_m((M + BM - 1) / BM), tiles_n((N + BN - 1) / BN), first_tile_m(own_row0 / BM) {}

  __host__ __device__ int tiles() const { return tiles_m * tiles_n; }

  __device__ TileCoord coord(int t) const {
    const int per_group = kGroup * tiles_n;
    const int group = t / per_group;
    const int in_group = t - group * per_group;
    const int rows = min(kGroup, tiles_m - group * kGroup);
    const int m = group * kGroup + in_group % rows;
    const int n = in_group / rows;
    int mt = m + first_tile_m;
    if (mt >= tiles_m) mt -= tiles_m;
    return {mt * BM, n * BN};
  }
};

}  // namespace jo::gemm::sm90
