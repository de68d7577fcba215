"""Two JAX processes on one GPU under MPS, and one process per GPU where there are several
(the full sweep is `python tests/gpu/multiprocess.py`)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

import multiprocess
from gpu_util import requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]


def _failed(results):
  """Each failed check, and the end of a failed worker's stderr (its exception)."""
  failed = {f"{name} (rank {r['rank']}): {c['detail']}" for r in results for name, c in r["checks"].items()
            if not c["ok"]}
  failed |= {f"stderr (rank {r['rank']}): {r['stderr'][-1500:]}" for r in results if not r["ok"] and r["stderr"]}
  return failed


def failed_under_mps(world: int, **env) -> set:
  """The failed checks of `world` processes on this GPU under MPS, with `env` added to theirs."""
  with tempfile.TemporaryDirectory() as tmp:
    mps_env = multiprocess._start_mps(tmp)
    try:
      results = multiprocess.run_world(world, dict(mps_env, **env), per_gpu=False, timeout=300)
    finally:
      multiprocess._stop_mps(mps_env)
  return _failed(results)


requires_mps = pytest.mark.skipif(shutil.which("nvidia-cuda-mps-control") is None,
                                  reason="needs NVIDIA MPS to run several processes on one GPU")


@requires_mps
def test_two_processes_one_gpu():
  failed = failed_under_mps(2)
  assert not failed, failed


@pytest.mark.skipif(shutil.which("nvidia-smi") is None or multiprocess._gpu_count() < 2,
                    reason="needs 2 or more GPUs on this machine")
def test_one_process_per_gpu():
  results = multiprocess.run_world(multiprocess._gpu_count(), dict(os.environ, NCCL_NVLS_ENABLE="0"), per_gpu=True,
                                   timeout=300)
  failed = _failed(results)
  assert not failed, failed
