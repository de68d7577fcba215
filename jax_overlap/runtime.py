"""The runtime: per-GPU device state, the symmetric workspace, peers, regions and errors.

Lifecycle. Nothing is allocated or exchanged until a call takes a path that
needs it. The first GPU lowering that runs one of this library's kernels sets
up a small device state per local GPU (the watchdog's abort flag and error
record, the trace buffer). The first call of a group of two or more that takes
the fused or pipelined path runs `initialize()` (or call it yourself): it
allocates one workspace per local GPU, zeroes it, maps every peer's workspace
into this process (peer access between the GPUs of one process, IPC handles
exchanged once through the `jax.distributed` key-value store between processes
of one host) and measures the peer link for the cost model. Devices on other
hosts stay unmapped; groups that span hosts take the XLA path. It is
collective: with several processes, every process must call it (lowering the
same program does).

Regions. Each call site that takes a workspace path gets a region at an offset
every rank of its group agrees on, keyed by (algorithm, op, group, shape);
call sites of one key share it, each with its own number (its "site"), which
every flag release carries, so ranks that run such calls in different orders
get an error instead of each other's data. Flags carry exact per-region call
counters (epochs), so nothing is reset between calls.

Failure semantics. A wait that outlives the watchdog (default 10 minutes, like
NCCL's) records the op, ranks, flag and epoch, and the call's outputs become
NaN in full, as do those of every call queued behind it on that GPU. Then,
with JAX_OVERLAP_ON_TIMEOUT=abort (the default), the process ends with the
record printed (a monitor thread polls the records, as NCCL's watchdog does);
with "raise", every later fused or pipelined call on that GPU fails with the
record, and `check_errors()` raises it as `PeerTimeoutError`, until
`clear_errors()` (collective) puts every rank back in step. JAX_OVERLAP_SYNC=1
makes the failing call itself raise (it waits for each call: debugging).

Settings (environment variables, or initialize()'s arguments):
  JAX_OVERLAP_WORKSPACE_BYTES  workspace per GPU (default 1 GiB)
  JAX_OVERLAP_WATCHDOG_SECONDS bound on every wait on a peer (default 600; inf: none)
  JAX_OVERLAP_ON_TIMEOUT       "abort" (default) or "raise"
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

from jax_overlap import _compat, config, native

log = logging.getLogger("jax_overlap")

DEFAULT_WORKSPACE_BYTES = 1 << 30
ON_TIMEOUT = ("abort", "raise")
_KV_TIMEOUT_MS = 120_000
_SITES = 0xFFFF
_REGION_ALIGN = 4096


def default_watchdog_seconds() -> float:
  """The native runtime's default bound (one source of truth: csrc/runtime/runtime.h)."""
  nat = native.module()
  return float(nat.DEFAULT_WATCHDOG_SECONDS) if nat is not None else 600.0


class PeerTimeoutError(RuntimeError):
  """A kernel gave up waiting for a peer. `record` holds op, rank, peer, epoch, flag."""

  def __init__(self, record: dict):
    super().__init__(record["message"])
    self.record = record


class WorkspaceFullError(RuntimeError):
  """A call needs more symmetric workspace than is left."""


@dataclasses.dataclass
class _LocalDevice:
  global_id: int
  ordinal: int
  pci_bus_id: str
  sm_count: int
  smem_per_block: int
  l2_bytes: int
  name: str
  arch: str
  ranks_per_gpu: int = 1


@dataclasses.dataclass
class _State:
  prepared: bool = False  # device states made
  active: bool = False    # workspaces allocated and peers mapped
  workspace_bytes: int = 0
  watchdog_seconds: float = 0.0
  on_timeout: str = "abort"
  sync_after_launch: bool = False
  trace: bool = False
  devices: dict = dataclasses.field(default_factory=dict)  # global id -> _LocalDevice
  reachable: set = dataclasses.field(default_factory=set)  # global ids mapped into this process
  regions: dict = dataclasses.field(default_factory=dict)  # key -> [offset, nbytes, sites lowered]
  next_offset: int = 0
  link_bytes_per_us: float | None = None   # measured peer pull rate
  local_bytes_per_us: float | None = None  # measured local copy rate
  clears: int = 0  # collective clear_errors() calls so far (key-value barrier names)


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


def _options(watchdog_seconds, on_timeout, sync_after_launch, trace) -> tuple:
  """The options, each from its argument, else the current setting once prepared, else the environment."""
  if watchdog_seconds is None:
    watchdog_seconds = (_state.watchdog_seconds if _state.prepared else
                        float(os.environ.get("JAX_OVERLAP_WATCHDOG_SECONDS", default_watchdog_seconds())))
  if not watchdog_seconds > 0:
    raise ValueError(f"initialize: watchdog_seconds must be positive (math.inf for none), got {watchdog_seconds}")
  if on_timeout is None:
    on_timeout = _state.on_timeout if _state.prepared else os.environ.get("JAX_OVERLAP_ON_TIMEOUT", "abort")
  if on_timeout not in ON_TIMEOUT:
    raise ValueError(f"initialize: on_timeout must be one of {ON_TIMEOUT}, got {on_timeout!r}")
  if sync_after_launch is None:
    sync_after_launch = _state.sync_after_launch if _state.prepared else _env_flag("JAX_OVERLAP_SYNC")
  if trace is None:
    trace = _state.trace if _state.prepared else _env_flag("JAX_OVERLAP_TRACE")
  return float(watchdog_seconds), on_timeout, bool(sync_after_launch), bool(trace)


def prepare_devices() -> bool:
  """Makes the device state of every local GPU (small; no workspace, nothing exchanged). False without GPUs."""
  with _lock:
    if _state.prepared:
      return True
    local = _gpu_devices(local=True)
    if not local:
      return False
    options = _options(None, None, None, None)  # from the environment: nothing is prepared yet
    nat = native.module()
    for d in local:
      nat.init_device(d.local_hardware_id, d.id)
      info = nat.device_info(d.local_hardware_id)
      _state.devices[d.id] = _LocalDevice(d.id, d.local_hardware_id, info["pci_bus_id"], info["sm_count"],
                                          info["smem_per_block"], info["l2_bytes"], info["name"], info["arch"])
    _state.prepared = True
    _apply_options(*options)
    return True


def initialize(*, workspace_bytes: int | None = None, watchdog_seconds: float | None = None,
               on_timeout: str | None = None, sync_after_launch: bool | None = None,
               trace: bool | None = None) -> dict:
  """Sets up the symmetric workspace on every local GPU and maps peers. Idempotent.

  The first call of a group of two or more that takes a fused or pipelined
  path runs this with the defaults; call it yourself to choose the options.

  Args:
    workspace_bytes: bytes per GPU (default: $JAX_OVERLAP_WORKSPACE_BYTES or 1 GiB).
      Fixed by the first call; a later call asking for a different size raises.
    watchdog_seconds: bound on every wait on a peer (default: $JAX_OVERLAP_WATCHDOG_SECONDS or 600;
      math.inf waits forever).
    on_timeout: "abort" (the process ends with the error record printed, as NCCL's watchdog does) or
      "raise" (outputs NaN, later calls and check_errors() raise) (default: $JAX_OVERLAP_ON_TIMEOUT or "abort").
    sync_after_launch: make each call of a group of two or more wait for its GPU work and fail itself
      (default: $JAX_OVERLAP_SYNC); calls of a group of one may sit in XLA's command buffers, where a
      host wait cannot run.
    trace: record per-workgroup trace events (default: $JAX_OVERLAP_TRACE); see jax_overlap.tracing.

  Returns workspace_info(). On a machine without a GPU build or GPU this does
  nothing and says what it would have done. Once initialized, a later call
  changes only the options it is given.
  """
  options = _options(watchdog_seconds, on_timeout, sync_after_launch, trace)
  with _lock:
    if _state.active:
      if workspace_bytes is not None and workspace_bytes != _state.workspace_bytes:
        raise ValueError(f"initialize: the workspace already has {_state.workspace_bytes} bytes per GPU; "
                         f"it cannot change to {workspace_bytes} without jax_overlap.shutdown()")
      _apply_options(*options)
      return workspace_info()
    if workspace_bytes is None:
      workspace_bytes = int(os.environ.get("JAX_OVERLAP_WORKSPACE_BYTES", DEFAULT_WORKSPACE_BYTES))
    if workspace_bytes <= 0:
      raise ValueError(f"initialize: workspace_bytes must be positive, got {workspace_bytes}")
    if not prepare_devices():
      why = ("the native extension is not built for a GPU" if native.platform() is None
             else f"this process has no {native.platform()} devices")
      log.info("jax_overlap.initialize: nothing to do (%s); on a GPU it would allocate %d bytes per GPU, "
               "map peers, and bound waits by %.1f s", why, workspace_bytes, options[0])
      return {**workspace_info(), "reason": why}
    _apply_options(*options)
    _setup(workspace_bytes)
    return workspace_info()


def _apply_options(watchdog_seconds: float, on_timeout: str, sync_after_launch: bool, trace: bool) -> None:
  _state.watchdog_seconds = watchdog_seconds
  _state.on_timeout = on_timeout
  _state.sync_after_launch = sync_after_launch
  _state.trace = trace
  nat = native.module()
  nat.set_abort_on_timeout(on_timeout == "abort")
  for d in _state.devices.values():
    nat.set_options(d.ordinal, watchdog_seconds, sync_after_launch, trace)


def _setup(workspace_bytes: int) -> None:
  nat = native.module()
  for d in _state.devices.values():
    nat.allocate_workspace(d.ordinal, workspace_bytes)
  if jax.process_count() == 1:
    for a in _state.devices.values():
      for b in _state.devices.values():
        nat.map_local_peer(a.ordinal, b.ordinal)
    _state.reachable = set(_state.devices)
  else:
    _exchange_handles()
  for d in _state.devices.values():
    # Every pipelined copy of this GPU takes the path verified here on every mapped peer (csrc/pipelined/copy.h).
    choice = nat.choose_copy_path(d.ordinal)
    if choice["rejected"]:
      log.info("jax_overlap: GPU %d moves the pipelined algorithm's bytes by %s: %s", d.ordinal, choice["description"],
               "; ".join(choice["rejected"]))
  _state.workspace_bytes = workspace_bytes
  _state.next_offset = 0
  _state.regions = {}
  _state.active = True
  _measure_copies()
  log.debug("jax_overlap: workspace of %d bytes on %d GPU(s); %d peer(s) reachable; peer link %.0f GB/s, local copy "
            "%.0f GB/s", workspace_bytes, len(_state.devices), len(_state.reachable),
            (_state.link_bytes_per_us or 0) / 1e3, (_state.local_bytes_per_us or 0) / 1e3)


# Bytes each copy measurement moves: long enough for a copy engine's full rate.
_COPY_PROBE_BYTES = 64 << 20


def _measure_copies() -> None:
  """The peer link and the local copy rate, for the cost model (agreed across processes: process 0's)."""
  nat = native.module()
  mine = next(iter(_state.devices.values()))
  probe = min(_COPY_PROBE_BYTES, _state.workspace_bytes)
  peers = sorted(_state.reachable - {mine.global_id})
  local_us = nat.time_copy(mine.ordinal, nat.workspace_peer_base(mine.ordinal, mine.global_id), probe)
  link_us = nat.time_copy(mine.ordinal, nat.workspace_peer_base(mine.ordinal, peers[0]), probe) if peers else local_us
  figures = agree("copies", [probe / link_us, probe / local_us])
  _state.link_bytes_per_us, _state.local_bytes_per_us = figures


def _kv_client():
  client = _compat.kv_client()
  if client is None:
    raise RuntimeError("jax_overlap: several processes need jax.distributed.initialize() before "
                       "jax_overlap.initialize()")
  return client


def agree(name: str, value):
  """Process 0's `value` (JSON) on every process: measured figures that all processes' decisions must share."""
  if jax.process_count() == 1:
    return value
  client = _kv_client()
  key = f"jax_overlap/{native.module().generation()}/agree/{name}"
  if jax.process_index() == 0:
    client.key_value_set(key, json.dumps(value))
    return value
  return json.loads(client.blocking_key_value_get(key, _KV_TIMEOUT_MS))


def _exchange_handles() -> None:
  """Publish this process's IPC handles and import those of every device on this host."""
  nat = native.module()
  client = _kv_client()
  host = socket.gethostname()
  prefix = f"jax_overlap/{nat.generation()}/device"
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
      "watchdog_seconds": _state.watchdog_seconds if _state.prepared else _options(None, None, None, None)[0],
      "on_timeout": _state.on_timeout,
      "sync_after_launch": _state.sync_after_launch,
      "trace": _state.trace,
      "devices": [dataclasses.asdict(d) for d in _state.devices.values()],
      "reachable_devices": sorted(_state.reachable),
      "link_gbps": (_state.link_bytes_per_us or 0.0) / 1e3,
  }


def reachable(global_ids) -> bool:
  return all(g in _state.reachable for g in global_ids)


def local_device_ids() -> set:
  return {d.id for d in _gpu_devices(local=True)}


def link_bytes_per_us() -> float | None:
  return _state.link_bytes_per_us


def local_bytes_per_us() -> float | None:
  return _state.local_bytes_per_us


def device_props() -> config.DeviceProps:
  """Properties of this process's GPUs, for the configuration (the smallest when they differ)."""
  prepare_devices()
  devs = list(_state.devices.values())
  return config.DeviceProps(sm_count=min(d.sm_count for d in devs),
                            smem_per_block=min(d.smem_per_block for d in devs),
                            ranks_per_gpu=max(d.ranks_per_gpu for d in devs),
                            l2_bytes=min(d.l2_bytes for d in devs))


def local_ordinals() -> list:
  """Device ordinals of this process's GPUs (their device states made)."""
  prepare_devices()
  return [d.ordinal for d in _state.devices.values()]


def first_ordinal() -> int:
  return local_ordinals()[0]


def region(key: tuple, nbytes: int) -> tuple[int, int]:
  """(offset, site) of a call site: the region for `key`, placed on first use, and the site's number in it.

  Every process lowers the same programs in the same order, so placements and
  site numbers agree; with several processes each new placement is checked
  against process 0's through the key-value store, turning a disagreement
  into an error instead of corrupted data or a hang.
  """
  with _lock:
    if key in _state.regions:
      entry = _state.regions[key]
      entry[2] += 1
      # A flag holds 16 bits of site (csrc/kernels/protocol.h flag_value): numbers repeat every 65535
      # lowerings of one key, and only two sites that far apart would go unchecked against each other.
      return entry[0], (entry[2] - 1) % _SITES + 1
    offset = -(-_state.next_offset // _REGION_ALIGN) * _REGION_ALIGN
    if offset + nbytes > _state.workspace_bytes:
      need = offset + nbytes
      raise WorkspaceFullError(
          f"jax_overlap {key[0]}: the call needs {nbytes} bytes of symmetric workspace but only "
          f"{max(_state.workspace_bytes - offset, 0)} of {_state.workspace_bytes} are left; set "
          f"JAX_OVERLAP_WORKSPACE_BYTES (or initialize(workspace_bytes=...)) to at least {need} before the "
          f"first call that needs it, or use algorithm='xla' for this call")
    if jax.process_count() > 1:
      _agree_on_region(len(_state.regions), key, offset)
    _state.regions[key] = [offset, nbytes, 1]
    _state.next_offset = offset + nbytes
    return offset, 1


def _agree_on_region(index: int, key: tuple, offset: int) -> None:
  client = _kv_client()
  mine = json.dumps([repr(key), offset])
  name = f"jax_overlap/{native.module().generation()}/region/{index}"
  if jax.process_index() == 0:
    client.key_value_set(name, mine)
  else:
    leader = client.blocking_key_value_get(name, _KV_TIMEOUT_MS)
    if leader != mine:
      raise RuntimeError(f"jax_overlap: processes disagree on call #{index}: process 0 placed {leader}, "
                         f"process {jax.process_index()} {mine}. Every process must lower the same programs "
                         f"in the same order.")


def generation() -> int:
  """The runtime generation calls are lowered under (shutdown() starts a new one)."""
  return native.module().generation()


def check_errors() -> None:
  """Raises PeerTimeoutError if a kernel on a local GPU timed out waiting for a peer."""
  for d in _state.devices.values():
    record = native.module().error_record(d.ordinal)
    if record is not None:
      raise PeerTimeoutError(record)


def _barrier(name: str) -> None:
  """Every process reaches `name` before any leaves it (the key-value store)."""
  if jax.process_count() == 1:
    return
  client = _kv_client()
  prefix = f"jax_overlap/{native.module().generation()}/{name}"
  client.key_value_set(f"{prefix}/{jax.process_index()}", "1")
  for p in range(jax.process_count()):
    client.blocking_key_value_get(f"{prefix}/{p}", _KV_TIMEOUT_MS)


def clear_errors() -> None:
  """Puts every rank back in step after a timeout. Collective: every process must call it.

  Each process stops its GPUs' waits and lets their work finish; after a
  barrier it zeroes its workspaces' flags and epochs and forgets the error;
  after a second barrier every process may call again, all ranks from epoch 1.
  Calls lowered before keep working.
  """
  with _lock:
    nat = native.module()
    _state.clears += 1
    for d in _state.devices.values():
      nat.stop_after_error(d.ordinal)
    _barrier(f"clear/{_state.clears}/stopped")
    # A GPU that cannot be restarted (a stalled stream-K tail: restart the process) raises only after the
    # second barrier, so that its peers are not left waiting in it.
    refused = []
    for d in _state.devices.values():
      try:
        nat.restart_after_error(d.ordinal)
      except RuntimeError as e:
        refused.append(e)
    _barrier(f"clear/{_state.clears}/restarted")
    if refused:
      raise refused[0]


def shutdown() -> None:
  """Frees the workspaces and device states and forgets peers and regions; initialize() may run again.

  Calls compiled before refuse to run afterwards (they were bound to the freed
  workspaces): trace and compile them again. With several processes it is
  collective: each finishes its GPUs' work, and none frees its workspace
  before every peer has stopped reading it.
  """
  with _lock:
    if _state.prepared:
      nat = native.module()
      for d in _state.devices.values():
        nat.synchronize(d.ordinal)
      if _state.active:
        _barrier("shutdown")
      nat.release()
    _state.prepared = False
    _state.active = False
    _state.devices = {}
    _state.reachable = set()
    _state.regions = {}
    _state.link_bytes_per_us = None
    _state.local_bytes_per_us = None

