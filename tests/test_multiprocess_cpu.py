"""Two jax.distributed processes of 4 CPU devices each, whose collectives really run (gloo): data parallel across
the processes, tensor parallel inside each (tests/gloo_worker.py). Both ops inside shard_map and on global arrays,
and the layers' gradients, against float64 on every process's shards.

XLA's NCCL refuses two ranks on one GPU, so this is where the XLA path across processes is tested; the GPU
algorithms across processes run under MPS on the device machine (tests/gpu/multiprocess.py).
"""

import pytest

import two_processes


@pytest.fixture(scope="module")
def records(tmp_path_factory):
  return two_processes.run("gloo_worker.py", tmp_path_factory.mktemp("gloo"))


@pytest.mark.parametrize("mode", ["shard_map", "global", "layers"])
def test_values_and_gradients_across_processes(records, mode):
  # float32 products of sums over K = 32 and F = 128 against float64: a few float32 ulps of the largest value
  for rank, record in enumerate(records):
    errors = record[mode]
    assert errors["processes"] == [0, 1], f"process {rank}: the result spans processes {errors['processes']}"
    for what in ("z", "dx", "dw1", "dw2"):
      assert errors[what] < 1e-5, f"process {rank}, {mode}: {what} off float64 by {errors[what]:.2e} (relative)"
