"""The symmetric workspace runtime: lifecycle, peers, regions and errors.

Lifecycle. `initialize()` (called for you by the first fused call's lowering,
or explicitly) allocates one workspace per local GPU, zeroes it, and maps every
peer's workspace into this process: by peer access between the GPUs of one
process, or by IPC handles exchanged once through the `jax.distributed`
key-value store between processes of one host. Devices on other hosts stay
unmapped; groups that span hosts take the XLA path. It is collective: with
several processes, every process must call it (lowering the same program does).

Regions. Each fused call site gets a region of the workspace at an offset
every rank of its group agrees on, keyed by (op, group, shape). Its flags carry
per-region call counters (epochs), so nothing is reset between calls.

Errors. A kernel whose wait on a peer outlives the watchdog records the op,
ranks, flag and epoch in host-mapped memory and exits. The next fused call on
that GPU fails with that record (XlaRuntimeError), and `check_errors()` raises
it as `PeerTimeoutError`. With JAX_OVERLAP_SYNC=1 every fused call waits for
its kernel and fails itself (debugging; it serializes the host).

Settings (environment variables, or initialize()'s arguments):
  JAX_OVERLAP_WORKSPACE_BYTES  workspace per GPU (default 1 GiB)
  JAX_OVERLAP_WATCHDOG_SECONDS bound on every wait on a peer (default 5)
  JAX_OVERLAP_SYNC             "1": surface watchdog errors on the failing call
  JAX_OVERLAP_TRACE            "1": record per-workgroup trace events
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading

import jax

from jax_overlap import config, native

log = logging.getLogger("jax_overlap")

DEFAULT_WORKSPACE_BYTES = 1 << 30
DEFAULT_WATCHDOG_SECONDS = 5.0
_KV_TIMEOUT_MS = 120_000
_REGION_ALIGN = 4096


class PeerTimeoutError(RuntimeError):
  """A fused kernel gave up waiting for a peer. `record` holds op, rank, peer, epoch, flag."""

  def __init__(self, record: dict):
    super().__init__(record["message"])
    self.record = record


class WorkspaceFullError(RuntimeError):
  """A fused call needs more symmetric workspace than is left."""


@dataclasses.dataclass
class _LocalDevice:
  global_id: int
  ordinal: int
  pci_bus_id: str
  sm_count: int
  smem_per_block: int
  name: str
  arch: str
  ranks_per_gpu: int = 1


@dataclasses.dataclass
class _State:
  active: bool = False
  generation: int = 0
  workspace_bytes: int = 0
  watchdog_seconds: float = DEFAULT_WATCHDOG_SECONDS
  sync_after_launch: bool = False
  trace: bool = False
  devices: dict = dataclasses.field(default_factory=dict)  # global id -> _LocalDevice
  reachable: set = dataclasses.field(default_factory=set)  # global ids mapped into this process
  regions: dict = dataclasses.field(default_factory=dict)  # key -> (offset, nbytes)
  next_offset: int = 0


_state = _State()
_lock = threading.RLock()


def _env_flag(name: str) -> bool:
  return os.environ.get(name, "0") not in ("", "0", "false", "False")


def _gpu_devices(local: bool):
  platform = native.platform()
  if platform is None:
    return []
  try:
    return jax.local_devices(backend=platform) if local else jax.devices(platform)
  except RuntimeError:  # no such backend in this process
    return []


def initialize(*, workspace_bytes: int | None = None, watchdog_seconds: float | None = None,
               sync_after_launch: bool | None = None, trace: bool | None = None) -> dict:
  """Sets up the symmetric workspace on every local GPU and maps peers. Idempotent.

  Args:
    workspace_bytes: bytes per GPU (default: $JAX_OVERLAP_WORKSPACE_BYTES or 1 GiB).
      Fixed by the first call; a later call asking for a different size raises.
    watchdog_seconds: bound on every wait on a peer (default: $JAX_OVERLAP_WATCHDOG_SECONDS or 5).
    sync_after_launch: make each fused call of a group of two or more wait for its kernel
      (default: $JAX_OVERLAP_SYNC); calls of a group of one have no peer to time out on and
      may sit in XLA's command buffers, where a host wait cannot run.
    trace: record per-workgroup trace events (default: $JAX_OVERLAP_TRACE); see jax_overlap.tracing.

  Returns workspace_info(). On a machine without a GPU build or GPU this does
  nothing and says what it would have done. Once initialized, a later call
  changes only the options it is given (the first fused call's lowering
  initializes with the defaults).
  """
  if watchdog_seconds is not None and watchdog_seconds <= 0:
    raise ValueError(f"initialize: watchdog_seconds must be positive, got {watchdog_seconds}")
  with _lock:
    if _state.active:
      if workspace_bytes is not None and workspace_bytes != _state.workspace_bytes:
        raise ValueError(f"initialize: the workspace already has {_state.workspace_bytes} bytes per GPU; "
                         f"it cannot change to {workspace_bytes} without jax_overlap.shutdown()")
      _apply_options(_state.watchdog_seconds if watchdog_seconds is None else watchdog_seconds,
                     _state.sync_after_launch if sync_after_launch is None else sync_after_launch,
                     _state.trace if trace is None else trace)
      return workspace_info()
    if workspace_bytes is None:
      workspace_bytes = int(os.environ.get("JAX_OVERLAP_WORKSPACE_BYTES", DEFAULT_WORKSPACE_BYTES))
    header = native.module().REGIONS_OFFSET if native.module() is not None else 0
    if workspace_bytes <= header:
      raise ValueError(f"initialize: workspace_bytes must be larger than the workspace header ({header}), "
                       f"got {workspace_bytes}")
    local = _gpu_devices(local=True)
    if not local:
      why = ("the native extension is not built for a GPU" if native.platform() is None
             else f"this process has no {native.platform()} devices")
      watchdog = watchdog_seconds or float(os.environ.get("JAX_OVERLAP_WATCHDOG_SECONDS", DEFAULT_WATCHDOG_SECONDS))
      log.info("jax_overlap.initialize: nothing to do (%s); on a GPU it would allocate %d bytes per GPU, "
               "map peers, and bound waits by %.1f s", why, workspace_bytes, watchdog)
      return {**workspace_info(), "reason": why}
    _setup(local, workspace_bytes)
    _apply_options(
        float(os.environ.get("JAX_OVERLAP_WATCHDOG_SECONDS", DEFAULT_WATCHDOG_SECONDS))
        if watchdog_seconds is None else watchdog_seconds,
        _env_flag("JAX_OVERLAP_SYNC") if sync_after_launch is None else sync_after_launch,
        _env_flag("JAX_OVERLAP_TRACE") if trace is None else trace)
    return workspace_info()


def _apply_options(watchdog_seconds: float, sync_after_launch: bool, trace: bool) -> None:
  _state.watchdog_seconds = watchdog_seconds
  _state.sync_after_launch = sync_after_launch
  _state.trace = trace
  for d in _state.devices.values():
    native.module().set_options(d.ordinal, watchdog_seconds, sync_after_launch, trace)


def _setup(local, workspace_bytes: int) -> None:
  nat = native.module()
  _state.generation += 1
  _state.devices = {}
  for d in local:
    nat.init_device(d.local_hardware_id, d.id, workspace_bytes)
    info = nat.device_info(d.local_hardware_id)
    _state.devices[d.id] = _LocalDevice(d.id, d.local_hardware_id, info["pci_bus_id"], info["sm_count"],
                                        info["smem_per_block"], info["name"], info["arch"])
  if jax.process_count() == 1:
    for a in _state.devices.values():
      for b in _state.devices.values():
        nat.map_local_peer(a.ordinal, b.ordinal)
    _state.reachable = set(_state.devices)
  else:
    _exchange_handles()
  _state.workspace_bytes = workspace_bytes
  _state.next_offset = nat.REGIONS_OFFSET
  _state.regions = {}
  _state.active = True
  log.debug("jax_overlap: workspace of %d bytes on %d GPU(s); %d peer(s) reachable", workspace_bytes,
            len(_state.devices), len(_state.reachable))


def _kv_client():
  from jax._src import distributed  # the coordination service's key-value store
  client = distributed.global_state.client
  if client is None:
    raise RuntimeError("jax_overlap: several processes need jax.distributed.initialize() before "
                       "jax_overlap.initialize()")
  return client


def _exchange_handles() -> None:
  """Publish this process's IPC handles and import those of every device on this host."""
  nat = native.module()
  client = _kv_client()
  host = socket.gethostname()
  prefix = f"jax_overlap/{_state.generation}/device"
  for d in _state.devices.values():
    client.key_value_set(f"{prefix}/{d.global_id}", json.dumps(
        {"host": host, "pci": d.pci_bus_id, "handle": nat.export_handle(d.ordinal).hex()}))
  peers = {}
  for dev in _gpu_devices(local=False):
    if dev.id in _state.devices:
      peers[dev.id] = {"host": host, "pci": _state.devices[dev.id].pci_bus_id}
    else:
      peers[dev.id] = json.loads(client.blocking_key_value_get(f"{prefix}/{dev.id}", _KV_TIMEOUT_MS))
  _state.reachable = set()
  for gid, peer in peers.items():
    if peer["host"] != host:
      continue
    for d in _state.devices.values():
      if gid in _state.devices:
        nat.map_local_peer(d.ordinal, _state.devices[gid].ordinal)
      else:
        nat.import_peer(d.ordinal, gid, bytes.fromhex(peer["handle"]))
    _state.reachable.add(gid)
  for d in _state.devices.values():
    # Ranks on one physical GPU (emulated groups) split its SMs, so that all
    # their persistent kernels are co-resident.
    d.ranks_per_gpu = sum(1 for p in peers.values() if p["host"] == host and p["pci"] == d.pci_bus_id)
    nat.set_ranks_per_gpu(d.ordinal, d.ranks_per_gpu)


def is_active() -> bool:
  return _state.active


def workspace_info() -> dict:
  """The workspace as this process sees it."""
  return {
      "active": _state.active,
      "workspace_bytes": _state.workspace_bytes,
      "used_bytes": _state.next_offset if _state.active else 0,
      "regions": len(_state.regions),
      "watchdog_seconds": _state.watchdog_seconds,
      "sync_after_launch": _state.sync_after_launch,
      "trace": _state.trace,
      "devices": [dataclasses.asdict(d) for d in _state.devices.values()],
      "reachable_devices": sorted(_state.reachable),
  }


def reachable(global_ids) -> bool:
  return all(g in _state.reachable for g in global_ids)


def device_props() -> config.DeviceProps:
  """Properties of this process's GPUs, for the configuration (the smallest when they differ)."""
  devs = list(_state.devices.values())
  return config.DeviceProps(sm_count=min(d.sm_count for d in devs),
                            smem_per_block=min(d.smem_per_block for d in devs),
                            ranks_per_gpu=max(d.ranks_per_gpu for d in devs))


def region(op: str, groups: tuple, shape_key: tuple, nbytes: int) -> int:
  """Offset of the region for (op, groups, shape), placing it on first use.

  Every process lowers the same programs in the same order, so placements
  agree; with several processes each new placement is checked against
  process 0's through the key-value store, turning a disagreement into an
  error instead of corrupted data or a hang.
  """
  key = (op, groups, shape_key)
  with _lock:
    if key in _state.regions:
      return _state.regions[key][0]
    offset = -(-_state.next_offset // _REGION_ALIGN) * _REGION_ALIGN
    if offset + nbytes > _state.workspace_bytes:
      need = offset + nbytes
      raise WorkspaceFullError(
          f"jax_overlap {op}: the call needs {nbytes} bytes of symmetric workspace but only "
          f"{max(_state.workspace_bytes - offset, 0)} of {_state.workspace_bytes} are left; set "
          f"JAX_OVERLAP_WORKSPACE_BYTES (or initialize(workspace_bytes=...)) to at least {need} before the "
          f"first fused call, or use algorithm='xla' for this call")
    if jax.process_count() > 1:
      _agree_on_region(len(_state.regions), key, offset)
    _state.regions[key] = (offset, nbytes)
    _state.next_offset = offset + nbytes
    return offset


def _agree_on_region(index: int, key: tuple, offset: int) -> None:
  client = _kv_client()
  mine = json.dumps([repr(key), offset])
  name = f"jax_overlap/{_state.generation}/region/{index}"
  if jax.process_index() == 0:
    client.key_value_set(name, mine)
  else:
    leader = client.blocking_key_value_get(name, _KV_TIMEOUT_MS)
    if leader != mine:
      raise RuntimeError(f"jax_overlap: processes disagree on fused call #{index}: process 0 placed {leader}, "
                         f"process {jax.process_index()} {mine}. Every process must lower the same programs "
                         f"in the same order.")


def check_errors() -> None:
  """Raises PeerTimeoutError if a fused kernel on a local GPU timed out waiting for a peer."""
  for d in _state.devices.values():
    record = native.module().error_record(d.ordinal)
    if record is not None:
      raise PeerTimeoutError(record)


def clear_errors() -> None:
  """Forgets recorded timeouts so fused calls launch again.

  A timed-out call leaves its group's flags out of step (the peer never took
  its part of that epoch): a job whose peer died must restart its process
  group. This is for diagnostics and tests.
  """
  for d in _state.devices.values():
    native.module().clear_error(d.ordinal)


def shutdown() -> None:
  """Frees the workspaces and forgets peers and regions; initialize() may run again."""
  with _lock:
    if _state.active:
      native.module().release()
    _state.active = False
    _state.devices = {}
    _state.reachable = set()
    _state.regions = {}
