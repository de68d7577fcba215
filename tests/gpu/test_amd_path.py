"""The AMD data path on the H200: the kernels a CUDA build compiles for AmdArch on the mma.sync atom.

csrc/gemm/arch_traits.h AmdArch is what the gfx942/gfx950 build runs: B staged k-contiguous
(an [N, K] w transposed through registers), per-load fragment addressing, synchronous copies,
no fragment pipelining, no stream-K tail, the AMD tile list (256x128x64, 128x128x32). A CUDA
build compiles the same traits as extra tile indices (arch "amd" in native tile_shapes), so
these tests run every line of the AMD build but the MFMA instruction and the memory scopes:
simulated ranks in one process, world 1 through JAX (JAX_OVERLAP_ARCH_TRAITS=amd makes the
planner take those tiles), and two JAX processes under MPS.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_overlap as jo
from gpu_util import random, requires_gpu
from tolerance import assert_close, rms
from jax_overlap.runtime import backend, native
import test_sim_group
from test_multiprocess import failed_under_mps, requires_mps


def _amd_tiles():
  if native.module() is None:
    return []
  return [t for t in backend.current().compiled_tile_shapes() if t.arch == "amd"]


pytestmark = [pytest.mark.gpu, requires_gpu,
              pytest.mark.skipif(native.platform() != "cuda" or not _amd_tiles(),
                                 reason="needs a CUDA build (it compiles the AMD data path on mma.sync)")]

AMD_TILES = [t.index for t in _amd_tiles()] or [2, 3]


# The simulated-rank tests of the NVIDIA tiles (tests/gpu/test_sim_group.py), on the AMD tiles.
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("tile", AMD_TILES)
@pytest.mark.parametrize("m,k,n,w_kmajor", [(256, 512, 384, False), (100, 1032, 264, False), (130, 520, 136, True)])
def test_ag_matmul_simulated_ranks(world, dtype, tile, m, k, n, w_kmajor):
  test_sim_group.test_ag_matmul(world, dtype, m, k, n, w_kmajor, tile)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("tile", AMD_TILES)
@pytest.mark.parametrize("mb,k,n,w_kmajor", [(256, 512, 384, False), (100, 264, 1032, False), (130, 136, 520, True)])
def test_matmul_rs_simulated_ranks(world, dtype, tile, mb, k, n, w_kmajor):
  test_sim_group.test_matmul_rs(world, dtype, mb, k, n, w_kmajor, tile)


# World 1 (plain GEMM, whole tiles): 2-3 tiles per workgroup, edge tiles, k from one k-tile to many.
@pytest.mark.parametrize("tile", AMD_TILES)
@pytest.mark.parametrize("k", [64, 136, 1024])
@pytest.mark.parametrize("w_kmajor", [False, True])
def test_world1_simulated(tile, k, w_kmajor):
  test_sim_group.test_world1_workgroups_run_several_tiles(tile, k, w_kmajor)


def _mesh():
  return Mesh(np.array(jax.devices()[:1]), ("tp",))


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
@pytest.mark.parametrize("m,k,n", [(2048, 512, 3584), (1000, 1032, 264), (512, 64, 1024)])
def test_world1_through_jax_takes_the_amd_tiles(monkeypatch, op, m, k, n):
  """JAX_OVERLAP_ARCH_TRAITS=amd: the planner takes the AMD tiles, which run whole tiles (no stream-K tail)."""
  monkeypatch.setenv("JAX_OVERLAP_ARCH_TRAITS", "amd")
  rng = np.random.default_rng(m + k + n)
  x, w, b = random(rng, (m, k), jnp.bfloat16), random(rng, (k, n), jnp.bfloat16, k ** -0.5), \
      random(rng, (n,), jnp.bfloat16)
  fn = getattr(jo, op)
  f = jax.jit(jax.shard_map(lambda x, w, b: fn(x, w, b, axis_name="tp", algorithm="fused"), mesh=_mesh(),
                            in_specs=(P("tp"), P(), P()), out_specs=P("tp")))
  text = f.lower(x, w, b).as_text()
  assert int(re.search(r"tile = (\d+)", text).group(1)) in AMD_TILES
  assert "tail_slots = 0" in text
  y = f(x, w, b)
  ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64) + np.asarray(b, np.float64)
  assert_close(y, ref, jnp.bfloat16, k, k ** -0.5)
  np.testing.assert_array_equal(np.asarray(f(x, w, b)).view(np.uint16), np.asarray(y).view(np.uint16))


def test_grad_through_jax_on_the_amd_tiles(monkeypatch):
  """Forward and backward of a TP MLP at world 1: both w layouts, both ops, on the AMD tiles."""
  monkeypatch.setenv("JAX_OVERLAP_ARCH_TRAITS", "amd")
  rng = np.random.default_rng(9)
  x = random(rng, (2, 128, 256), jnp.bfloat16)
  w1, w2 = random(rng, (256, 512), jnp.bfloat16, 1 / 16), random(rng, (512, 256), jnp.bfloat16, 1 / 22)

  def loss(params, algorithm):
    w1, w2 = params
    body = lambda x, w1, w2: jo.matmul_rs(jax.nn.gelu(jo.ag_matmul(x, w1, axis_name="tp", algorithm=algorithm)),
                                          w2, axis_name="tp", algorithm=algorithm)
    y = jax.shard_map(body, mesh=_mesh(), in_specs=(P(None, "tp"), P(None, "tp"), P("tp", None)),
                      out_specs=P(None, "tp"))(x, w1, w2)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  fused = jax.jit(jax.value_and_grad(lambda p: loss(p, "fused")))
  text = fused.lower((w1, w2)).as_text()
  assert {int(t) for t in re.findall(r"tile = (\d+)", text)} <= set(AMD_TILES)
  (lf, gf), (lx, gx) = fused((w1, w2)), jax.jit(jax.value_and_grad(lambda p: loss(p, "xla")))((w1, w2))
  assert abs(float(lf) - float(lx)) <= 2e-2 * abs(float(lx))
  for a, b in zip(jax.tree.leaves(gf), jax.tree.leaves(gx)):  # three rounded stages, as in test_mlp
    assert_close(a, b, jnp.bfloat16, 1, 3 * rms(b))


@requires_mps
def test_two_processes_one_gpu_on_the_amd_tiles():
  failed = failed_under_mps(2, JAX_OVERLAP_ARCH_TRAITS="amd")
  assert not failed, failed
