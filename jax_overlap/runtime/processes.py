"""Steps with the other processes through the jax.distributed key-value store. Each is named by what it is about
(never by how often a process lowered) and the runtime generation; every wait is bounded: an error, never a hang."""

from __future__ import annotations

import hashlib
import json

import jax

from jax_overlap import _compat
from jax_overlap.runtime import backend
from jax_overlap.runtime.errors import SetupError

# Far longer than any lowering or set-up takes, far shorter than the watchdog.
_KV_TIMEOUT_MS = 120_000


def client():
  kv = _compat.kv_client()
  if kv is None:
    raise RuntimeError("jax_overlap: several processes need jax.distributed.initialize() before "
                       "jax_overlap.initialize()")
  return kv


def prefix() -> str:
  """This runtime generation's names (shutdown() starts another)."""
  return f"jax_overlap/{backend.current().native.generation()}"


def digest(value) -> str:
  return hashlib.sha1(repr(value).encode()).hexdigest()[:16]


def get(kv, key: str, waiting_for: str) -> str:
  try:
    return kv.blocking_key_value_get(key, _KV_TIMEOUT_MS)
  except RuntimeError as e:
    raise SetupError(f"jax_overlap: {waiting_for} did not come within {_KV_TIMEOUT_MS / 1000:.0f} s "
                     f"({key}): {str(e).splitlines()[0]}") from e


def put(kv, key: str, value: str) -> None:
  try:
    kv.key_value_set(key, value)
  except RuntimeError as e:  # taken already (a step run twice in a generation), or the store is gone
    raise SetupError(f"jax_overlap: could not publish {key}: {str(e).splitlines()[0]}") from e


def agree(name: str, compute):
  """compute() as process 0 found it (its RuntimeError too, so none waits), once per name and generation."""
  key = f"{prefix()}/agree/{name}"
  machine = backend.current()
  with machine.lock:
    if key not in machine.state.agreed:
      machine.state.agreed[key] = _agreement(key, compute)
  outcome = machine.state.agreed[key]
  if "error" in outcome:
    raise SetupError(f"jax_overlap: {name}: {outcome['error']}")
  return outcome["value"]


def _agreement(key: str, compute) -> dict:
  if jax.process_count() > 1 and jax.process_index() != 0:
    return json.loads(get(client(), key, "process 0's measurement"))
  try:
    outcome = {"value": compute()}
  except RuntimeError as e:
    outcome = {"error": f"process 0: {e}" if jax.process_count() > 1 else str(e)}
  if jax.process_count() > 1:
    put(client(), key, json.dumps(outcome))
  return outcome


def gather(name: str, value) -> list:
  """Every process's `value` in process order; collective: a missing or late process fails every one alike."""
  if jax.process_count() == 1:
    return [value]
  kv = client()
  step = f"{prefix()}/gather/{name}"
  put(kv, f"{step}/{jax.process_index()}", json.dumps(value))
  try:
    kv.wait_at_barrier(step, _KV_TIMEOUT_MS)
    entries = kv.key_value_dir_get(f"{step}/")
  except RuntimeError as e:
    raise SetupError(f"jax_overlap: not every process reached {name} within {_KV_TIMEOUT_MS / 1000:.0f} s (every "
                     f"process must lower the same programs): {str(e).splitlines()[0]}") from e
  values = {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in entries}
  return [values[p] for p in range(jax.process_count())]


def hosts() -> dict:
  """Global GPU id -> host name of every process's GPUs (collective the first time in a generation)."""
  machine = backend.current()
  with machine.lock:
    if machine.state.hosts is None:
      mine = {"host": machine.hostname(), "devices": sorted(d.id for d in machine.local_gpus())}
      machine.state.hosts = {gid: p["host"] for p in gather("hosts", mine) for gid in p["devices"]}
    return machine.state.hosts


def barrier(name: str) -> None:
  if jax.process_count() == 1:
    return
  kv = client()
  step = f"{prefix()}/{name}"
  put(kv, f"{step}/{jax.process_index()}", "1")
  for p in range(jax.process_count()):
    get(kv, f"{step}/{p}", f"process {p} at {name}")
