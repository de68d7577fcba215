"""One GPU on a mesh with Explicit axes, jax.make_mesh's default (issue 24, item 6): both ops on global arrays,
forward and gradients, with every algorithm, and the README's main job with --mesh explicit.

JAX inlines a one-device custom partitioning, so the GPU lowering sees the global Explicit types: weights with
several output or contracted dims are reshaped to a matrix there, which those types used to refuse.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap as jo
from gpu_util import random, requires_gpu
from tolerance import assert_close

pytestmark = [pytest.mark.gpu, requires_gpu]

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _mesh():
  return jax.make_mesh((1, 1), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Explicit,) * 2,
                       devices=jax.devices()[:1])


@pytest.mark.parametrize("algorithm", ["auto", "pipelined", "fused", "xla"])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_one_gpu_explicit_mesh(op, algorithm):
  """A gated kernel [E, 2, F] (ag_matmul) or a heads kernel [H, D, E] (matmul_rs), sharded as the transformer
  block shards them, in bfloat16 against float64."""
  mesh, dtype = _mesh(), jnp.bfloat16
  rng = np.random.default_rng(7)
  if op == "ag_matmul":
    x, w = random(rng, (2, 64, 256), dtype), random(rng, (256, 2, 128), dtype, 256 ** -0.5)
    specs, subscripts = (P("dp", "tp", None), P(None, None, "tp")), "bsk,ktn->bstn"
  else:
    x, w = random(rng, (2, 64, 4, 64), dtype), random(rng, (4, 64, 256), dtype, 256 ** -0.5)
    specs, subscripts = (P("dp", None, "tp", None), P("tp", None, None)), "bshd,hdn->bsn"
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), specs)]
  fn = lambda x, w: getattr(jo, op)(x, w, algorithm=algorithm)
  y = jax.jit(fn)(*args)
  ct = random(rng, y.shape, np.float32)
  dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(fn(x, w).astype(jnp.float32) * ct), argnums=(0, 1)))(*args)
  x64, w64, ct64 = (np.asarray(a, np.float64) for a in (x, w, ct))
  lhs, rhs = subscripts.split("->")[0].split(",")
  out = subscripts.split("->")[1]
  # y and dx sum 256 terms of x or ct (unit) times w (256 ** -0.5); dw 128 of x times ct (2 x 64 rows).
  assert_close(y, np.einsum(subscripts, x64, w64), dtype, 256, 256 ** -0.5, "y")
  assert_close(dx, np.einsum(f"{out},{rhs}->{lhs}", ct64, w64), dtype, 256, 256 ** -0.5, "dx")
  assert_close(dw, np.einsum(f"{lhs},{out}->{rhs}", x64, ct64), dtype, 128, 1.0, "dw")
  for g, a in ((dx, args[0]), (dw, args[1])):
    assert g.sharding.is_equivalent_to(a.sharding, a.ndim)


def test_transformer_block_explicit_mesh():
  """The main job with --mesh explicit on one GPU: auto, then xla, PASS (the installed package, as a user runs it:
  nothing added to PYTHONPATH, whose sources hold no native module)."""
  env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
  run = subprocess.run([sys.executable, str(ROOT / "examples" / "transformer_block.py"), "--mesh", "explicit",
                        "--steps", "3"], env=env, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stdout + run.stderr
  assert "(explicit mesh)" in run.stdout and "dp 1 x tp 1" in run.stdout, run.stdout
  assert run.stdout.strip().splitlines()[-1].startswith("PASS: "), run.stdout
