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
# dtypes the public functions accept; the fused kernels take the 16-bit ones.
ACCEPTED_DTYPE_NAMES = ("bfloat16", "float16", "float32")
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
  stream_k: bool = False  # its group-of-one kernels can end in the stream-K tail (tail_slots)


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
  engine_flops: float = 4.1e8
  vendor_flops: float = 7.8e8
  link_bytes: float = 3.7e5
  pull_bytes_per_sm: float = 4.0e3


@dataclasses.dataclass(frozen=True)
class FusedPlan:
  """Launch configuration of one fused call (the FFI `config` attribute)."""

  tile: int  # TileShape.index
  workers: int  # fetcher (ag_matmul) or reducer (matmul_rs) workgroups
  chunk_k: int  # ag_matmul: K columns covered by one ready flag
  est_fused_us: float
  est_xla_us: float

  def attribute(self) -> dict:
    return {"tile": np.int64(self.tile), "workers": np.int64(self.workers),
            "chunk_k": np.int64(self.chunk_k)}


def _round_up(a: int, b: int) -> int:
  return -(-a // b) * b


def _tile_cost(tile: TileShape, row_tiles: int, col_tiles: int, slots: int, evened: bool) -> float:
  """Relative time of a tiling: waves of tiles, each costing its area; whole waves unless the
  kernel evens out the last one (the stream-K tail)."""
  waves = row_tiles * col_tiles / max(slots, 1)
  return (waves if evened else math.ceil(waves)) * tile.bm * tile.bn


def choose_tile(tiles, rows: int, n: int, slots: int, groups: int = 1, evened=lambda tile: False) -> TileShape:
  """The compiled tile with the least wave-quantized work for `groups` row blocks of `rows`;
  evened(tile): the kernel runs this tiling with a stream-K tail (tail_slots > 0)."""
  return min(tiles, key=lambda t: (_tile_cost(t, groups * math.ceil(rows / t.bm), math.ceil(n / t.bn), slots,
                                              evened(t)), -t.bm * t.bn))


def fitting_tiles(tiles, device: DeviceProps) -> list:
  """The compiled tiles whose shared-memory stages a workgroup on this device can hold."""
  return [t for t in tiles if t.smem_bytes <= device.smem_per_block]


def tail_slots(tile: TileShape, rows: int, n: int, k: int, device: DeviceProps) -> int:
  """Workgroup slots of a group-of-one call's stream-K tail scratch, 0 for none.

  The tail (csrc/gemm/tile_order.h TailSplit) evens out the last, partial wave
  of output tiles by splitting the k-tiles of the last waves over all
  workgroups; its scratch has one slot per workgroup. The kernel takes it for
  GEMMs of whole tiles only (rows, n and k multiples of the tile;
  csrc/gemm/gemm_tile.h plain_gemm), with the tiles the build compiles it for
  (tile.stream_k: none on AMD). The grid is known here only for tiles of
  which one workgroup fills an SM's shared memory: other tiles, and calls
  whose tiles make whole waves or less than one, run whole tiles only.
  """
  slots = gemm_slots(device)
  tiles = math.ceil(rows / tile.bm) * math.ceil(n / tile.bn)
  whole_tiles = rows % tile.bm == 0 and n % tile.bn == 0 and k % tile.bk == 0
  # w's row stride (n, or k for a transposed w) times bk must stay within the
  # kernel's 32-bit copy strides; checked for both layouts.
  if (not tile.stream_k or not whole_tiles or max(n, k) * tile.bk > 2 ** 24
      or 2 * tile.smem_bytes <= device.smem_per_block or tiles <= slots or tiles % slots == 0):
    return 0
  return slots


def gemm_slots(device: DeviceProps) -> int:
  """Co-resident workgroups one rank may launch (persistent kernels must fit at once)."""
  return max(device.sm_count // max(device.ranks_per_gpu, 1), 1)


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


def _comm_workers(world: int, moved_bytes: float, flops: float, device: DeviceProps, slots: int) -> int:
  """Fetcher/reducer workgroups to move moved_bytes within COMM_SHARE of the GEMM's time (0 for world 1)."""
  if world == 1:
    return 0
  gemm_us = flops / device.engine_flops
  want = math.ceil(moved_bytes / max(COMM_SHARE * gemm_us * device.pull_bytes_per_sm, 1.0))
  return int(min(max(want, 2), max(slots // 4, 1)))


def _estimates(flops: float, pull_bytes: float, device: DeviceProps, slots: int, workers: int):
  """(fused, xla) time estimates in us: overlapped max vs GEMM then collective."""
  gemm_us = flops / device.engine_flops * slots / max(slots - workers, 1)
  comm_us = pull_bytes / device.link_bytes
  return max(gemm_us, comm_us), flops / device.vendor_flops + comm_us


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
                   tiles, algorithm: str = "auto") -> tuple[FusedPlan | None, str]:
  """Plan y[world*rows, n] = all_gather(x[rows, k]) @ w[k, n]. Returns (plan, reason)."""
  bad = _check_common(dtype_name, world, k, n, rows)
  if bad:
    return None, bad
  tiles = fitting_tiles(tiles, device)
  if not tiles:
    return None, f"no compiled tile fits {device.smem_per_block} bytes of shared memory per workgroup"
  slots = gemm_slots(device)
  elem = 2
  pull_bytes = (world - 1) * rows * k * elem
  flops = 2.0 * world * rows * n * k
  workers = _comm_workers(world, pull_bytes, flops, device, slots)
  tile = choose_tile(tiles, rows, n, slots - workers, groups=world,
                     evened=lambda t: world == 1 and tail_slots(t, rows, n, k, device) > 0)
  k_tiles = math.ceil(k / tile.bk)
  # About 8 ready flags along K: GEMM blocks start on a tile once its first
  # chunk has landed, without a flag wait every k-tile.
  chunk_k = tile.bk * max(1, math.ceil(k_tiles / 8))
  if world > 1:  # no more fetchers than chunks of a shard
    workers = min(workers, math.ceil(rows / tile.bm) * math.ceil(k / chunk_k))
  est_fused, est_xla = _estimates(flops, pull_bytes, device, slots, workers)
  why_not = _decide(algorithm, est_fused, est_xla, world)
  if why_not:
    return None, why_not
  return FusedPlan(tile.index, workers, chunk_k, est_fused, est_xla), "fused"


def plan_matmul_rs(*, dtype_name: str, rows: int, k: int, n: int, world: int, device: DeviceProps,
                   tiles, algorithm: str = "auto") -> tuple[FusedPlan | None, str]:
  """Plan z[rows/world, n] = reduce_scatter(x[rows, k] @ w[k, n]). Returns (plan, reason)."""
  bad = _check_common(dtype_name, world, k, n, rows)
  if bad:
    return None, bad
  tiles = fitting_tiles(tiles, device)
  if not tiles:
    return None, f"no compiled tile fits {device.smem_per_block} bytes of shared memory per workgroup"
  if rows % world:
    return None, f"rows={rows} not divisible by the group size {world}"
  slots = gemm_slots(device)
  elem = 2
  flops = 2.0 * rows * n * k
  # Each rank reads its row block from every rank's staged partials.
  pull_bytes = (world - 1) * (rows // world) * n * elem
  workers = _comm_workers(world, world * (rows // world) * n * elem, flops, device, slots)
  tile = choose_tile(tiles, rows // world, n, slots - workers, groups=world,
                     evened=lambda t: world == 1 and tail_slots(t, rows, n, k, device) > 0)
  if world > 1:  # no more reducers than tiles of a row block
    workers = min(workers, math.ceil(rows // world / tile.bm) * math.ceil(n / tile.bn))
  est_fused, est_xla = _estimates(flops, pull_bytes, device, slots, workers)
  why_not = _decide(algorithm, est_fused, est_xla, world)
  if why_not:
    return None, why_not
  return FusedPlan(tile.index, workers, 0, est_fused, est_xla), "fused"
