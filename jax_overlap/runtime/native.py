"""The compiled extension (jax_overlap._native), if any; without it every call takes the XLA path."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pathlib

import jax

from jax_overlap._version import __version__

try:
  from jax_overlap import _native  # type: ignore[attr-defined]
  _IMPORT_ERROR = None
except ImportError as e:  # pure-Python install, or a broken build
  _native = None
  # Only a module file that fails to load has news: without one Python blames a circular import.
  _IMPORT_ERROR = None if importlib.util.find_spec("jax_overlap._native") is None else e


def module():
  return _native


def platform() -> str | None:
  return None if _native is None else _native.build_info()["platform"]


def build_info() -> dict:
  """What this installation is (version, platform, archs, compiler, ...); "runs": the path calls take here.

  Example: python -c "import jax_overlap; print(jax_overlap.build_info()['runs'])"  (outside the repository root)
  """
  info = {"version": __version__, "jax": jax.__version__, "platform": None, "archs": None, "compiler": None,
          "ffi_api": None, "fused_kernels": False}
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
  if gpu_available():
    info["runs"] = (f"on {platform()}, algorithm='auto' takes the pipelined algorithm for groups of two or more where "
                    f"the cost model predicts a gain over XLA, and the XLA path elsewhere (XLA's dot for a group of "
                    f"one); the fused kernels run when asked for (algorithm='fused')")
  else:
    info["runs"] = (f"the XLA path: built for {platform()}, but this process has no {platform()} devices "
                    f"(JAX backend: {jax.default_backend()})")
  return info


_PACKAGE_DIR = pathlib.Path(__file__).resolve().parents[1]


def _shadowed_install() -> str | None:
  """The installed package's directory when Python imported another copy (a checkout first on sys.path)."""
  try:
    installed = pathlib.Path(importlib.metadata.distribution("jax-overlap").locate_file("jax_overlap")).resolve()
  except importlib.metadata.PackageNotFoundError:
    return None
  if installed == _PACKAGE_DIR or not (installed / "__init__.py").is_file():
    return None
  return str(installed)


def gpu_available() -> bool:
  """True when this build's GPU algorithms (pipelined, fused) can run here.

  Example: algorithm = "pipelined" if jax_overlap.gpu_available() else "xla"
  """
  if _native is None:
    return False
  try:
    return bool(jax.devices(platform()))
  except RuntimeError:
    return False
