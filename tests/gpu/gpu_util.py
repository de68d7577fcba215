"""Shared helpers of the GPU tests: skip reasons, random data, tolerances."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from jax_overlap import native


def gpu_available() -> bool:
  try:
    return native.platform() is not None and any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    return False


requires_gpu = pytest.mark.skipif(not gpu_available(),
                                  reason="needs a GPU and a GPU build of jax_overlap (runs on the device machine)")


def random(rng: np.random.Generator, shape, dtype, scale: float = 1.0) -> np.ndarray:
  """Normal random values, rounded to dtype (never zeros or ones)."""
  return (rng.standard_normal(shape) * scale).astype(dtype)


def rel_err(out, ref) -> float:
  out = np.asarray(out, np.float64)
  ref = np.asarray(ref, np.float64)
  if not np.all(np.isfinite(out)):
    return float("inf")
  return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def tolerance(dtype) -> float:
  """Relative-norm tolerance of a GEMM with fp32 accumulation and output rounded to dtype."""
  return {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-5}[np.dtype(dtype).name]


def in_command_buffer(compiled_hlo: str) -> bool:
  """Whether XLA put some of a compiled program into a command buffer (a computation named command_buffer...).
  The word inside a longer name is no evidence: the op metadata quotes the test's own name, which may hold it."""
  return re.search(r"(?<!\w)command_buffer", compiled_hlo) is not None
