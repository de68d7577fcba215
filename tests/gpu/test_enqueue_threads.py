"""One enqueuer per GPU, checked (issue 52.2; docs/protocol.md, "Host threads"): two JAX processes on this GPU under
MPS, each calling a program with peers from two threads at once (scenario "threads")."""

from __future__ import annotations

import tempfile

import pytest

import multiprocess
from gpu_util import requires_gpu
from test_multiprocess import _failed, requires_mps

pytestmark = [pytest.mark.gpu, requires_gpu]


@requires_mps
def test_a_second_thread_enqueuing_on_a_gpu_is_refused_and_the_ranks_stay_in_step():
  with tempfile.TemporaryDirectory() as tmp:
    mps_env = multiprocess._start_mps(tmp)
    try:
      results = multiprocess.run_world(2, mps_env, per_gpu=False, timeout=300, scenario="threads")
    finally:
      multiprocess._stop_mps(mps_env)
  failed = _failed(results)
  assert not failed, failed
