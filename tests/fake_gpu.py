"""A stand-in for the native module that lets the real runtime and lowering run on CPU devices.

The runtime, the planner and the lowering run unchanged (workspace set-up,
peers, the key-value store, the measured figures, decisions, regions, sites) on
a backend (jax_overlap/runtime/backend.py) whose native module is a FakeNative and
whose GPUs are the CPU devices: memory it allocates is a count, copies and
GEMMs take the times of a model GPU, and its failures are those of the real
module (RuntimeError). Lowering for "cuda" then emits the custom calls a GPU
would get.

  FakeNative(gemm_scale=2.0, fail={"allocate_workspace", "prepare_vendor_blas"})
  install(setattr, fake, host="host-a")   # setattr: pytest's monkeypatch.setattr, or builtins.setattr

Only the pipelined algorithm is planned (no fused tiles: their launch is the compiled module's).
FakeNative defines what the package calls of the native module, by the same names and parameters
(tests/test_native_surface.py holds the two to each other).
"""

from __future__ import annotations

import socket

import jax

from jax_overlap.runtime import backend

# The model GPU: the GEMM at 700 TFLOP/s (a chunk's share 5% slower than the whole), copies within a GPU at
# 2 TB/s and between GPUs at 300 GB/s.
GEMM_FLOPS_PER_US = 7e8
LOCAL_BYTES_PER_US = 2e6
LINK_BYTES_PER_US = 3e5


class _Targets(dict):
  def __missing__(self, name):
    return f"jax_overlap_{name}"


class FakeNative:
  """The native module's functions on CPU devices; `fail` names those that raise as out of memory would.
  Copies between GPUs run at `link_bytes_per_us`."""

  DEFAULT_WATCHDOG_SECONDS = 600.0

  def __init__(self, gemm_scale: float = 1.0, fail=(), link_bytes_per_us: float = LINK_BYTES_PER_US):
    self.gemm_scale = gemm_scale
    self.fail = set(fail)
    self.link_bytes_per_us = link_bytes_per_us
    self.gen = 1
    self.workspaces = {}  # ordinal -> bytes
    self.calls = []  # (function, args) of the set-up functions, in order
    self.timed_gemms = []  # (x dtype, w dtype, out dtype, w_kmajor) of each time_gemms, in order (None: x's)
    self.gemm_tuning = []  # the tuning options (candidates, margin, cache_dir) of each time_gemms
    self.tuned = []  # (ordinal, problem id, candidates, cache_dir) of each tune_gemm
    self.installed = []  # (ordinal, problem id, choice) of each install_gemm_algo
    self.choice_salt = 0  # makes tune_gemm's choices this process's own (tests of the agreement between processes)

  def _maybe_fail(self, name: str, *args) -> None:
    self.calls.append((name, args))
    if name in self.fail:
      raise RuntimeError(f"{name}: out of memory (FakeNative)")

  def generation(self) -> int:
    return self.gen

  def release(self) -> None:
    self.workspaces.clear()
    self.gen += 1

  def build_info(self) -> dict:
    return {"platform": "cuda", "archs": "90", "compiler": "FakeNative", "ffi_api": "0.3", "fused_kernels": False}

  def targets(self):
    return _Targets()

  def registrations(self):
    return {}

  def type_registrations(self):
    return {}

  def tile_shapes(self):
    return []

  def gemm_geometry(self, op, tile, dtype, w_kmajor, world, batch, m, k, n, chunk_k, comm_workgroups, sm_count,
                    ranks_per_gpu, l2_bytes, workgroups_per_sm=0):
    raise RuntimeError(f"gemm_geometry: FakeNative compiles no tiles, got tile {tile}")

  def init_device(self, ordinal, global_id):
    self._maybe_fail("init_device", ordinal, global_id)

  def device_info(self, ordinal):
    return {"pci_bus_id": f"0000:{ordinal:02x}:00.0", "sm_count": 132, "smem_per_block": 232448, "l2_bytes": 50 << 20,
            "name": "FakeNative GPU", "arch": "sm_90"}

  def set_abort_on_timeout(self, abort):
    pass

  def set_options(self, ordinal, watchdog_seconds, sync_after_launch, trace):
    pass

  def allocate_workspace(self, ordinal, bytes):
    self._maybe_fail("allocate_workspace", ordinal, bytes)
    self.workspaces[ordinal] = bytes

  def export_handle(self, ordinal) -> bytes:
    return bytes([ordinal % 256]) * 8

  def import_peer(self, ordinal, peer_id, handle):
    self._maybe_fail("import_peer", ordinal, peer_id)

  def map_local_peer(self, ordinal, peer_ordinal):
    self._maybe_fail("map_local_peer", ordinal, peer_ordinal)

  def set_ranks_per_gpu(self, ordinal, ranks):
    pass

  def workspace_peer_base(self, ordinal, global_id) -> int:
    return (global_id + 1) << 40

  def time_copy(self, ordinal, src, bytes, repeats=5, path=None, piece_bytes=0) -> float:
    self._maybe_fail("time_copy", ordinal)
    own = src in (0, (jax.local_devices()[ordinal].id + 1) << 40)
    return bytes / (LOCAL_BYTES_PER_US if own else self.link_bytes_per_us)

  def time_gemms(self, ordinal, dtype, rows, n, k, w_kmajor=False, repeats=5, warmup_ms=0.0, w_dtype=None,
                 out_dtype=None, blocks=False, fast_accumulation=False, candidates=1, margin=0.02,
                 cache_dir="") -> list:
    self._maybe_fail("time_gemms", ordinal)
    self.timed_gemms.append((dtype, w_dtype, out_dtype, w_kmajor))
    self.gemm_tuning.append((candidates, margin, cache_dir))
    whole = rows[-1]
    rate = GEMM_FLOPS_PER_US * (2 if w_dtype is not None else 1)  # float8 at twice the 16-bit rate
    return [self.gemm_scale * 2.0 * r * n * k / rate * (1.05 if r < whole else 1.0) for r in rows]

  def time_reduce(self, ordinal, dtype, count, rows, n, repeats=5) -> float:
    self._maybe_fail("time_reduce", ordinal)
    itemsize = 4 if dtype == "float32" else 2
    return self.gemm_scale * (count + 1) * rows * n * itemsize / (2 * LOCAL_BYTES_PER_US)

  def prepare_vendor_blas(self, ordinal):
    self._maybe_fail("prepare_vendor_blas", ordinal)
    return {"checked_now": False, "graph_safe": True, "detail": ""}

  def vendor_gemm_graph_safe(self) -> bool:
    return True

  def gemm_problems(self, op, world, call, sm_count) -> list:
    """One problem per distinct stage size (the native module's also cover each rank's wrapped ranges)."""
    del sm_count
    rows = call["m"] if op == "ag_matmul" or world == 1 else call["m"] // world
    return [f"{op};{call['dtype']};rows:{call['batch'] * rows * s if world == 1 else rows * s};k:{call['k']};"
            f"n:{call['n']};bias:{int(call['bias'])}" for s in sorted(set(call["stages"]))]

  def tune_gemm(self, ordinal, id, candidates, margin, cache_dir=""):
    del margin
    self._maybe_fail("tune_gemm", ordinal)
    self.tuned.append((ordinal, id, candidates, cache_dir))
    timed = candidates > 1
    return {"choice": f"{(len(id) + self.choice_salt) % 256:02x}" * 64, "source": "timed" if timed else "heuristic",
            "index": int(timed),
            "candidates": candidates, "timed": candidates if timed else 0, "dropped": 0, "us": 1.0,
            "first_us": 1.1 if timed else 0.0, "detail": "" if timed else "tuning is off (one candidate)"}

  def install_gemm_algo(self, ordinal, id, choice, candidates) -> bool:
    del candidates
    self._maybe_fail("install_gemm_algo", ordinal)
    self.installed.append((ordinal, id, choice))
    return True

  def choose_copy_path(self, ordinal):
    self._maybe_fail("choose_copy_path", ordinal)
    return {"path": "copy_engine", "description": "the copy engine", "rejected": []}

  def pipelined_scratch_bytes(self, op, world, batch, m, n, out_bytes, loopback=False) -> int:
    return 256

  def pipelined_region_bytes(self, op, world, batch, m, k, n, x_bytes, out_bytes, scaled=False, blocks=False) -> int:
    if op == "ag_matmul":  # two slots, each with a header of the shard's scale (or block scales)
      return 4096 + world * batch * m * k * x_bytes + (2 * m * k // 32 if blocks else 512 * scaled)
    return 4096 + batch * m * n * out_bytes

  def all_gather_region_bytes(self, world, rows, row_bytes) -> int:
    return 4096 + world * rows * row_bytes

  def synchronize(self, ordinal):
    pass

  def error_record(self, ordinal):
    return None

  def stop_after_error(self, ordinal):
    self._maybe_fail("stop_after_error", ordinal)

  def restart_after_error(self, ordinal):
    self._maybe_fail("restart_after_error", ordinal)

  def read_trace(self, ordinal):
    return b"", 1.0


def install(set_attr, fake: FakeNative, host: str | None = None, gpus=jax.local_devices) -> backend.Backend:
  """Makes jax_overlap run on a fresh backend: `fake` for its native module ("cuda") and this process's CPU
  devices (or `gpus()`) for its GPUs, on `host`."""
  machine = backend.Backend(fake, "cuda", gpus=gpus, host=socket.gethostname if host is None else lambda: host)
  set_attr(backend, "_current", machine)
  return machine


def cuda_text(f, *args) -> str:
  """The StableHLO of jitted f on arguments (or their specs) lowered for "cuda", as a GPU would get it."""
  return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def custom_calls(text: str) -> list:
  """The lines of jax_overlap's custom calls in lowered text."""
  return [line for line in text.splitlines() if "stablehlo.custom_call @jax_overlap" in line]
