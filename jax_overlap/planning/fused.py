"""The fused kernels' launch plan and cost model, for any op, derived from shape and device (no per-shape tables).

The planner never computes a launch itself: for each compiled tile it reads the launch C++ would make (`geometry`,
Backend.gemm_geometry with the call's shape bound) and picks the cheapest. `rows`: x's local rows, batch folded in.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jax_overlap.quantization import formats
from jax_overlap.runtime.backend import DeviceProps, GemmGeometry, TileShape

# Movers are sized to move their bytes within this share of the GEMM's time: a GEMM workgroup that reaches data not
# yet moved idles, and on two GPUs too few movers left the GEMM waiting for most of the kernel.
COMM_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class FusedPlan:

  tile: int  # TileShape.index
  comm_workgroups: int  # fetchers or reducers; 0 at world 1
  chunk_k: int  # K columns covered by one ready flag
  tail_slots: int
  tail_scratch_bytes: int
  region_bytes: int
  est_us: float
  est_xla_us: float

  def attribute(self, *, w_kmajor: bool, region_offset: int, site: int, generation: int) -> dict:
    """Every member of csrc/ffi/common.h FusedConfig (a CPU test compares the two)."""
    return {"tile": np.int64(self.tile), "comm_workgroups": np.int64(self.comm_workgroups),
            "chunk_k": np.int64(self.chunk_k), "w_kmajor": np.int64(w_kmajor),
            "region_offset": np.int64(region_offset), "region_bytes": np.int64(self.region_bytes),
            "site": np.int64(site), "tail_slots": np.int64(self.tail_slots), "generation": np.int64(generation)}

  def fingerprint(self) -> list:
    return [self.tile, self.comm_workgroups, self.chunk_k, self.tail_slots]



def _tile_cost(tile: TileShape, geo: GemmGeometry) -> float:
  """Relative time: waves of tiles, each costing an SM the area of the tiles it runs at once (workgroups on one SM
  share its rate); whole waves unless the stream-K tail evens out the last."""
  waves = geo.tiles / max(geo.co_resident - geo.comm_workgroups, 1)
  return (waves if geo.tail_slots else math.ceil(waves)) * tile.bm * tile.bn * geo.workgroups_per_sm


def choose_tile(candidates) -> tuple:
  """Ties go to the larger tile."""
  return min(candidates, key=lambda c: (_tile_cost(*c), -c[0].bm * c[0].bn))


def fitting_tiles(tiles, device: DeviceProps) -> list:
  return [t for t in tiles if t.smem_bytes <= device.smem_per_block]


def _comm_workgroups(world: int, moved_bytes: float, flops: float, device: DeviceProps, co_resident: int) -> int:
  """Movers for moved_bytes within COMM_SHARE of the GEMM: at least 2, at most a quarter of the workgroups."""
  if world == 1:
    return 0
  gemm_us = flops / device.engine_flops
  want = math.ceil(moved_bytes / max(COMM_SHARE * gemm_us * device.pull_bytes_per_sm, 1.0))
  return int(min(max(want, 2), max(co_resident // 4, 1)))


def _estimates(flops: float, pull_bytes: float, device: DeviceProps, geo: GemmGeometry):
  """(fused, xla) us: overlapped max against GEMM then collective."""
  gemm_us = flops / device.engine_flops * geo.co_resident / max(geo.co_resident - geo.comm_workgroups, 1)
  comm_us = pull_bytes / device.link_bytes
  return max(gemm_us, comm_us), flops / device.vendor_flops + comm_us


def _plan_tile(tiles, world: int, moved_bytes: float, flops: float, device: DeviceProps, geometry) -> tuple:
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


def plan(op, *, dtype_name: str, rows: int, k: int, n: int, world: int, device: DeviceProps, tiles,
         geometry) -> tuple[FusedPlan | None, str]:
  """(plan, "fused"), or (None, why not) for an eligible call of `op` (planning.eligible)."""
  tiles = fitting_tiles(tiles, device)
  if not tiles:
    return None, f"no compiled tile fits {device.smem_per_block} bytes of shared memory per workgroup"
  moved_bytes, pull_bytes, flops = op.planning.fused_traffic(rows, k, n, world, formats.itemsize(dtype_name))
  tile, movers = _plan_tile(tiles, world, moved_bytes, flops, device, geometry)
  if tile is None:
    return None, f"no GEMM workgroup left beside the {op.planning.movers}"
  chunk_k = op.planning.fused_chunk_k(tile, k)
  if world > 1:  # no more movers than units of work
    movers = min(movers, op.planning.fused_units(rows, k, n, world, tile, chunk_k))
  geo = geometry(tile, movers, chunk_k)
  est_us, est_xla_us = _estimates(flops, pull_bytes, device, geo)
  return FusedPlan(tile.index, geo.comm_workgroups, chunk_k, geo.tail_slots, geo.tail_scratch_bytes,
                   geo.region_bytes, est_us, est_xla_us), "fused"
