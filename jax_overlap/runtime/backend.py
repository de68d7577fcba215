"""The machine a process runs on, as one object: the native module, its GPUs and host, and what is set up on them.

Everything the runtime, the planner and the lowering ask of the machine goes
through `current()`: the native module's functions (set-up, measurements,
sizes, launch geometry, FFI targets), this process's GPUs and host name, and the
runtime's state on them (runtime/workspace.py). Tests put another Backend in its place,
such as one over a stand-in native module that takes CPU devices for GPUs
(tests/fake_gpu.py): the real runtime, planner and lowering then run on it,
from a fresh state.

Also here, what the build and the GPU say that the fused planner reads: the
compiled tiles, their launch geometry as C++ computes it, the device's
properties.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
from typing import Callable

import jax

from jax_overlap.runtime import native, settings

# jax platform names of the GPU backends, and XLA's names for the same.
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
  stream_k: bool = False  # its group-of-one kernels can end in the stream-K tail
  arch: str = "nvidia"  # the ArchTraits its kernels run (csrc/gemm/arch_traits.h)


def tiles_for_arch(tiles, arch: str | None = None) -> tuple:
  """The compiled tiles of one ArchTraits: `arch`, or the build's own (its first tile's) when None.

  A CUDA build also compiles the AMD data path on the mma.sync atom (arch "amd"), which the
  GPU tests select with JAX_OVERLAP_ARCH_TRAITS=amd (Backend.tile_shapes).
  """
  arch = arch or tiles[0].arch
  chosen = tuple(t for t in tiles if t.arch == arch)
  if not chosen:
    raise ValueError(f"no compiled tiles for ArchTraits {arch!r}; this build has {sorted({t.arch for t in tiles})}")
  return chosen


@dataclasses.dataclass(frozen=True)
class GemmGeometry:
  """A fused call's persistent launch as C++ makes it (csrc/kernels/launch.h gemm_geometry).

  The planner reads these figures (Backend.gemm_geometry) and never recomputes them:
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
  """What the fused planner needs to know about one GPU.

  Rates are in units per microsecond. `engine_flops` is the fused kernels'
  GEMM rate and `vendor_flops` the vendor GEMM's (what the XLA path runs);
  `link_bytes` is the peer bandwidth one GPU can pull; `pull_bytes_per_sm` is
  what one fetcher/reducer workgroup moves while GEMM workgroups load the
  memory system. Measured on 2 x H200: a lone workgroup pulls 13-23 GB/s over
  NVLink (benchmarks/p2p), but a fetcher inside the fused ag_matmul, next to
  the GEMM's loads and with its own shard to publish, moved about 3 GB/s at
  32 KiB in flight (git show 6a98e4b:benchmarks/results/NOTES.md); sized here for 4 GB/s.
  """

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
  copy_path: str = ""  # the pipelined copies' path initialize() verified (csrc/pipelined/copy.h), once it has


@dataclasses.dataclass
class State:
  """What the runtime has set up on the machine (runtime/workspace.py keeps it; shutdown() clears all but `agreed`)."""

  prepared: bool = False  # device states made
  active: bool = False    # workspaces allocated and peers mapped
  setup_failed: str | None = None  # why initialize() failed (on every process alike) until shutdown()
  workspace_full_noted: bool = False  # the INFO line saying calls now take the XLA path for want of workspace
  workspace_bytes: int = 0
  watchdog_seconds: float = 0.0
  on_timeout: str = "abort"
  sync_after_launch: bool = False
  trace: bool = False
  devices: dict = dataclasses.field(default_factory=dict)  # global id -> LocalDevice
  reachable: set = dataclasses.field(default_factory=set)  # global ids mapped into this process
  hosts: dict | None = None  # global id -> host of every process's GPUs (agreed), once known
  regions: dict = dataclasses.field(default_factory=dict)  # key -> (offset, nbytes)
  sites: dict = dataclasses.field(default_factory=dict)  # region key -> {site name: number}
  next_offset: int = 0
  link_bytes_per_us: float | None = None   # measured peer pull rate
  local_bytes_per_us: float | None = None  # measured local copy rate
  copies_on_sms: tuple | None = None  # (publish, pulls) on the SMs, once the copy path is known (workspace.py)
  clears: int = 0  # collective clear_errors() calls so far (key-value barrier names)
  # processes.agree()'s outcomes by key-value name (which holds the runtime generation): each taken once.
  agreed: dict = dataclasses.field(default_factory=dict)


class Backend:
  """One machine: `native` (the compiled module's functions, or a stand-in with the same ones; None without a
  build) for `platform` ("cuda" or "rocm"), this process's GPUs (`gpus()`: jax devices, by default those of
  `platform`), its host name (`host()`) and the runtime's State on them."""

  def __init__(self, native_module, platform: str | None, *, gpus: Callable | None = None,
               host: Callable = socket.gethostname):
    self.native = native_module
    self.platform = platform
    self.state = State()
    self.lock = threading.RLock()  # held by every change of the state (workspace.py, processes.py)
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
    except RuntimeError:  # no such backend in this process
      return []

  def hostname(self) -> str:
    return self._host()

  def register_targets(self) -> None:
    """Registers the state type and FFI targets with XLA for the platform, once.

    Called from the GPU lowering rule, i.e. after the GPU backend exists: XLA
    applies registrations queued before backend start-up in an order that can
    put a handler before the state type it uses.
    """
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
    """XLA custom-call target name: "ag_matmul", "ag_matmul_pipelined", "vendor_gemm", "all_gather", ..."""
    return self.native.targets()[name]

  def compiled_tile_shapes(self) -> tuple[TileShape, ...]:
    if self._compiled_tiles is None:
      self._compiled_tiles = tuple(TileShape(**d) for d in self.native.tile_shapes())
    return self._compiled_tiles

  def tile_shapes(self) -> tuple[TileShape, ...]:
    """The compiled tiles the planner takes: the build's own ArchTraits', or those named by
    JAX_OVERLAP_ARCH_TRAITS (debug: "amd" runs the AMD data path on a CUDA build's mma.sync atom)."""
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
    """The launch C++ makes of a fused call (csrc/kernels/launch.h gemm_geometry). m: ag_matmul's local
    rows, matmul_rs's total rows, per batch element. workgroups_per_sm == 0: the kernel's occupancy,
    queried on the current GPU."""
    return GemmGeometry(**self.native.gemm_geometry(
        op, tile.index, dtype_name, w_kmajor, world, batch, m, k, n, chunk_k, comm_workgroups, device.sm_count,
        device.ranks_per_gpu, device.l2_bytes, workgroups_per_sm))


# The installed native module on this process's GPUs. Tests replace it (monkeypatch.setattr(backend, "_current", ...)).
_current = Backend(native.module(), native.platform())


def current() -> Backend:
  return _current
