"""The environment settings: every name, and each runtime setting's default and check, at import and again where
read. An unknown JAX_OVERLAP_* name warns: a misspelled kill switch must not leave the GPU paths on in silence."""

from __future__ import annotations

import difflib
import math
import os
import warnings

WORKSPACE_BYTES = "JAX_OVERLAP_WORKSPACE_BYTES"
WATCHDOG_SECONDS = "JAX_OVERLAP_WATCHDOG_SECONDS"
ON_TIMEOUT = "JAX_OVERLAP_ON_TIMEOUT"
SYNC = "JAX_OVERLAP_SYNC"
TRACE = "JAX_OVERLAP_TRACE"
DISABLE = "JAX_OVERLAP_DISABLE"
PIPELINE_STAGES = "JAX_OVERLAP_PIPELINE_STAGES"
ARCH_TRAITS = "JAX_OVERLAP_ARCH_TRAITS"
GEMM_SM_MARGIN = "JAX_OVERLAP_GEMM_SM_MARGIN"
GEMM_TUNING = "JAX_OVERLAP_GEMM_TUNING"
GEMM_CANDIDATES = "JAX_OVERLAP_GEMM_CANDIDATES"
GEMM_CACHE_DIR = "JAX_OVERLAP_GEMM_CACHE_DIR"
MAXTEXT_ALGORITHM = "JAX_OVERLAP_MAXTEXT_ALGORITHM"
MAXTEXT_FP8 = "JAX_OVERLAP_MAXTEXT_FP8"
MAXTEXT_FP8_CAST = "JAX_OVERLAP_MAXTEXT_FP8_CAST"
FAULTS = "JAX_OVERLAP_FAULTS"
# With the build's (pyproject.toml cmake.define) and tools/check_isa.py's.
NAMES = frozenset({WORKSPACE_BYTES, WATCHDOG_SECONDS, ON_TIMEOUT, SYNC, TRACE, DISABLE, PIPELINE_STAGES, ARCH_TRAITS,
                   GEMM_SM_MARGIN, GEMM_TUNING, GEMM_CANDIDATES, GEMM_CACHE_DIR, MAXTEXT_ALGORITHM, MAXTEXT_FP8,
                   MAXTEXT_FP8_CAST, FAULTS, "JAX_OVERLAP_PLATFORM", "JAX_OVERLAP_CUDA_ARCHS",
                   "JAX_OVERLAP_HIP_ARCHS", "JAX_OVERLAP_ISA_WARN"})

DEFAULT_WORKSPACE_BYTES = 1 << 30
# Candidates timed per GEMM problem (docs/performance.md, "Where the code's constants come from").
DEFAULT_GEMM_CANDIDATES = 32
ON_TIMEOUT_CHOICES = ("abort", "raise")
ARCH_TRAITS_CHOICES = ("nvidia", "amd")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def _text(name: str) -> str | None:
  return os.environ.get(name)


def flag(name: str) -> bool:
  text = _text(name) or ""
  if text.strip().lower() in _TRUE:
    return True
  if text.strip().lower() in _FALSE:
    return False
  raise ValueError(f"jax_overlap: {name}={text!r} is not a switch; expected 1 or 0 (or true/false, yes/no, on/off)")


def _number(name: str, default, parse, expected: str, valid):
  text = _text(name)
  if text is None:
    return default
  try:
    value = parse(text)
  except ValueError:
    raise ValueError(f"jax_overlap: {name}={text!r} is not a number; expected {expected}") from None
  if not valid(value):
    raise ValueError(f"jax_overlap: {name}={text!r}; expected {expected}")
  return value


def choice(name: str, default: str, choices: tuple) -> str:
  text = _text(name)
  if text is None or text == "":
    return default
  if text not in choices:
    raise ValueError(f"jax_overlap: {name}={text!r}; expected one of {', '.join(choices)}")
  return text


def workspace_bytes() -> int:
  return _number(WORKSPACE_BYTES, DEFAULT_WORKSPACE_BYTES, int, "a positive number of bytes, such as 1073741824",
                 lambda v: v > 0)


def watchdog_seconds(default: float) -> float:
  return _number(WATCHDOG_SECONDS, default, float, "a positive number of seconds (inf for none)",
                 lambda v: v > 0 and not math.isnan(v))


def on_timeout() -> str:
  return choice(ON_TIMEOUT, "abort", ON_TIMEOUT_CHOICES)


def disabled() -> bool:
  """The kill switch: every call takes the XLA path."""
  return flag(DISABLE)


def pipeline_stages() -> str | None:
  return _text(PIPELINE_STAGES) or None


def arch_traits() -> str | None:
  text = _text(ARCH_TRAITS)
  return choice(ARCH_TRAITS, "", ARCH_TRAITS_CHOICES) if text else None


def gemm_sm_margin() -> int:
  return _number(GEMM_SM_MARGIN, 0, int, "a whole number of SMs, 0 or more", lambda v: v >= 0)


def gemm_tuning() -> bool:
  """On unless set to a false switch."""
  return _text(GEMM_TUNING) is None or flag(GEMM_TUNING)


def gemm_candidates() -> int:
  return _number(GEMM_CANDIDATES, DEFAULT_GEMM_CANDIDATES, int, "a whole number of candidates, 1 or more (1: the "
                 "heuristic's first)", lambda v: v >= 1)


def gemm_cache_dir() -> str | None:
  return _text(GEMM_CACHE_DIR) or None


def plan_settings() -> tuple:
  """The settings that change a plan, as written: part of each decision's name (planning/agreement)."""
  return tuple(os.environ.get(name, "") for name in (PIPELINE_STAGES, ARCH_TRAITS))


def check_all() -> None:
  warn_unknown()
  workspace_bytes()
  watchdog_seconds(math.inf)
  on_timeout()
  for name in (SYNC, TRACE, DISABLE):
    flag(name)
  arch_traits()
  gemm_sm_margin()
  gemm_tuning()
  gemm_candidates()
  gemm_cache_dir()
  stages = pipeline_stages()
  if stages is not None and not all(s.strip().isdigit() and int(s) > 0 for s in stages.split(",")):
    raise ValueError(f"jax_overlap: {PIPELINE_STAGES}={stages!r}; expected stage sizes of at least one chunk "
                     f"separated by commas, such as 1,3")


def warn_unknown() -> None:
  for name in sorted(n for n in os.environ if n.startswith("JAX_OVERLAP_") and n not in NAMES):
    near = difflib.get_close_matches(name, sorted(NAMES), n=1, cutoff=0.6)
    hint = f"did you mean {near[0]}?" if near else f"the settings are {', '.join(sorted(NAMES))}"
    warnings.warn(f"jax_overlap: the environment variable {name} is no setting of jax_overlap and is ignored; {hint}",
                  UserWarning, stacklevel=3)
