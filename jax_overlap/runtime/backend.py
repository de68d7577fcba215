"""The machine a process runs on: the native module, its GPUs and host, and the runtime's state. The package asks
it only through `current()`, so tests swap in a stand-in native module (tests/fake_gpu.py) under the real code."""

from __future__ import annotations

import dataclasses
import socket
import threading
from typing import Callable

import jax

from jax_overlap.runtime import native, settings

_XLA_PLATFORM = {"cuda": "CUDA", "rocm": "ROCM"}


@dataclasses.dataclass(frozen=True)
class TileShape:
  """A block tile compiled into the kernels (csrc/gemm/tile_shapes.h)."""

  index: int
  bm: int
  bn: int
  bk: int
  threads: int
  smem_bytes: int
  stream_k: bool = False
  arch: str = "nvidia"  # csrc/gemm/arch_traits.h ArchTraits


def tiles_for_arch(tiles, arch: str | None = None) -> tuple:
  arch = arch or tiles[0].arch
  chosen = tuple(t for t in tiles if t.arch == arch)
  if not chosen:
    raise ValueError(f"no compiled tiles for ArchTraits {arch!r}; this build has {sorted({t.arch for t in tiles})}")
  return chosen


@dataclasses.dataclass(frozen=True)
class GemmGeometry:
  """A fused launch as C++ makes it (csrc/kernels/launch.h gemm_geometry): the planner never recomputes it."""

  workgroups_per_sm: int
  co_resident: int  # workgroups that run at once on this rank's share of the GPU
  comm_workgroups: int  # fetchers / reducers among them
  grid: int
  tiles: int  # output tiles of all the world's row blocks
  group_cols: int
  tail_slots: int
  tail_scratch_bytes: int
  region_bytes: int
  launchable: bool = True  # at least one GEMM workgroup beside the comm workgroups


@dataclasses.dataclass(frozen=True)
class DeviceProps:
  """One GPU to the fused planner, rates per microsecond: engine_flops the fused kernels' GEMM, vendor_flops the
  vendor GEMM's, link_bytes one GPU's peer pull, pull_bytes_per_sm one mover's while the GEMMs load memory
  (docs/performance.md, "Where the code's constants come from")."""

  sm_count: int
  smem_per_block: int
  ranks_per_gpu: int = 1
  l2_bytes: int = 0
  engine_flops: float = 4.1e8
  vendor_flops: float = 7.8e8
  link_bytes: float = 3.7e5
  pull_bytes_per_sm: float = 4.0e3


@dataclasses.dataclass
class LocalDevice:
  global_id: int
  ordinal: int
  pci_bus_id: str
  sm_count: int
  smem_per_block: int
  l2_bytes: int
  name: str
  arch: str
  ranks_per_gpu: int = 1
  copy_path: str = ""  # csrc/pipelined/copy.h's path, once initialize() verified it


@dataclasses.dataclass
class State:
  """What the runtime has set up (workspace.py keeps it; shutdown() clears all but `agreed`)."""

  prepared: bool = False  # device states made
  active: bool = False    # workspaces allocated and peers mapped
  setup_failed: str | None = None
  workspace_full_noted: bool = False
  workspace_bytes: int = 0
  watchdog_seconds: float = 0.0
  on_timeout: str = "abort"
  sync_after_launch: bool = False
  trace: bool = False
  devices: dict = dataclasses.field(default_factory=dict)  # global id -> LocalDevice
  reachable: set = dataclasses.field(default_factory=set)  # global ids mapped into this process
  hosts: dict | None = None  # global id -> host, of every process's GPUs
  regions: dict = dataclasses.field(default_factory=dict)  # key -> (offset, nbytes)
  sites: dict = dataclasses.field(default_factory=dict)  # region key -> {site name: number}
  next_offset: int = 0
  link_bytes_per_us: float | None = None
  local_bytes_per_us: float | None = None
  copies_on_sms: tuple | None = None
  clears: int = 0
  agreed: dict = dataclasses.field(default_factory=dict)  # processes.agree()'s outcomes by key-value name


class Backend:
  """`native` (compiled, a stand-in, or None) for `platform`, this process's GPUs (`gpus()`), host name and State."""

  def __init__(self, native_module, platform: str | None, *, gpus: Callable | None = None,
               host: Callable = socket.gethostname):
    self.native = native_module
    self.platform = platform
    self.state = State()
    self.lock = threading.RLock()
    self._gpus = gpus
    self._host = host
    self._registered = False
    self._compiled_tiles = None

  def local_gpus(self) -> list:
    if self._gpus is not None:
      return list(self._gpus())
    if self.platform is None:
      return []
    try:
      return jax.local_devices(backend=self.platform)
    except RuntimeError:
      return []

  def hostname(self) -> str:
    return self._host()

  def register_targets(self) -> None:
    """Once, from the GPU lowering: queued before the GPU backend exists, a handler may precede its state type."""
    if self._registered or self.native is None:
      return
    with self.lock:
      if self._registered:
        return
      xla_platform = _XLA_PLATFORM[self.platform]
      for name, registration in self.native.type_registrations().items():
        jax.ffi.register_ffi_type(name, registration, platform=xla_platform)
      for name, stages in self.native.registrations().items():
        jax.ffi.register_ffi_target(name, stages, platform=xla_platform)
      self._registered = True

  def target(self, name: str) -> str:
    return self.native.targets()[name]

  def compiled_tile_shapes(self) -> tuple[TileShape, ...]:
    if self._compiled_tiles is None:
      self._compiled_tiles = tuple(TileShape(**d) for d in self.native.tile_shapes())
    return self._compiled_tiles

  def tile_shapes(self) -> tuple[TileShape, ...]:
    """The build's own ArchTraits' tiles, or JAX_OVERLAP_ARCH_TRAITS's (debug: "amd" on a CUDA build)."""
    compiled = self.compiled_tile_shapes()
    if not compiled:
      return ()
    arch = settings.arch_traits()
    try:
      return tiles_for_arch(compiled, arch)
    except ValueError as e:
      raise ValueError(f"jax_overlap: {settings.ARCH_TRAITS}={arch!r}: {e}") from None

  def gemm_geometry(self, op: str, tile: TileShape, comm_workgroups: int, chunk_k: int, *, dtype_name: str,
                    w_kmajor: bool, world: int, batch: int, m: int, k: int, n: int, device: DeviceProps,
                    workgroups_per_sm: int = 0) -> GemmGeometry:
    """m: ag_matmul's local rows, matmul_rs's total rows, per batch element; workgroups_per_sm 0: the current GPU's."""
    return GemmGeometry(**self.native.gemm_geometry(
        op, tile.index, dtype_name, w_kmajor, world, batch, m, k, n, chunk_k, comm_workgroups, device.sm_count,
        device.ranks_per_gpu, device.l2_bytes, workgroups_per_sm))


_current = Backend(native.module(), native.platform())


def current() -> Backend:
  return _current
