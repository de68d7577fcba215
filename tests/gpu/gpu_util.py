"""Shared helpers of the GPU tests: skip reasons, random data, device buffers, command buffers (tolerances:
tests/tolerance.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_overlap
import native_testing

harness = native_testing.module()


requires_gpu = pytest.mark.skipif(not jax_overlap.gpu_available(),
                                  reason="needs an NVIDIA or AMD GPU and a GPU build of jax_overlap")


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


def vendor_gemm_runs(run) -> tuple[int, int]:
  """(executions of the vendor_gemm targets during run(), how many of them XLA recorded into a command buffer).
  XLA (jax >= 0.11) forms command buffers from its thunks after the HLO, so the compiled HLO text no longer
  shows them: the handler counts the executions it sees under stream capture. Seen on jax 0.11.2 (H200): XLA
  runs a command buffer's commands directly on a program's first run, records them on the second (the handler
  under capture) and replays them after that."""
  harness.count_vendor_gemm_runs(True)  # off outside tests: the capture query costs host time on every call
  try:
    before = harness.vendor_gemm_runs()
    run()
    after = harness.vendor_gemm_runs()
  finally:
    harness.count_vendor_gemm_runs(False)
  return after["runs"] - before["runs"], after["captured"] - before["captured"]
