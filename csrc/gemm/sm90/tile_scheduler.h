// Persistent tile order of the sm90 GEMM. The unit of the walk is the cluster
// tile: kClusterM x kClusterN CTA tiles (BM x BN each) that one thread-block
// cluster computes together, sharing the operand it multicasts. Cluster c of
// the grid takes cluster tiles c, c + clusters, ... of one walk.
//
// The walk is shard-major with the own shard first: cluster-tile rows are taken
// in row order starting at the one holding the own chunk's first row and
// wrapping, so the tiles that need no remote rows run while the other chunks
// are still arriving. Within that order, `group` cluster-tile rows at a time
// are walked column by column, so the clusters in flight share the x rows and
// w columns they read in L2 (the group is a launch parameter the benchmark
// sweeps).
#pragma once

namespace jo::gemm::sm90 {

struct TileCoord {
  int m0;  // first output row
  int n0;  // first output column
};

template <int BM, int BN, int kClusterM = 1, int kClusterN = 1>
struct PersistentScheduler {
  static constexpr int kRows = BM * kClusterM;  // rows of a cluster tile
  static constexpr int kCols = BN * kClusterN;
  int tiles_m;       // cluster-tile rows
  int tiles_n;       // cluster-tile columns
  int first_tile_m;  // the cluster-tile row holding the own chunk's first row
  int group;

  __host__ __device__ PersistentScheduler(int M, int N, int own_row0, int group_rows)
      : tiles_m((M + kRows - 1) / kRows),
        tiles_n((N + kCols - 1) / kCols),
        first_tile_m(own_row0 / kRows),
        group(group_rows > 0 ? group_rows : 8) {}

  __host__ __device__ int tiles() const { return tiles_m * tiles_n; }

  // The cluster tile's first row and column.
  __device__ TileCoord cluster_tile(int t) const {
    const int per_group = group * tiles_n;
    const int g = t / per_group;
    const int in_group = t - g * per_group;
    const int rows = min(group, tiles_m - g * group);
    const int m = g * group + in_group % rows;
    const int n = in_group / rows;
    int mt = m + first_tile_m;
    if (mt >= tiles_m) mt -= tiles_m;
    return {mt * kRows, n * kCols};
  }

  // The CTA tile of cluster rank `rank` (ranks run along the cluster's longer
  // side; one of kClusterM, kClusterN is 1). A tile past M or N still runs (its
  // loads are zero-filled, its stores dropped): its CTA's half of the shared
  // operand feeds the peer.
  __device__ static TileCoord cta_tile(TileCoord cluster, uint32_t rank) {
    return {cluster.m0 + (kClusterM > 1 ? int(rank) * BM : 0), cluster.n0 + (kClusterN > 1 ? int(rank) * BN : 0)};
  }
};

}  // namespace jo::gemm::sm90
