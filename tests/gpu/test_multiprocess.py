"""Two JAX processes on one GPU under MPS (the full sweep is `python tests/gpu/multiprocess.py`)."""

from __future__ import annotations

import shutil
import tempfile

import pytest

import multiprocess
from gpu_util import requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu,
              pytest.mark.skipif(shutil.which("nvidia-cuda-mps-control") is None,
                                 reason="needs NVIDIA MPS to run several processes on one GPU")]


def test_two_processes_one_gpu():
  with tempfile.TemporaryDirectory() as tmp:
    env = multiprocess._start_mps(tmp)
    try:
      results = multiprocess.run_world(2, env, timeout=300)
    finally:
      multiprocess._stop_mps(env)
  failed = {f"{name} (rank {r['rank']}): {c['detail']}" for r in results for name, c in r["checks"].items()
            if not c["ok"]}
  assert not failed, failed
