"""The compiled extension (jax_overlap._native): what it was built for and its FFI targets.

A pure-Python install has no extension; everything then runs the XLA
reference path and `build_info()` says so.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import logging
import os
import pathlib
import threading

import jax

from jax_overlap import config

log = logging.getLogger("jax_overlap")

try:
  from jax_overlap import _native  # type: ignore[attr-defined]
  _IMPORT_ERROR = None
except ImportError as e:  # pure-Python install, or a broken build
  _native = None
  # Without the module file Python words the failed import as a possible
  # circular import; only a module that exists and fails to load has news.
  _IMPORT_ERROR = None if importlib.util.find_spec("jax_overlap._native") is None else e

# jax platform names of the GPU backends, and XLA's names for the same.
_XLA_PLATFORM = {"cuda": "CUDA", "rocm": "ROCM"}

_register_lock = threading.Lock()
_registered = False


def module():
  """The extension module, or None on a pure-Python install."""
  return _native


def platform() -> str | None:
  """"cuda" or "rocm": the GPU platform the extension was built for; None without one."""
  return None if _native is None else _native.build_info()["platform"]


def build_info() -> dict:
  """What this installation is (platform, archs, compiler, FFI API, fused kernels, JAX version) and what runs here.

  "runs" says which path calls take in this process. A GPU build with its GPUs: algorithm="auto" gives a group of
  two or more the pipelined algorithm where the cost model predicts a gain over XLA, and a group of one XLA's dot;
  the fused kernels run when asked for. A GPU build on a machine without its GPUs runs the XLA path, like a
  pure-Python install.
  """
  info = {"jax": jax.__version__, "platform": None, "archs": None, "compiler": None, "ffi_api": None,
          "fused_kernels": False}
  if _native is None:
    why = "no native extension in this installation" if _IMPORT_ERROR is None else \
        f"the native extension failed to load: {_IMPORT_ERROR}"
    installed = _shadowed_install()
    if installed is not None:
      why = (f"no native extension in {_PACKAGE_DIR}: Python imported these sources, which come before the installed "
             f"package in {installed} on sys.path (as the current directory does, or PYTHONPATH); run from another "
             f"directory")
    info["note"] = f"{why}; the XLA reference path serves every call"
    info["runs"] = f"the XLA path ({why})"
    return info
  info.update(_native.build_info())
  if fused_available():
    info["runs"] = (f"on {platform()}, algorithm='auto' takes the pipelined algorithm for groups of two or more where "
                    f"the cost model predicts a gain over XLA, and the XLA path elsewhere (XLA's dot for a group of "
                    f"one); the fused kernels run when asked for (algorithm='fused')")
  else:
    info["runs"] = (f"the XLA path: built for {platform()}, but this process has no {platform()} devices "
                    f"(JAX backend: {jax.default_backend()})")
  return info


_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent


def _shadowed_install() -> str | None:
  """The installed package's directory when this import came from another copy (a source checkout first on
  sys.path), else None. An editable install has no package directory of its own: its import hook maps the
  package to the sources."""
  try:
    installed = pathlib.Path(importlib.metadata.distribution("jax-overlap").locate_file("jax_overlap")).resolve()
  except importlib.metadata.PackageNotFoundError:
    return None
  if installed == _PACKAGE_DIR or not (installed / "__init__.py").is_file():
    return None
  return str(installed)


def fused_available() -> bool:
  """True when this build's GPU algorithms (pipelined, fused) can run here: built for a GPU platform this process
  has."""
  if _native is None:
    return False
  try:
    return bool(jax.devices(platform()))
  except RuntimeError:  # no such backend in this process
    return False


def ensure_registered() -> None:
  """Registers the state type and FFI targets with XLA for the built platform, once.

  Called from the GPU lowering rule, i.e. after the GPU backend exists: XLA
  applies registrations queued before backend start-up in an order that can
  put a handler before the state type it uses.
  """
  global _registered
  if _registered or _native is None:
    return
  with _register_lock:
    if _registered:
      return
    xla_platform = _XLA_PLATFORM[platform()]
    for name, registration in _native.type_registrations().items():
      jax.ffi.register_ffi_type(name, registration, platform=xla_platform)
    for name, stages in _native.registrations().items():
      jax.ffi.register_ffi_target(name, stages, platform=xla_platform)
    _registered = True


def target(op: str) -> str:
  """XLA custom-call target name of an op ("ag_matmul", "matmul_rs", "all_gather")."""
  return _native.targets()[op]


@functools.cache
def _compiled_tile_shapes() -> tuple[config.TileShape, ...]:
  return tuple(config.TileShape(**d) for d in _native.tile_shapes())


def tile_shapes() -> tuple[config.TileShape, ...]:
  """The compiled tiles the planner takes: the build's own ArchTraits', or those named by
  JAX_OVERLAP_ARCH_TRAITS (debug: "amd" runs the AMD data path on a CUDA build's mma.sync atom)."""
  arch = os.environ.get("JAX_OVERLAP_ARCH_TRAITS") or None
  try:
    return config.tiles_for_arch(_compiled_tile_shapes(), arch)
  except ValueError as e:
    raise ValueError(f"jax_overlap: JAX_OVERLAP_ARCH_TRAITS={arch!r}: {e}") from None


def gemm_geometry(op: str, tile: config.TileShape, comm_workgroups: int, chunk_k: int, *, dtype_name: str,
                  w_kmajor: bool, world: int, batch: int, m: int, k: int, n: int, device: config.DeviceProps,
                  workgroups_per_sm: int = 0) -> config.GemmGeometry:
  """The launch C++ makes of a fused call (csrc/kernels/launch.h gemm_geometry). m: ag_matmul's local
  rows, matmul_rs's total rows, per batch element. workgroups_per_sm == 0: the kernel's occupancy,
  queried on the current GPU."""
  return config.GemmGeometry(**_native.gemm_geometry(
      op, tile.index, dtype_name, w_kmajor, world, batch, m, k, n, chunk_k, comm_workgroups, device.sm_count,
      device.ranks_per_gpu, device.l2_bytes, workgroups_per_sm))
