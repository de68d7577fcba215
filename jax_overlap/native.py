"""The compiled extension (jax_overlap._native) this installation has, and what it was built for.

A pure-Python install has no extension; everything then runs the XLA
reference path and `build_info()` says so. What runs uses the extension
through backend.current() (its FFI targets, tiles, sizes, the runtime's
functions), which tests may point at a stand-in.
"""

from __future__ import annotations

import importlib.util

import jax

try:
  from jax_overlap import _native  # type: ignore[attr-defined]
  _IMPORT_ERROR = None
except ImportError as e:  # pure-Python install, or a broken build
  _native = None
  # Without the module file Python words the failed import as a possible
  # circular import; only a module that exists and fails to load has news.
  _IMPORT_ERROR = None if importlib.util.find_spec("jax_overlap._native") is None else e


def module():
  """The extension module, or None on a pure-Python install."""
  return _native


def platform() -> str | None:
  """"cuda" or "rocm": the GPU platform the extension was built for; None without one."""
  return None if _native is None else _native.build_info()["platform"]


def build_info() -> dict:
  """What this installation is (platform, archs, compiler, FFI API, fused kernels, JAX version) and what runs here.

  "runs" says which path calls take in this process: a GPU build on a machine
  without its GPUs runs the XLA path like a pure-Python install.
  """
  info = {"jax": jax.__version__, "platform": None, "archs": None, "compiler": None, "ffi_api": None,
          "fused_kernels": False}
  if _native is None:
    why = "no native extension in this installation" if _IMPORT_ERROR is None else \
        f"the native extension failed to load: {_IMPORT_ERROR}"
    info["note"] = f"{why}; the XLA reference path serves every call"
    info["runs"] = f"the XLA path ({why})"
    return info
  info.update(_native.build_info())
  if gpu_available():
    info["runs"] = (f"the fused kernels on {platform()} where a call is eligible (algorithm='auto' picks per call), "
                    f"else the XLA path")
  else:
    info["runs"] = (f"the XLA path: built for {platform()}, but this process has no {platform()} devices "
                    f"(JAX backend: {jax.default_backend()})")
  return info


def gpu_available() -> bool:
  """True when this build's GPU algorithms can run here: built for a GPU platform this process has."""
  if _native is None:
    return False
  try:
    return bool(jax.devices(platform()))
  except RuntimeError:  # no such backend in this process
    return False
