"""Meshes of one device with Explicit axes, jax.make_mesh's default (issue 24, item 6): the forward and the
gradients of both ops, against float64 NumPy, and the README's main job on one CPU device.

With one device JAX inlines a custom partitioning: the call is lowered with its global operand types, in which
x's rows and w's columns both on 'tp' made the local dot_general an illegal sharding (ShardingTypeError).
"""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap

ROOT = pathlib.Path(__file__).resolve().parents[1]

# (x spec, w spec) of x [8, 16] @ w [16, 24] on a ('dp', 'tp') = (1, 1) mesh: each op's fused layout, the other's,
# a batch axis, nothing sharded.
LAYOUTS = [(P("tp", None), P(None, "tp")), (P(None, "tp"), P("tp", None)), (P("dp", None), P(None, "tp")),
           (P(), P())]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("x_spec,w_spec", LAYOUTS, ids=["ag_fused", "rs_fused", "dp_rows", "replicated"])
@pytest.mark.parametrize("algorithm", ["auto", "xla"])
@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_one_device_explicit_mesh(op, algorithm, x_spec, w_spec, dtype, normal, make_mesh, assert_close):
  mesh = make_mesh((1, 1), ("dp", "tp"), jax.sharding.AxisType.Explicit)
  with jax.enable_x64(dtype == jnp.float64):
    x, w, bias = normal((8, 16), dtype), normal((16, 24), dtype), normal((24,), dtype)
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in ((x, x_spec), (w, w_spec), (bias, P()))]
    fn = getattr(jax_overlap, op)
    f = jax.jit(jax.value_and_grad(lambda x, w, b: jnp.sum(jnp.sin(fn(x, w, b, algorithm=algorithm))),
                                   argnums=(0, 1, 2)))
    y, (loss, grads) = jax.jit(lambda *a: fn(*a, algorithm=algorithm))(*args), f(*args)
  x64, w64, b64 = (a.astype(np.float64) for a in (x, w, bias))
  y64 = x64 @ w64 + b64
  dy = np.cos(y64)
  assert_close(y, y64, dtype, 16, what="y")
  assert_close(loss, np.sin(y64).sum(), dtype, 16 * y64.size, what="loss")
  for what, g, want, a in zip(("dx", "dw", "dbias"), grads, (dy @ w64.T, x64.T @ dy, dy.sum(0)), args):
    assert g.dtype == dtype and g.sharding.is_equivalent_to(a.sharding, a.ndim), what
    assert_close(g, want, dtype, 24, what=what)


def test_transformer_block_on_one_explicit_device():
  """The README's main job with jax.make_mesh's default axis type on one CPU device: forward and gradients
  against its lax.dot_general twin, PASS (CI runs the same command)."""
  pytest.importorskip("flax", reason="the transformer block example needs flax (pip install '.[examples]')")
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
         "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
  run = subprocess.run([sys.executable, str(ROOT / "examples" / "transformer_block.py"), "--mesh", "explicit",
                        "--steps", "2"], env=env, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stdout + run.stderr
  assert "1 x cpu as dp 1 x tp 1 (explicit mesh)" in run.stdout, run.stdout
  assert run.stdout.strip().splitlines()[-1].startswith("PASS: "), run.stdout


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_one_device_explicit_mesh_lowered_for_a_gpu(op, make_mesh):
  """The GPU lowering reshapes a weight with several output (or contracted) dims to a matrix, which the global
  Explicit types refused (ShardingTypeError on the H200). Lowered for cuda here: with no GPU build, the lowering
  reshapes, then takes the XLA path."""
  mesh = make_mesh((1, 1), ("dp", "tp"), jax.sharding.AxisType.Explicit)
  if op == "ag_matmul":  # a gated kernel [E, 2, F] on F
    shapes, specs = ((2, 64, 256), (256, 2, 128)), (P("dp", "tp", None), P(None, None, "tp"))
  else:  # an attention output kernel [H, D, E] on the heads
    shapes, specs = ((2, 64, 4, 64), (4, 64, 256)), (P("dp", None, "tp", None), P("tp", None, None))
  args = [jax.device_put(jnp.ones(s, jnp.bfloat16), NamedSharding(mesh, p)) for s, p in zip(shapes, specs)]
  fn = getattr(jax_overlap, op)
  loss = lambda x, w: jnp.sum(fn(x, w).astype(jnp.float32))
  for f in (jax.jit(fn), jax.jit(jax.grad(loss, argnums=(0, 1)))):
    assert "stablehlo.dot_general" in f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
