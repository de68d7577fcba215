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
same program does). A setup that fails on any process (out of memory, a peer
that cannot be mapped) fails on every process, none waiting for another; it is
not retried until shutdown() (collective) and initialize() again.

Regions. Each call that takes a workspace path gets a region at an offset
every rank of its group agrees on, keyed by (algorithm, op, group, shape);
calls of one key share it. Each call site has its own number (its "site"),
which every flag release carries, so ranks that run such calls in different
orders get an error instead of each other's data. A site is named by where it
sits, not by how often it was lowered: the program (module) it is lowered in
and its place among that module's calls of the region, numbered once per name
(across processes through the key-value store). Flags carry exact per-region
call counters (epochs), so nothing is reset between calls. Regions are never
freed while the runtime runs: a call that no longer fits takes the XLA path
(auto) or raises WorkspaceFullError.

Several processes. Every step that involves other processes goes through the
`jax.distributed` key-value store, named by what it is about (never by how
often a process lowered), bounded by a timeout that becomes an error, never a
hang: `agree` (process 0 measures, every process uses its figures or its
failure), `gather` (every process's value, after a barrier that fails on every
process alike when one is missing) and the host map.

Failure semantics. A wait that outlives the watchdog (default 10 minutes, like
NCCL's) records the op, ranks, flag and epoch, and the call's outputs become
NaN in full, as do those of every call queued behind it on that GPU. Then,
with JAX_OVERLAP_ON_TIMEOUT=abort (the default), the process ends with the
record printed (a monitor thread polls the records, as NCCL's watchdog does);
with "raise", every later fused or pipelined call on that GPU fails with the
record, and `check_errors()` raises it as `PeerTimeoutError`, until
`clear_errors()` (collective) puts every rank back in step. JAX_OVERLAP_SYNC=1
makes the failing call itself raise (it waits for each call: debugging).

Settings (environment variables, or initialize()'s arguments); a value that
is not one of those expected raises a ValueError naming the variable:
  JAX_OVERLAP_WORKSPACE_BYTES  workspace per GPU (default 1 GiB)
  JAX_OVERLAP_WATCHDOG_SECONDS bound on every wait on a peer (default 600; inf: none)
  JAX_OVERLAP_ON_TIMEOUT       "abort" (default) or "raise"
  JAX_OVERLAP_SYNC             "1": surface watchdog errors on the failing call
  JAX_OVERLAP_TRACE            "1": record per-workgroup trace events
"""

from __future__ import annotations

import dataclasses
import hashlib
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
# Bound on every wait for another process in the key-value store (a handle, a figure, a barrier): far
# longer than any lowering or set-up takes, far shorter than the watchdog.
_KV_TIMEOUT_MS = 120_000
_SITES = 0xFFFF
_REGION_ALIGN = 4096
_FLAG_TRUE = ("1", "true", "yes", "on")
_FLAG_FALSE = ("", "0", "false", "no", "off")


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


class SetupError(RuntimeError):
  """What a call needs could not be set up: GPU memory, a measurement, the vendor BLAS, or an answer from another
  process in time. `auto` then takes the XLA path; with several processes every process learns of it."""


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
  setup_failed: str | None = None  # why initialize() failed (on every process alike) until shutdown()
  workspace_full_noted: bool = False  # the INFO line saying calls now take the XLA path for want of workspace
  workspace_bytes: int = 0
  watchdog_seconds: float = 0.0
  on_timeout: str = "abort"
  sync_after_launch: bool = False
  trace: bool = False
  devices: dict = dataclasses.field(default_factory=dict)  # global id -> _LocalDevice
  reachable: set = dataclasses.field(default_factory=set)  # global ids mapped into this process
  hosts: dict | None = None  # global id -> host of every process's GPUs (agreed), once known
  regions: dict = dataclasses.field(default_factory=dict)  # key -> (offset, nbytes)
  sites: dict = dataclasses.field(default_factory=dict)  # region key -> {site name: number}
  next_offset: int = 0
  link_bytes_per_us: float | None = None   # measured peer pull rate
  local_bytes_per_us: float | None = None  # measured local copy rate
  clears: int = 0  # collective clear_errors() calls so far (key-value barrier names)


_state = _State()
_lock = threading.RLock()
# agree()'s outcomes by key-value name (which holds the runtime generation): each is taken once per process.
_agreed: dict = {}


# --- settings from the environment ------------------------------------------------

def env_flag(name: str) -> bool:
  """A switch read from the environment: 1/true/yes/on or 0/false/no/off (unset: off)."""
  text = os.environ.get(name, "")
  if text.strip().lower() in _FLAG_TRUE:
    return True
  if text.strip().lower() in _FLAG_FALSE:
    return False
  raise ValueError(f"jax_overlap: {name}={text!r} is not a switch; expected 1 or 0 (or true/false, yes/no, on/off)")


def _env_number(name: str, default, parse, expected: str):
  text = os.environ.get(name)
  if text is None:
    return default
  try:
    return parse(text)
  except ValueError:
    raise ValueError(f"jax_overlap: {name}={text!r} is not a number; expected {expected}") from None


def _env_choice(name: str, default: str, choices: tuple) -> str:
  text = os.environ.get(name, default)
  if text not in choices:
    raise ValueError(f"jax_overlap: {name}={text!r}; expected one of {', '.join(choices)}")
  return text


_WATCHDOG_ENV = "JAX_OVERLAP_WATCHDOG_SECONDS"
_WORKSPACE_ENV = "JAX_OVERLAP_WORKSPACE_BYTES"


def _local_gpus():
  platform = native.platform()
  if platform is None:
    return []
  try:
    return jax.local_devices(backend=platform)
  except RuntimeError:  # no such backend in this process
    return []


def _options(watchdog_seconds, on_timeout, sync_after_launch, trace) -> tuple:
  """The options, each from its argument, else the current setting once prepared, else the environment."""
  if watchdog_seconds is None and _state.prepared:
    watchdog_seconds = _state.watchdog_seconds
  elif watchdog_seconds is None:
    watchdog_seconds = _env_number(_WATCHDOG_ENV, default_watchdog_seconds(), float,
                                   "a positive number of seconds (inf for none)")
    if not watchdog_seconds > 0:
      raise ValueError(f"jax_overlap: {_WATCHDOG_ENV}={os.environ[_WATCHDOG_ENV]!r}; expected a positive number of "
                       f"seconds (inf for none)")
  if not watchdog_seconds > 0:
    raise ValueError(f"initialize: watchdog_seconds must be positive (math.inf for none), got {watchdog_seconds}")
  if on_timeout is None:
    on_timeout = _state.on_timeout if _state.prepared else _env_choice("JAX_OVERLAP_ON_TIMEOUT", "abort", ON_TIMEOUT)
  if on_timeout not in ON_TIMEOUT:
    raise ValueError(f"initialize: on_timeout must be one of {ON_TIMEOUT}, got {on_timeout!r}")
  if sync_after_launch is None:
    sync_after_launch = _state.sync_after_launch if _state.prepared else env_flag("JAX_OVERLAP_SYNC")
  if trace is None:
    trace = _state.trace if _state.prepared else env_flag("JAX_OVERLAP_TRACE")
  return float(watchdog_seconds), on_timeout, bool(sync_after_launch), bool(trace)


def _workspace_bytes_from_env() -> int:
  expected = "a positive number of bytes, such as 1073741824"
  workspace_bytes = _env_number(_WORKSPACE_ENV, DEFAULT_WORKSPACE_BYTES, int, expected)
  if workspace_bytes <= 0:
    raise ValueError(f"jax_overlap: {_WORKSPACE_ENV}={os.environ[_WORKSPACE_ENV]!r}; expected {expected}")
  return workspace_bytes


# --- lifecycle ------------------------------------------------------------------

def prepare_devices() -> bool:
  """Makes the device state of every local GPU (small; no workspace, nothing exchanged). False without GPUs.

  SetupError when a GPU's state cannot be made (out of memory)."""
  with _lock:
    if _state.prepared:
      return True
    local = _local_gpus()
    if not local:
      return False
    options = _options(None, None, None, None)  # from the environment: nothing is prepared yet
    nat = native.module()
    try:
      for d in local:
        nat.init_device(d.local_hardware_id, d.id)
        info = nat.device_info(d.local_hardware_id)
        _state.devices[d.id] = _LocalDevice(d.id, d.local_hardware_id, info["pci_bus_id"], info["sm_count"],
                                            info["smem_per_block"], info["l2_bytes"], info["name"], info["arch"])
    except RuntimeError as e:
      raise SetupError(f"jax_overlap: the device state of GPU {d.local_hardware_id} could not be made: {e}") from e
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
  changes only the options it is given. Raises SetupError when the set-up
  failed on any process (then on every process, and again on every later call
  until shutdown()).
  """
  options = _options(watchdog_seconds, on_timeout, sync_after_launch, trace)
  with _lock:
    if _state.active:
      if workspace_bytes is not None and workspace_bytes != _state.workspace_bytes:
        raise ValueError(f"initialize: the workspace already has {_state.workspace_bytes} bytes per GPU; "
                         f"it cannot change to {workspace_bytes} without jax_overlap.shutdown()")
      _apply_options(*options)
      return workspace_info()
    if _state.setup_failed is not None:
      raise SetupError(f"{_state.setup_failed} (call jax_overlap.shutdown() on every process before "
                       f"initialize() again)")
    if workspace_bytes is None:
      workspace_bytes = _workspace_bytes_from_env()
    if workspace_bytes <= 0:
      raise ValueError(f"initialize: workspace_bytes must be positive, got {workspace_bytes}")
    if not prepare_devices():
      why = ("the native extension is not built for a GPU" if native.platform() is None
             else f"this process has no {native.platform()} devices")
      log.info("jax_overlap.initialize: nothing to do (%s); on a GPU it would allocate %d bytes per GPU, "
               "map peers, and bound waits by %.1f s", why, workspace_bytes, options[0])
      return {**workspace_info(), "reason": why}
    _apply_options(*options)
    try:
      _setup(workspace_bytes)
    except SetupError as e:
      _state.setup_failed = str(e)
      raise
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


def _all_succeed(step: str, attempt) -> None:
  """Runs `attempt` here; SetupError on every process when it raised RuntimeError on any (none waits for one that
  failed: with several processes each says how it went, then all read every answer)."""
  try:
    attempt()
    failure = None
  except RuntimeError as e:
    failure = str(e)
  failures = [(p, f) for p, f in enumerate(gather(f"setup/{step}", failure)) if f is not None]
  if failures:
    several = jax.process_count() > 1
    raise SetupError("jax_overlap: the workspace could not be set up: " +
                     "; ".join(f"process {p}: {f}" if several else f for p, f in failures))


def _setup(workspace_bytes: int) -> None:
  nat = native.module()
  hosts()  # collective the first time: here, before anything else of the set-up, when nothing asked for it before

  def allocate():
    for d in _state.devices.values():
      nat.allocate_workspace(d.ordinal, workspace_bytes)

  _all_succeed("allocate", allocate)
  _all_succeed("map", _map_local_peers if jax.process_count() == 1 else _exchange_handles)
  _all_succeed("copy_path", _choose_copy_paths)
  _state.workspace_bytes = workspace_bytes
  _state.next_offset = 0
  _state.regions = {}
  _state.sites = {}
  _measure_copies()
  _state.active = True
  log.debug("jax_overlap: workspace of %d bytes on %d GPU(s); %d peer(s) reachable; peer link %.0f GB/s, local copy "
            "%.0f GB/s", workspace_bytes, len(_state.devices), len(_state.reachable),
            (_state.link_bytes_per_us or 0) / 1e3, (_state.local_bytes_per_us or 0) / 1e3)


def _choose_copy_paths() -> None:
  """Every pipelined copy of a GPU takes the path verified here on every mapped peer (csrc/pipelined/copy.h);
  RuntimeError when no path lands."""
  nat = native.module()
  for d in _state.devices.values():
    choice = nat.choose_copy_path(d.ordinal)
    if choice["rejected"]:
      log.info("jax_overlap: GPU %d moves the pipelined algorithm's bytes by %s: %s", d.ordinal, choice["description"],
               "; ".join(choice["rejected"]))


# Bytes each copy measurement moves: long enough for a copy engine's full rate.
_COPY_PROBE_BYTES = 64 << 20


def _measure_copies() -> None:
  """The peer link and the local copy rate, for the cost model (process 0's, on every process)."""
  nat = native.module()
  mine = next(iter(_state.devices.values()))
  probe = min(_COPY_PROBE_BYTES, _state.workspace_bytes)

  def measure():
    peers = sorted(_state.reachable - {mine.global_id})
    local_us = nat.time_copy(mine.ordinal, nat.workspace_peer_base(mine.ordinal, mine.global_id), probe)
    link_us = (nat.time_copy(mine.ordinal, nat.workspace_peer_base(mine.ordinal, peers[0]), probe) if peers
               else local_us)
    return [probe / link_us, probe / local_us]

  _state.link_bytes_per_us, _state.local_bytes_per_us = agree("copies", measure)


# --- several processes: the key-value store --------------------------------------

def _kv_client():
  client = _compat.kv_client()
  if client is None:
    raise RuntimeError("jax_overlap: several processes need jax.distributed.initialize() before "
                       "jax_overlap.initialize()")
  return client


def _prefix() -> str:
  """Key-value names of this runtime generation (shutdown() starts another, on every process)."""
  return f"jax_overlap/{native.module().generation()}"


def digest(value) -> str:
  """A short name for a tuple of ints and strings, the same in every process."""
  return hashlib.sha1(repr(value).encode()).hexdigest()[:16]


def _kv_get(client, key: str, waiting_for: str) -> str:
  try:
    return client.blocking_key_value_get(key, _KV_TIMEOUT_MS)
  except RuntimeError as e:  # jax's key-value errors (a timeout: DEADLINE_EXCEEDED) are RuntimeErrors
    raise SetupError(f"jax_overlap: {waiting_for} did not come within {_KV_TIMEOUT_MS / 1000:.0f} s "
                     f"({key}): {str(e).splitlines()[0]}") from e


def _kv_set(client, key: str, value: str) -> None:
  try:
    client.key_value_set(key, value)
  except RuntimeError as e:  # taken already (a step run twice in one generation), or the store is gone
    raise SetupError(f"jax_overlap: could not publish {key}: {str(e).splitlines()[0]}") from e


def agree(name: str, compute):
  """compute() as process 0 found it, on every process: the measured figures every process's decisions share.

  Only process 0 runs compute(); it publishes the value (JSON) or its failure (a RuntimeError), which every
  process then raises as SetupError, so none waits for a value that will not come. Taken once per name and
  runtime generation in each process.
  """
  key = f"{_prefix()}/agree/{name}"
  with _lock:
    if key not in _agreed:
      _agreed[key] = _agreement(key, compute)
  outcome = _agreed[key]
  if "error" in outcome:
    raise SetupError(f"jax_overlap: {name}: {outcome['error']}")
  return outcome["value"]


def _agreement(key: str, compute) -> dict:
  if jax.process_count() > 1 and jax.process_index() != 0:
    return json.loads(_kv_get(_kv_client(), key, "process 0's measurement"))
  try:
    outcome = {"value": compute()}
  except RuntimeError as e:
    outcome = {"error": f"process 0: {e}" if jax.process_count() > 1 else str(e)}
  if jax.process_count() > 1:
    _kv_set(_kv_client(), key, json.dumps(outcome))
  return outcome


def gather(name: str, value) -> list:
  """Every process's `value` (JSON), in process order; collective.

  Each process publishes its value and waits at a barrier for all, so a process
  that is missing makes the barrier fail on every process alike (SetupError),
  also on one that reaches it late. `name` must be the same on every process
  and used once per runtime generation.
  """
  if jax.process_count() == 1:
    return [value]
  client = _kv_client()
  prefix = f"{_prefix()}/gather/{name}"
  _kv_set(client, f"{prefix}/{jax.process_index()}", json.dumps(value))
  try:
    client.wait_at_barrier(prefix, _KV_TIMEOUT_MS)
    entries = client.key_value_dir_get(f"{prefix}/")
  except RuntimeError as e:
    raise SetupError(f"jax_overlap: not every process reached {name} within {_KV_TIMEOUT_MS / 1000:.0f} s (every "
                     f"process must lower the same programs): {str(e).splitlines()[0]}") from e
  values = {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in entries}
  return [values[p] for p in range(jax.process_count())]


def _hostname() -> str:
  return socket.gethostname()


def hosts() -> dict:
  """The host of every GPU of every process (global id -> host name), the same on every process (collective
  the first time in a runtime generation)."""
  with _lock:
    if _state.hosts is None:
      mine = {"host": _hostname(), "devices": sorted(d.id for d in _local_gpus())}
      _state.hosts = {gid: p["host"] for p in gather("hosts", mine) for gid in p["devices"]}
    return _state.hosts


def _map_local_peers() -> None:
  nat = native.module()
  for a in _state.devices.values():
    for b in _state.devices.values():
      nat.map_local_peer(a.ordinal, b.ordinal)
  _state.reachable = set(_state.devices)


def _exchange_handles() -> None:
  """Publish this process's IPC handles and import those of every device on this host."""
  nat = native.module()
  client = _kv_client()
  host = _hostname()
  prefix = f"{_prefix()}/device"
  for d in _state.devices.values():
    _kv_set(client, f"{prefix}/{d.global_id}", json.dumps({"pci": d.pci_bus_id,
                                                           "handle": nat.export_handle(d.ordinal).hex()}))
  peers = {}
  for gid, peer_host in hosts().items():
    if peer_host != host:
      continue
    if gid in _state.devices:
      peers[gid] = {"pci": _state.devices[gid].pci_bus_id}
    else:
      peers[gid] = json.loads(_kv_get(client, f"{prefix}/{gid}", f"the IPC handle of GPU {gid}"))
  _state.reachable = set()
  for gid, peer in peers.items():
    for d in _state.devices.values():
      if gid in _state.devices:
        nat.map_local_peer(d.ordinal, _state.devices[gid].ordinal)
      else:
        nat.import_peer(d.ordinal, gid, bytes.fromhex(peer["handle"]))
    _state.reachable.add(gid)
  for d in _state.devices.values():
    # Ranks on one physical GPU (emulated groups) split its SMs, so that all
    # their persistent kernels are co-resident.
    d.ranks_per_gpu = sum(1 for p in peers.values() if p["pci"] == d.pci_bus_id)
    nat.set_ranks_per_gpu(d.ordinal, d.ranks_per_gpu)


def is_active() -> bool:
  return _state.active


def setup_failed() -> str | None:
  """Why initialize() failed (on every process alike), until shutdown(); None otherwise."""
  return _state.setup_failed


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
  return {d.id for d in _local_gpus()}


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


# --- regions and call sites -------------------------------------------------------

def placement(key: tuple, nbytes: int) -> int:
  """The offset of the region for `key`: where it is, or where it would be placed next (nothing changes).

  WorkspaceFullError when a new region does not fit.
  """
  with _lock:
    if key in _state.regions:
      return _state.regions[key][0]
    offset = -(-_state.next_offset // _REGION_ALIGN) * _REGION_ALIGN
    if offset + nbytes > _state.workspace_bytes:
      need = offset + nbytes
      raise WorkspaceFullError(
          f"jax_overlap {key[0]}: the call needs {nbytes} bytes of symmetric workspace but only "
          f"{max(_state.workspace_bytes - offset, 0)} of {_state.workspace_bytes} are left; set "
          f"JAX_OVERLAP_WORKSPACE_BYTES (or initialize(workspace_bytes=...)) to at least {need} before the "
          f"first call that needs it, or use algorithm='xla' for this call")
    return offset


def place(key: tuple, nbytes: int, offset: int) -> None:
  """Records the region for `key` at `offset` (from placement(), agreed by every process); idempotent."""
  with _lock:
    if key not in _state.regions:
      _state.regions[key] = (offset, nbytes)
      _state.next_offset = max(_state.next_offset, offset + nbytes)


def note_workspace_full(error: WorkspaceFullError) -> None:
  """Says once, at INFO, that calls now take the XLA path for want of workspace, and what to do about it."""
  with _lock:
    if _state.workspace_full_noted:
      return
    _state.workspace_full_noted = True
  log.info("%s. Regions are never freed while the runtime runs: from now on the calls that need a new region take "
           "the XLA path (algorithm='auto'). A larger workspace takes effect at the next set-up: "
           "jax_overlap.shutdown() then initialize() (collective; calls compiled before must be compiled again).",
           error)


def site(key: tuple, name: tuple) -> int:
  """The number (1..65535) of the call site `name` among those sharing the region of `key`.

  `name` says where the call sits (its module and its place in it), so a site
  lowered any number of times, by any process, keeps one number. Numbers are
  given in the order names are first seen; with several processes, through the
  key-value store (the first process to number a name wins). A flag holds 16
  bits of site (csrc/kernels/protocol.h flag_value): numbers repeat every 65535
  names of one key, and only two sites that far apart go unchecked against each other.
  """
  with _lock:
    sites = _state.sites.setdefault(key, {})
    if name not in sites:
      sites[name] = _number_site(key, name, len(sites))
    return sites[name]


def _number_site(key: tuple, name: tuple, known: int) -> int:
  if jax.process_count() == 1:
    return known % _SITES + 1
  client = _kv_client()
  prefix = f"{_prefix()}/site/{digest(key)}"
  entry = f"{prefix}/{digest(name)}"
  try:
    return int(client.key_value_try_get(entry))
  except RuntimeError:  # not numbered yet
    pass
  number = (client.key_value_increment(f"{prefix}/count", 1) - 1) % _SITES + 1
  try:
    client.key_value_set(entry, str(number))
    return number
  except RuntimeError:  # another process numbered it first
    return int(_kv_get(client, entry, "the number of a call site"))


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
  prefix = f"{_prefix()}/{name}"
  client.key_value_set(f"{prefix}/{jax.process_index()}", "1")
  for p in range(jax.process_count()):
    _kv_get(client, f"{prefix}/{p}", f"process {p} at {name}")


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
  """Frees the workspaces and device states and forgets peers, regions and a failed set-up; initialize() may
  run again.

  Calls compiled before refuse to run afterwards (they were bound to the freed
  workspaces): trace and compile them again. With several processes it is
  collective: each finishes its GPUs' work, and none frees its workspace
  before every peer has stopped reading it.
  """
  with _lock:
    if not _state.prepared:
      return  # nothing was set up (and the key-value names of this generation stay taken)
    nat = native.module()
    for d in _state.devices.values():
      nat.synchronize(d.ordinal)
    if _state.active:
      _barrier("shutdown")
    nat.release()
    _state.prepared = False
    _state.active = False
    _state.setup_failed = None
    _state.workspace_full_noted = False
    _state.devices = {}
    _state.reachable = set()
    _state.hosts = None
    _state.regions = {}
    _state.sites = {}
    _state.link_bytes_per_us = None
    _state.local_bytes_per_us = None
