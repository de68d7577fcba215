"""Eligibility and launch configuration of the fused kernels, as pure Python.

Everything here is derived from the call's shape and the device's properties;
there are no per-shape tables. The functions are unit-tested on CPU.

Terms: `world` is the size of the communication group (the mesh axis), `rows`
the local rows of x (all leading batch dims folded in), `k` the contraction
size seen by the kernel, `n` its output columns.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

ALGORITHMS = ("auto", "xla", "fused", "pipelined")
# dtypes the public functions accept; the fused kernels take the 16-bit ones, and float64 (for checks in
# float64, as JAX's own tests run them) takes the XLA path only.
ACCEPTED_DTYPE_NAMES = ("bfloat16", "float16", "float32", "float64")
FUSED_DTYPE_NAMES = ("bfloat16", "float16")

# Largest group a fused kernel takes: the size of its per-rank pointer table
# (kMaxWorld in csrc/kernels/params.h; a native test checks they agree).
MAX_WORLD = 8
# Rows and columns move in 16-byte vectors of 16-bit elements.
VECTOR_ELEMS = 8


@dataclasses.dataclass(frozen=True)
class TileShape:
  """A block tile compiled into the kernels (csrc/gemm/tile_shapes.h)."""

  index: int
  bm: int
  bn: int
  bk: int
  threads: int
  smem_bytes: int
  stream_k: bool = False  # its group-of-one kernels can end in the stream-K tail
  arch: str = "nvidia"  # the ArchTraits its kernels run (csrc/gemm/arch_traits.h)


def tiles_for_arch(tiles, arch: str | None = None) -> tuple:
  """The compiled tiles of one ArchTraits: `arch`, or the build's own (its first tile's) when None.

  A CUDA build also compiles the AMD data path on the mma.sync atom (arch "amd"), which the
  GPU tests select with JAX_OVERLAP_ARCH_TRAITS=amd (jax_overlap.native.tile_shapes).
  """
  arch = arch or tiles[0].arch
  chosen = tuple(t for t in tiles if t.arch == arch)
  if not chosen:
    raise ValueError(f"no compiled tiles for ArchTraits {arch!r}; this build has {sorted({t.arch for t in tiles})}")
  return chosen


@dataclasses.dataclass(frozen=True)
class GemmGeometry:
  """A fused call's persistent launch as C++ makes it (csrc/kernels/launch.h gemm_geometry).

  The planner reads these figures (jax_overlap.native.gemm_geometry) and never recomputes them:
  the launcher and the plan agree by construction.
  """

  workgroups_per_sm: int  # the kernel's occupancy
  co_resident: int  # workgroups that run at once on this rank's share of the GPU
  comm_workgroups: int  # fetchers / reducers among them
  grid: int  # workgroups launched
  tiles: int  # output tiles of all the world's row blocks
  group_cols: int  # tile columns per band of the walk
  tail_slots: int  # stream-K tail scratch slots of a group of one (0: no tail)
  tail_scratch_bytes: int
  region_bytes: int  # symmetric region of a call with peers (0 at world 1)
  launchable: bool = True  # at least one GEMM workgroup beside the comm workgroups


@dataclasses.dataclass(frozen=True)
class DeviceProps:
  """What the configuration needs to know about one GPU.

  Rates are in units per microsecond. `engine_flops` is the fused kernels'
  GEMM rate and `vendor_flops` the vendor GEMM's (what the XLA path runs);
  `link_bytes` is the peer bandwidth one GPU can pull; `pull_bytes_per_sm` is
  what one fetcher/reducer workgroup moves while GEMM workgroups load the
  memory system. Measured on 2 x H200: a lone workgroup pulls 13-23 GB/s over
  NVLink (benchmarks/p2p), but a fetcher inside the fused ag_matmul, next to
  the GEMM's loads and with its own shard to publish, moved about 3 GB/s at
  32 KiB in flight (benchmarks/results/NOTES.md); sized here for 4 GB/s.
  """

  sm_count: int
  smem_per_block: int
  ranks_per_gpu: int = 1
  l2_bytes: int = 0
  engine_flops: float = 4.1e8
  vendor_flops: float = 7.8e8
  link_bytes: float = 3.7e5
  pull_bytes_per_sm: float = 4.0e3


@dataclasses.dataclass(frozen=True)
class FusedPlan:
  """Launch configuration of one fused call; attribute() is its FFI `config` attribute."""

  tile: int  # TileShape.index
  comm_workgroups: int  # fetchers (ag_matmul) or reducers (matmul_rs); 0 at world 1
  chunk_k: int  # ag_matmul: K columns covered by one ready flag
  tail_slots: int  # group of one: slots of its stream-K tail scratch (0: none)
  tail_scratch_bytes: int  # the scratch result's size
  region_bytes: int  # symmetric region of a call with peers
  est_fused_us: float
  est_xla_us: float

  def attribute(self, *, w_kmajor: bool, region_offset: int, site: int, generation: int) -> dict:
    """Every member of csrc/ffi/common.h FusedConfig, by its name (a CPU test compares the two)."""
    return {"tile": np.int64(self.tile), "comm_workgroups": np.int64(self.comm_workgroups),
            "chunk_k": np.int64(self.chunk_k), "w_kmajor": np.int64(w_kmajor),
            "region_offset": np.int64(region_offset), "region_bytes": np.int64(self.region_bytes),
            "site": np.int64(site), "tail_slots": np.int64(self.tail_slots), "generation": np.int64(generation)}


# geometry(tile, comm_workgroups, chunk_k) -> GemmGeometry: the launch C++ makes of the call being
# planned with that tile (jax_overlap.native.gemm_geometry with the call's shape bound).


def _tile_cost(tile: TileShape, geo: GemmGeometry) -> float:
  """Relative time of a launch: waves of tiles over its GEMM workgroups, a wave costing each SM
  the area of the tiles it runs at once (workgroups that share an SM share its rate); whole
  waves, unless the stream-K tail evens out the last one."""
  waves = geo.tiles / max(geo.co_resident - geo.comm_workgroups, 1)
  return (waves if geo.tail_slots else math.ceil(waves)) * tile.bm * tile.bn * geo.workgroups_per_sm


def choose_tile(candidates) -> tuple:
  """The (tile, geometry) with the least wave-quantized time; ties go to the larger tile."""
  return min(candidates, key=lambda c: (_tile_cost(*c), -c[0].bm * c[0].bn))


def fitting_tiles(tiles, device: DeviceProps) -> list:
  """The compiled tiles whose shared-memory stages a workgroup on this device can hold."""
  return [t for t in tiles if t.smem_bytes <= device.smem_per_block]


def _check_common(dtype_name: str, world: int, k: int, n: int, rows: int) -> str | None:
  if dtype_name not in FUSED_DTYPE_NAMES:
    return f"dtype {dtype_name} (fused kernels take {', '.join(FUSED_DTYPE_NAMES)})"
  if world > MAX_WORLD:
    return f"group of {world} ranks (at most {MAX_WORLD})"
  if k % VECTOR_ELEMS or n % VECTOR_ELEMS:
    return f"k={k} and n={n} must be multiples of {VECTOR_ELEMS}"
  if rows == 0 or k == 0 or n == 0:
    return "empty operand"
  return None


# Fetchers/reducers are sized to move their bytes within this share of the
# GEMM's time: a GEMM workgroup that reaches data not yet moved idles, and on
# two real GPUs too few movers left the GEMM waiting for most of the kernel.
COMM_SHARE = 0.5


def _comm_workgroups(world: int, moved_bytes: float, flops: float, device: DeviceProps, co_resident: int) -> int:
  """Fetchers/reducers to move moved_bytes within COMM_SHARE of the GEMM's time: at least 2, at most
  a quarter of the co-resident workgroups (0 for world 1)."""
  if world == 1:
    return 0
  gemm_us = flops / device.engine_flops
  want = math.ceil(moved_bytes / max(COMM_SHARE * gemm_us * device.pull_bytes_per_sm, 1.0))
  return int(min(max(want, 2), max(co_resident // 4, 1)))


def _estimates(flops: float, pull_bytes: float, device: DeviceProps, geo: GemmGeometry):
  """(fused, xla) time estimates in us: overlapped max vs GEMM then collective."""
  gemm_us = flops / device.engine_flops * geo.co_resident / max(geo.co_resident - geo.comm_workgroups, 1)
  comm_us = pull_bytes / device.link_bytes
  return max(gemm_us, comm_us), flops / device.vendor_flops + comm_us


def _plan_tile(tiles, world: int, moved_bytes: float, flops: float, device: DeviceProps, geometry) -> tuple:
  """(tile, comm_workgroups): each tile with the movers its co-resident workgroups allow, the cheapest."""
  candidates = []
  for tile in tiles:
    comm = _comm_workgroups(world, moved_bytes, flops, device, geometry(tile, 0, 0).co_resident)
    geo = geometry(tile, comm, 0)
    if geo.launchable:
      candidates.append((tile, geo))
  if not candidates:
    return None, 0
  tile, geo = choose_tile(candidates)
  return tile, geo.comm_workgroups


def _decide(algorithm: str, est_fused: float, est_xla: float, world: int) -> str | None:
  """None when the fused path should run, else why not."""
  if algorithm == "fused":
    return None
  if world == 1:
    return "world 1 has no communication to overlap; the vendor GEMM is faster"
  if est_fused >= 0.95 * est_xla:
    return f"cost model predicts fused {est_fused:.0f} us vs xla {est_xla:.0f} us"
  return None


def plan_ag_matmul(*, dtype_name: str, rows: int, k: int, n: int, world: int, device: DeviceProps,
                   tiles, geometry, algorithm: str = "auto") -> tuple[FusedPlan | None, str]:
  """Plan y[world*rows, n] = all_gather(x[rows, k]) @ w[k, n]. Returns (plan, reason)."""
  bad = _check_common(dtype_name, world, k, n, rows)
  if bad:
    return None, bad
  tiles = fitting_tiles(tiles, device)
  if not tiles:
    return None, f"no compiled tile fits {device.smem_per_block} bytes of shared memory per workgroup"
  elem = 2
  pull_bytes = (world - 1) * rows * k * elem
  flops = 2.0 * world * rows * n * k
  tile, fetchers = _plan_tile(tiles, world, pull_bytes, flops, device, geometry)
  if tile is None:
    return None, "no GEMM workgroup left beside the fetchers"
  k_tiles = math.ceil(k / tile.bk)
  # About 8 ready flags along K: GEMM blocks start on a tile once its first
  # chunk has landed, without a flag wait every k-tile.
  chunk_k = tile.bk * max(1, math.ceil(k_tiles / 8))
  if world > 1:  # no more fetchers than chunks of a shard
    fetchers = min(fetchers, math.ceil(rows / tile.bm) * math.ceil(k / chunk_k))
  geo = geometry(tile, fetchers, chunk_k)
  est_fused, est_xla = _estimates(flops, pull_bytes, device, geo)
  why_not = _decide(algorithm, est_fused, est_xla, world)
  if why_not:
    return None, why_not
  return FusedPlan(tile.index, geo.comm_workgroups, chunk_k, geo.tail_slots, geo.tail_scratch_bytes,
                   geo.region_bytes, est_fused, est_xla), "fused"


def plan_matmul_rs(*, dtype_name: str, rows: int, k: int, n: int, world: int, device: DeviceProps,
                   tiles, geometry, algorithm: str = "auto") -> tuple[FusedPlan | None, str]:
  """Plan z[rows/world, n] = reduce_scatter(x[rows, k] @ w[k, n]). Returns (plan, reason)."""
  bad = _check_common(dtype_name, world, k, n, rows)
  if bad:
    return None, bad
  tiles = fitting_tiles(tiles, device)
  if not tiles:
    return None, f"no compiled tile fits {device.smem_per_block} bytes of shared memory per workgroup"
  if rows % world:
    return None, f"rows={rows} not divisible by the group size {world}"
  elem = 2
  flops = 2.0 * rows * n * k
  # Each rank reads its row block from every rank's staged partials.
  pull_bytes = (world - 1) * (rows // world) * n * elem
  tile, reducers = _plan_tile(tiles, world, world * (rows // world) * n * elem, flops, device, geometry)
  if tile is None:
    return None, "no GEMM workgroup left beside the reducers"
  if world > 1:  # no more reducers than tiles of a row block
    reducers = min(reducers, math.ceil(rows // world / tile.bm) * math.ceil(n / tile.bn))
  geo = geometry(tile, reducers, 0)
  est_fused, est_xla = _estimates(flops, pull_bytes, device, geo)
  why_not = _decide(algorithm, est_fused, est_xla, world)
  if why_not:
    return None, why_not
  return FusedPlan(tile.index, geo.comm_workgroups, 0, geo.tail_slots, geo.tail_scratch_bytes, geo.region_bytes,
                   est_fused, est_xla), "fused"
