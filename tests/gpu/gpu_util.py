"""Shared helpers of the GPU tests: skip reasons, random data, device buffers, command buffers (tolerances:
tests/tolerance.py)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_overlap


requires_gpu = pytest.mark.skipif(not jax_overlap.gpu_available(),
                                  reason="needs a GPU and a GPU build of jax_overlap (runs on the device machine)")


def random(rng: np.random.Generator, shape, dtype, scale: float = 1.0) -> np.ndarray:
  """Normal random values, rounded to dtype (never zeros or ones)."""
  return (rng.standard_normal(shape) * scale).astype(dtype)


def on_gpu(a):
  """`a` on the first GPU, there already."""
  return jax.device_put(a, jax.devices()[0]).block_until_ready()


def poisoned(shape, dtype):
  """NaN of `dtype` on the first GPU: an output a call must overwrite."""
  return jnp.full(shape, jnp.nan, dtype).block_until_ready()


def pointer(a) -> int:
  """A device array's address for the native module's calls (0 for None)."""
  return a.unsafe_buffer_pointer() if a is not None else 0


def in_command_buffer(compiled_hlo: str) -> bool:
  """Whether XLA put some of a compiled program into a command buffer (a computation named command_buffer...).
  The word inside a longer name is no evidence: the op metadata quotes the test's own name, which may hold it."""
  return re.search(r"(?<!\w)command_buffer", compiled_hlo) is not None
