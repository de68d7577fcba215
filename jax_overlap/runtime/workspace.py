"""The runtime: per-GPU device state, the symmetric workspace, peers, regions and errors (docs/runtime.md).

Nothing is allocated until a call needs it. Set-up is collective, and a failure on any process fails on every
process, none waiting for another, until shutdown(). Regions are keyed by (algorithm, op, group, shape, element size)
at offsets every rank agrees on, and never freed while the runtime runs. Each call site has its own number, carried
by every flag release, so ranks that run calls in different orders get an error instead of each other's data; flags
carry exact per-region call counters (epochs), so nothing is reset between calls.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import jax

from jax_overlap.runtime import backend, processes, settings
from jax_overlap.runtime.errors import PeerTimeoutError, SetupError, WorkspaceFullError

log = logging.getLogger("jax_overlap")

ON_TIMEOUT = settings.ON_TIMEOUT_CHOICES
_SITES = 0xFFFF
_REGION_ALIGN = 4096


def _state() -> backend.State:
  return backend.current().state


def _lock():
  return backend.current().lock


def _native():
  return backend.current().native


def default_watchdog_seconds() -> float:
  """The native runtime's default bound (one source of truth: csrc/runtime/runtime.h)."""
  nat = _native()
  return float(nat.DEFAULT_WATCHDOG_SECONDS) if nat is not None else 600.0


def _options(watchdog_seconds, on_timeout, sync_after_launch, trace) -> tuple:
  """The options, each from its argument, else the current setting once prepared, else the environment."""
  state = _state()
  if watchdog_seconds is None:
    watchdog_seconds = state.watchdog_seconds if state.prepared else settings.watchdog_seconds(
        default_watchdog_seconds())
  if not watchdog_seconds > 0:
    raise ValueError(f"initialize: watchdog_seconds must be positive (math.inf for none), got {watchdog_seconds}")
  if on_timeout is None:
    on_timeout = state.on_timeout if state.prepared else settings.on_timeout()
  if on_timeout not in ON_TIMEOUT:
    raise ValueError(f"initialize: on_timeout must be one of {ON_TIMEOUT}, got {on_timeout!r}")
  if sync_after_launch is None:
    sync_after_launch = state.sync_after_launch if state.prepared else settings.flag(settings.SYNC)
  if trace is None:
    trace = state.trace if state.prepared else settings.flag(settings.TRACE)
  return float(watchdog_seconds), on_timeout, bool(sync_after_launch), bool(trace)


# --- lifecycle ------------------------------------------------------------------

def prepare_devices() -> bool:
  """Makes the device state of every local GPU (no workspace, nothing exchanged). False without GPUs; SetupError
  when a GPU's state cannot be made."""
  state = _state()
  with _lock():
    if state.prepared:
      return True
    local = backend.current().local_gpus()
    if not local:
      return False
    options = _options(None, None, None, None)  # from the environment: nothing is prepared yet
    nat = _native()
    try:
      for d in local:
        nat.init_device(d.local_hardware_id, d.id)
        info = nat.device_info(d.local_hardware_id)
        state.devices[d.id] = backend.LocalDevice(d.id, d.local_hardware_id, info["pci_bus_id"], info["sm_count"],
                                                  info["smem_per_block"], info["l2_bytes"], info["name"], info["arch"])
    except RuntimeError as e:
      raise SetupError(f"jax_overlap: the device state of GPU {d.local_hardware_id} could not be made: {e}") from e
    state.prepared = True
    _apply_options(*options)
    if backend.current().platform == "rocm":
      _note_hw_queues()
    return True


# ROCm hands a process's streams GPU_MAX_HW_QUEUES hardware queues per GPU by creation order, and streams on one
# queue serialize silently (ROCm/rocm-systems #8916); a pipelined call needs XLA's compute stream and its side
# streams to run at once.
HW_QUEUES = "GPU_MAX_HW_QUEUES"
DEFAULT_HW_QUEUES = 4
XLA_STREAMS = 3  # the fewest a PjRt GPU client makes per GPU: compute, host-to-device, device-to-host
SIDE_STREAMS = 3  # a pipelined call's own: one copy stream and two compute streams (csrc/pipelined/streams.h)


def hw_queue_sharing(hw_queues: int, xla_streams: int = XLA_STREAMS, side_streams: int = SIDE_STREAMS) -> str | None:
  """Why a pipelined call's streams may share ROCm hardware queues, or None when each can have its own."""
  busy, total = 1 + side_streams, xla_streams + side_streams
  if hw_queues < busy:
    return (f"{busy} streams run at once in a pipelined call (XLA's compute stream and jax_overlap's {side_streams}) "
            f"on {hw_queues} hardware queues: some of them share a queue and serialize")
  if hw_queues < total:
    return (f"XLA's streams (at least {xla_streams}) and jax_overlap's {side_streams} exceed the {hw_queues} hardware "
            f"queues, which ROCm hands out by creation order: a side stream may share XLA's compute stream's queue "
            f"and serialize behind it")
  return None


def _note_hw_queues() -> None:

  raw = os.environ.get(HW_QUEUES, "")
  try:
    queues = int(raw) if raw else DEFAULT_HW_QUEUES
  except ValueError:
    log.info("jax_overlap: %s=%r is not a number; ROCm's default is %d", HW_QUEUES, raw, DEFAULT_HW_QUEUES)
    queues = DEFAULT_HW_QUEUES
  why = hw_queue_sharing(queues)
  if why:
    log.info("jax_overlap: %s (%s=%d%s); %s=%d gives each its own (docs/rocm.md)", why, HW_QUEUES, queues,
             "" if raw else ", ROCm's default", HW_QUEUES, XLA_STREAMS + SIDE_STREAMS)


def local_gpus() -> tuple:
  """(name, arch) of each kind of GPU this process has, e.g. ("NVIDIA H200", "sm_90"); () where none is known."""
  if backend.current().platform is None:
    return ()
  try:
    if not prepare_devices():
      return ()
  except SetupError:
    return ()
  return tuple(sorted({(d.name, d.arch) for d in _state().devices.values()}))


def initialize(*, workspace_bytes: int | None = None, watchdog_seconds: float | None = None,
               on_timeout: str | None = None, sync_after_launch: bool | None = None,
               trace: bool | None = None) -> dict:
  """Sets up the symmetric workspace on every local GPU and maps peers; collective, idempotent. The first fused or
  pipelined call runs it with the defaults; call it yourself to choose the options.

  Args:
    workspace_bytes: bytes per GPU (default $JAX_OVERLAP_WORKSPACE_BYTES or 1 GiB); fixed by the first call.
    watchdog_seconds: bound on every wait on a peer (default $JAX_OVERLAP_WATCHDOG_SECONDS or 600; math.inf: none).
    on_timeout: "abort" (the process ends, printing the record) or "raise" (outputs NaN, later calls and
      check_errors() raise) (default $JAX_OVERLAP_ON_TIMEOUT or "abort").
    sync_after_launch: each call of a group of two or more waits for its GPU work and fails itself
      (default $JAX_OVERLAP_SYNC); a group of one's calls may sit in XLA's command buffers, where a host wait can't run.
    trace: record per-workgroup trace events (default $JAX_OVERLAP_TRACE); see jax_overlap.tracing.

  Returns workspace_info(); without a GPU build or GPU, does nothing and says why. A later call changes only the
  options it is given. SetupError when the set-up failed on any process, on every process, until shutdown().

  Example (a 2 GiB workspace, and calls that raise rather than end the process on a timeout):

    jax_overlap.initialize(workspace_bytes=2 << 30, on_timeout="raise")
  """
  state = _state()
  options = _options(watchdog_seconds, on_timeout, sync_after_launch, trace)
  with _lock():
    if state.active:
      if workspace_bytes is not None and workspace_bytes != state.workspace_bytes:
        raise ValueError(f"initialize: the workspace already has {state.workspace_bytes} bytes per GPU; "
                         f"it cannot change to {workspace_bytes} without jax_overlap.shutdown()")
      _apply_options(*options)
      return workspace_info()
    if state.setup_failed is not None:
      raise SetupError(f"{state.setup_failed} (call jax_overlap.shutdown() on every process before "
                       f"initialize() again)")
    if workspace_bytes is None:
      workspace_bytes = settings.workspace_bytes()
    if workspace_bytes <= 0:
      raise ValueError(f"initialize: workspace_bytes must be positive, got {workspace_bytes}")
    if not prepare_devices():
      why = ("the native extension is not built for a GPU" if backend.current().platform is None
             else f"this process has no {backend.current().platform} devices")
      log.info("jax_overlap.initialize: nothing to do (%s); on a GPU it would allocate %d bytes per GPU, "
               "map peers, and bound waits by %.1f s", why, workspace_bytes, options[0])
      return {**workspace_info(), "reason": why}
    _apply_options(*options)
    try:
      _setup(workspace_bytes)
    except SetupError as e:
      state.setup_failed = str(e)
      raise
    return workspace_info()


def _apply_options(watchdog_seconds: float, on_timeout: str, sync_after_launch: bool, trace: bool) -> None:
  state = _state()
  state.watchdog_seconds = watchdog_seconds
  state.on_timeout = on_timeout
  state.sync_after_launch = sync_after_launch
  state.trace = trace
  nat = _native()
  nat.set_abort_on_timeout(on_timeout == "abort")
  for d in state.devices.values():
    nat.set_options(d.ordinal, watchdog_seconds, sync_after_launch, trace)


def _all_succeed(step: str, attempt) -> None:
  """Runs `attempt` here; SetupError on every process when it raised RuntimeError on any, so none waits for one
  that failed."""
  try:
    attempt()
    failure = None
  except RuntimeError as e:
    failure = str(e)
  failures = [(p, f) for p, f in enumerate(processes.gather(f"setup/{step}", failure)) if f is not None]
  if failures:
    several = jax.process_count() > 1
    raise SetupError("jax_overlap: the workspace could not be set up: " +
                     "; ".join(f"process {p}: {f}" if several else f for p, f in failures))


def _setup(workspace_bytes: int) -> None:
  state = _state()
  nat = _native()
  processes.hosts()  # collective the first time: every process must reach it at the same step

  def allocate():
    for d in state.devices.values():
      nat.allocate_workspace(d.ordinal, workspace_bytes)

  _all_succeed("allocate", allocate)
  _all_succeed("map", _map_local_peers if jax.process_count() == 1 else _exchange_handles)
  _all_succeed("copy_path", _choose_copy_paths)
  state.workspace_bytes = workspace_bytes
  state.next_offset = 0
  state.regions = {}
  state.sites = {}
  _measure_copies()
  state.active = True
  log.debug("jax_overlap: workspace of %d bytes on %d GPU(s); %d peer(s) reachable; peer link %.0f GB/s, local copy "
            "%.0f GB/s; on the SMs (publish, pulls): %s", workspace_bytes, len(state.devices), len(state.reachable),
            (state.link_bytes_per_us or 0) / 1e3, (state.local_bytes_per_us or 0) / 1e3, state.copies_on_sms)


def _choose_copy_paths() -> None:
  """Each GPU's pipelined copies take the path verified here on every mapped peer; RuntimeError when none lands."""
  state = _state()
  nat = _native()
  for d in state.devices.values():
    choice = nat.choose_copy_path(d.ordinal)
    d.copy_path = choice["path"]
    if choice["rejected"]:
      log.info("jax_overlap: GPU %d moves the pipelined algorithm's bytes by %s: %s", d.ordinal, choice["description"],
               "; ".join(choice["rejected"]))


# Long enough for a copy engine's full rate.
_COPY_PROBE_BYTES = 64 << 20


def _measure_copies() -> None:
  """The peer link and the local copy rate, for the cost model (process 0's, on every process)."""
  nat, state = _native(), _state()
  mine = next(iter(state.devices.values()))
  probe = min(_COPY_PROBE_BYTES, state.workspace_bytes)

  def measure():
    peers = sorted(state.reachable - {mine.global_id})
    local_us = nat.time_copy(mine.ordinal, nat.workspace_peer_base(mine.ordinal, mine.global_id), probe)
    link_us = (nat.time_copy(mine.ordinal, nat.workspace_peer_base(mine.ordinal, peers[0]), probe) if peers
               else local_us)
    publish, pulls = _copies_on_sms(mine.copy_path, shares_gpu=mine.ranks_per_gpu > 1)
    return [probe / link_us, probe / local_us, publish, pulls]

  link, local, publish, pulls = processes.agree("copies", measure)
  state.link_bytes_per_us, state.local_bytes_per_us, state.copies_on_sms = link, local, (publish, pulls)


def _copies_on_sms(path: str, shares_gpu: bool) -> tuple:
  """(publish, pulls): whether publishing x (a copy within this GPU) and the pulls run on the SMs on copy path
  `path`. A local copy does on NVIDIA, and on AMD on every path but "copy_engine" (SDMA only, no blit stands in);
  pulls from another GPU use the copy engines on NVIDIA, but on AMD only on "copy_engine" (ROCr runs large device
  copies as a blit kernel on the CUs, rocm-systems #11450); pulls from the same GPU count as a local copy."""
  amd = backend.current().platform == "rocm"
  publish = not amd or path != "copy_engine"
  return publish, path == "kernel" or (shares_gpu and publish) or (amd and path != "copy_engine")


def copies_on_sms() -> tuple:
  """(publish, pulls) on the SMs for the cost model; before initialize(), the copy engine's path across GPUs."""
  state = _state()
  return state.copies_on_sms or _copies_on_sms("copy_engine", shares_gpu=False)


def _map_local_peers() -> None:
  state = _state()
  nat = _native()
  for a in state.devices.values():
    for b in state.devices.values():
      nat.map_local_peer(a.ordinal, b.ordinal)
  state.reachable = set(state.devices)


def _exchange_handles() -> None:

  state = _state()
  nat = _native()
  client = processes.client()
  host = backend.current().hostname()
  prefix = f"{processes.prefix()}/device"
  for d in state.devices.values():
    processes.put(client, f"{prefix}/{d.global_id}", json.dumps({"pci": d.pci_bus_id,
                                                                 "handle": nat.export_handle(d.ordinal).hex()}))
  peers = {}
  for gid, peer_host in processes.hosts().items():
    if peer_host != host:
      continue
    if gid in state.devices:
      peers[gid] = {"pci": state.devices[gid].pci_bus_id}
    else:
      peers[gid] = json.loads(processes.get(client, f"{prefix}/{gid}", f"the IPC handle of GPU {gid}"))
  state.reachable = set()
  for gid, peer in peers.items():
    for d in state.devices.values():
      if gid in state.devices:
        nat.map_local_peer(d.ordinal, state.devices[gid].ordinal)
      else:
        nat.import_peer(d.ordinal, gid, bytes.fromhex(peer["handle"]))
    state.reachable.add(gid)
  for d in state.devices.values():
    # Ranks on one GPU split its SMs so that all their persistent kernels are co-resident.
    d.ranks_per_gpu = sum(1 for p in peers.values() if p["pci"] == d.pci_bus_id)
    nat.set_ranks_per_gpu(d.ordinal, d.ranks_per_gpu)


def is_active() -> bool:
  return _state().active


def setup_failed() -> str | None:
  """Why initialize() failed, until shutdown(); None otherwise."""
  return _state().setup_failed


def workspace_info() -> dict:
  """The workspace as this process sees it: set up or not, size and use, options, GPUs.

  Example: print(jax_overlap.workspace_info()["used_bytes"])
  """
  state = _state()
  return {
      "active": state.active,
      "workspace_bytes": state.workspace_bytes,
      "used_bytes": state.next_offset if state.active else 0,
      "regions": len(state.regions),
      "watchdog_seconds": state.watchdog_seconds if state.prepared else _options(None, None, None, None)[0],
      "on_timeout": state.on_timeout,
      "sync_after_launch": state.sync_after_launch,
      "trace": state.trace,
      "devices": [dataclasses.asdict(d) for d in state.devices.values()],
      "reachable_devices": sorted(state.reachable),
      "link_gbps": (state.link_bytes_per_us or 0.0) / 1e3,
  }


def reachable(global_ids) -> bool:
  return all(g in _state().reachable for g in global_ids)


def local_device_ids() -> set:
  return {d.id for d in backend.current().local_gpus()}


def link_bytes_per_us() -> float | None:
  return _state().link_bytes_per_us


def local_bytes_per_us() -> float | None:
  return _state().local_bytes_per_us


def device_props() -> backend.DeviceProps:
  """This process's GPUs' properties (the smallest when they differ)."""
  state = _state()
  prepare_devices()
  devs = list(state.devices.values())
  return backend.DeviceProps(sm_count=min(d.sm_count for d in devs),
                             smem_per_block=min(d.smem_per_block for d in devs),
                             ranks_per_gpu=max(d.ranks_per_gpu for d in devs),
                             l2_bytes=min(d.l2_bytes for d in devs))


def local_ordinals() -> list:

  state = _state()
  prepare_devices()
  return [d.ordinal for d in state.devices.values()]


def first_ordinal() -> int:
  return local_ordinals()[0]


# --- regions and call sites -------------------------------------------------------

def placement(key: tuple, nbytes: int) -> int:
  """The offset of the region for `key`, or where it would go next (nothing changes); WorkspaceFullError when a
  new region does not fit."""
  state = _state()
  with _lock():
    if key in state.regions:
      return state.regions[key][0]
    offset = -(-state.next_offset // _REGION_ALIGN) * _REGION_ALIGN
    if offset + nbytes > state.workspace_bytes:
      need = offset + nbytes
      raise WorkspaceFullError(
          f"jax_overlap {key[0]}: the call needs {nbytes} bytes of symmetric workspace but only "
          f"{max(state.workspace_bytes - offset, 0)} of {state.workspace_bytes} are left; set "
          f"JAX_OVERLAP_WORKSPACE_BYTES (or initialize(workspace_bytes=...)) to at least {need} before the "
          f"first call that needs it, or use algorithm='xla' for this call")
    return offset


def place(key: tuple, nbytes: int, offset: int) -> None:
  """Records the region for `key` at `offset` (placement()'s, agreed by every process); idempotent."""
  state = _state()
  with _lock():
    if key not in state.regions:
      state.regions[key] = (offset, nbytes)
      state.next_offset = max(state.next_offset, offset + nbytes)


def claim(key: tuple, nbytes: int) -> int:
  """placement() and place() as one step: threads lowering at once must not both take the next free offset."""
  with _lock():
    offset = placement(key, nbytes)
    place(key, nbytes, offset)
  return offset


def note_workspace_full(error: WorkspaceFullError) -> None:

  state = _state()
  with _lock():
    if state.workspace_full_noted:
      return
    state.workspace_full_noted = True
  log.info("%s. Regions are never freed while the runtime runs: from now on the calls that need a new region take "
           "the XLA path (algorithm='auto'). A larger workspace takes effect at the next set-up: "
           "jax_overlap.shutdown() then initialize() (collective; calls compiled before must be compiled again).",
           error)


def site(key: tuple, name: tuple) -> int:
  """The number (1..65535) of call site `name` among those sharing `key`'s region; `name` is its module's name, its
  program's digest and its place in the module (integration/lowering.py `_site`), so two programs lowered under one
  name differ.

  Named so, a site keeps one number however often and by whichever process it is lowered; across processes the
  first to number a name wins. A flag holds 16 bits of site, so only sites 65535 names apart go unchecked.
  """
  state = _state()
  with _lock():
    sites = state.sites.setdefault(key, {})
    if name not in sites:
      sites[name] = _number_site(key, name, len(sites))
    return sites[name]


def _number_site(key: tuple, name: tuple, known: int) -> int:
  if jax.process_count() == 1:
    return known % _SITES + 1
  client = processes.client()
  prefix = f"{processes.prefix()}/site/{processes.digest(key)}"
  entry = f"{prefix}/{processes.digest(name)}"
  try:
    return int(client.key_value_try_get(entry))
  except RuntimeError:  # not numbered yet
    pass
  number = (client.key_value_increment(f"{prefix}/count", 1) - 1) % _SITES + 1
  try:
    client.key_value_set(entry, str(number))
    return number
  except RuntimeError:  # another process numbered it first
    return int(processes.get(client, entry, "the number of a call site"))


def generation() -> int:

  return _native().generation()


def check_errors() -> None:
  """Raises PeerTimeoutError if a kernel on a local GPU timed out waiting for a peer (on_timeout="raise").

  Example:

    try:
      jax_overlap.check_errors()
    except jax_overlap.PeerTimeoutError as e:
      print(e.record["op"], e.record["peer"])
  """
  state = _state()
  for d in state.devices.values():
    record = _native().error_record(d.ordinal)
    if record is not None:
      raise PeerTimeoutError(record)


def clear_errors() -> None:
  """Puts every rank back in step after a timeout; collective. Calls lowered before keep working.

  Protocol: stop every GPU's waits; barrier; zero flags and epochs and forget the error; barrier; all ranks go on
  from epoch 1.

  Example (on every process, after a PeerTimeoutError): jax_overlap.clear_errors()
  """
  state = _state()
  with _lock():
    nat = _native()
    state.clears += 1
    for d in state.devices.values():
      nat.stop_after_error(d.ordinal)
    processes.barrier(f"clear/{state.clears}/stopped")
    # A GPU that cannot restart raises only after the second barrier, so its peers are not left waiting in it.
    refused = []
    for d in state.devices.values():
      try:
        nat.restart_after_error(d.ordinal)
      except RuntimeError as e:
        refused.append(e)
    processes.barrier(f"clear/{state.clears}/restarted")
    if refused:
      raise refused[0]


def shutdown() -> None:
  """Frees the workspaces and device states and forgets peers, regions and a failed set-up; collective.

  Calls compiled before refuse to run afterwards (bound to the freed workspaces). No process frees its workspace
  before every peer has stopped reading it.

  Example (a larger workspace, on every process):

    jax_overlap.shutdown()
    jax_overlap.initialize(workspace_bytes=4 << 30)
  """
  state = _state()
  with _lock():
    if not state.prepared:
      return  # nothing was set up (and the key-value names of this generation stay taken)
    nat = _native()
    for d in state.devices.values():
      nat.synchronize(d.ordinal)
    if state.active:
      processes.barrier("shutdown")
    nat.release()
    state.prepared = False
    state.active = False
    state.setup_failed = None
    state.workspace_full_noted = False
    state.devices = {}
    state.reachable = set()
    state.hosts = None
    state.regions = {}
    state.sites = {}
    state.link_bytes_per_us = None
    state.local_bytes_per_us = None
    state.copies_on_sms = None
