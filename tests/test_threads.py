"""Lowering from several threads at once, on the stand-in GPU runtime (fake_gpu.py): each call's region its own."""

import concurrent.futures
import re
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap
from jax_overlap.runtime import workspace

from fake_gpu import custom_calls, cuda_text

WORLD, ROWS, K = 8, 64, 128


def _layer(mesh, algorithm):
  return jax.jit(jax.shard_map(lambda x, w: jax_overlap.ag_matmul(x, w, axis_name="tp", algorithm=algorithm),
                               mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")))


def test_threads_lowering_calls_of_different_shapes_get_disjoint_regions(fake, make_mesh, monkeypatch, normal,
                                                                        assert_close):
  mesh = make_mesh((WORLD,), ("tp",))
  place = workspace.place
  # Widens the window between choosing an offset and recording it, where a second thread could take the same one.
  monkeypatch.setattr(workspace, "place", lambda *args: time.sleep(0.05) or place(*args))
  widths = [WORLD * (16 + 8 * i) for i in range(6)]
  start = threading.Barrier(len(widths))

  def lower(n):
    specs = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
             for shape, spec in (((WORLD * ROWS, K), P("tp")), ((K, n), P(None, "tp")))]
    start.wait()
    (call,) = custom_calls(cuda_text(_layer(mesh, "pipelined"), *specs))
    return int(re.search(r"region_offset = (\d+)", call).group(1))

  with concurrent.futures.ThreadPoolExecutor(len(widths)) as pool:
    offsets = list(pool.map(lower, widths))
  regions = sorted(workspace._state().regions.values())
  assert len(regions) == len(widths) and sorted(offsets) == [offset for offset, _ in regions]
  for (offset, nbytes), (following, _) in zip(regions, regions[1:]):
    assert offset + nbytes <= following, regions

  # The programs run on the CPU devices ("auto" takes the reference path there), from the threads at once.
  operands = {n: (normal((WORLD * ROWS, K), jnp.bfloat16), normal((K, n), jnp.bfloat16)) for n in widths}

  def run(n):
    start.wait()
    return _layer(mesh, "auto")(*operands[n])

  with concurrent.futures.ThreadPoolExecutor(len(widths)) as pool:
    results = list(pool.map(run, widths))
  for n, y in zip(widths, results):
    x, w = (a.astype(np.float64) for a in operands[n])
    assert_close(y, x @ w, jnp.bfloat16, k=K)
