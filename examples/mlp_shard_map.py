"""A tensor-parallel MLP with jax_overlap inside jax.shard_map: forward and backward under jit.

  out = gelu(x @ w1 + b1) @ w2 + b2
  x [batch, seq, hidden]  sequence-sharded over 'tp'
  w1 [hidden, ffn]        column-sharded   ag_matmul: gather the sequence, multiply by my columns
  w2 [ffn, hidden]        row-sharded      matmul_rs: multiply by my rows, reduce-scatter the sequence

Checks the loss and gradients against the same MLP in plain jnp on one device,
then times training steps. Uses every GPU present (at most 8), or 8 CPU devices.

  python examples/mlp_shard_map.py --batch 4 --seq 512 --hidden 1024 --ffn 4096 --dtype bfloat16
"""

import argparse
import os
import sys
import time

if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  # 8 CPU devices. Only the CPU backend reads this: on a GPU machine the GPUs stay the default devices.
  flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_overlap  # noqa: E402

# The fused kernels where this build has them for the devices present, else what "auto" picks.
ALGORITHM = "auto"


def default_algorithm() -> str:
  return "fused" if jax_overlap.fused_available() else "auto"

PARAM_SPECS = (P(None, "tp"), P("tp"), P("tp", None), P())  # w1, b1, w2, b2
ACT_SPEC = P(None, "tp", None)  # x, the output and the target


def mlp_local(x, w1, b1, w2, b2):
  """One rank's view: x is its sequence shard, the weights its shards."""
  h = jax.nn.gelu(jax_overlap.ag_matmul(x, w1, b1, axis_name="tp", algorithm=ALGORITHM))
  return jax_overlap.matmul_rs(h, w2, b2, axis_name="tp", algorithm=ALGORITHM)


def mlp_reference(x, w1, b1, w2, b2):
  return jax.nn.gelu(x @ w1 + b1) @ w2 + b2


def init(key, hidden, ffn, dtype):
  k1, k2, k3, k4 = jax.random.split(key, 4)
  return (jax.random.normal(k1, (hidden, ffn), dtype) * hidden ** -0.5, 0.1 * jax.random.normal(k2, (ffn,), dtype),
          jax.random.normal(k3, (ffn, hidden), dtype) * ffn ** -0.5, 0.1 * jax.random.normal(k4, (hidden,), dtype))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--seq", type=int, default=128)
  parser.add_argument("--hidden", type=int, default=256)
  parser.add_argument("--ffn", type=int, default=1024)
  parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--algorithm", default=None, choices=["auto", "fused", "xla"],
                      help="default: fused on a GPU build with its GPUs, else auto")
  args = parser.parse_args()
  global ALGORITHM
  ALGORITHM = args.algorithm or default_algorithm()
  dtype = jnp.dtype(args.dtype)

  tp = min(len(jax.devices()), 8)
  if args.seq % tp or args.ffn % tp:
    parser.error(f"--seq ({args.seq}) and --ffn ({args.ffn}) must be divisible by the {tp} devices")
  mesh = jax.make_mesh((tp,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:tp])
  print(f"{tp} x {jax.devices()[0].device_kind}, {jax_overlap.build_info()['platform'] or 'no'} native build; "
        f"algorithm {ALGORITHM}; "
        f"x [{args.batch}, {args.seq}, {args.hidden}], ffn {args.ffn}, {dtype.name}")

  kx, kt, kp = jax.random.split(jax.random.key(0), 3)
  host_x = jax.random.normal(kx, (args.batch, args.seq, args.hidden), dtype)
  host_target = jax.random.normal(kt, host_x.shape, dtype)
  host_params = init(kp, args.hidden, args.ffn, dtype)
  # Place the arrays as shard_map's in_specs split them, so no step re-distributes them.
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  x, target = put(host_x, ACT_SPEC), put(host_target, ACT_SPEC)
  params = tuple(put(p, s) for p, s in zip(host_params, PARAM_SPECS))

  mlp = jax.shard_map(mlp_local, mesh=mesh, in_specs=(ACT_SPEC, *PARAM_SPECS), out_specs=ACT_SPEC)

  def loss(params, x, target, fn):
    return jnp.mean(jnp.square(fn(x, *params).astype(jnp.float32) - target.astype(jnp.float32)))

  train_step = jax.jit(lambda p, x, t: jax.value_and_grad(loss)(p, x, t, mlp))

  # The reference: the same MLP on one device, in float32, from the same values.
  f32 = lambda tree: jax.tree.map(lambda a: jax.device_put(a.astype(jnp.float32), jax.devices()[0]), tree)
  ref_loss, ref_grads = jax.jit(lambda p, x, t: jax.value_and_grad(loss)(p, x, t, mlp_reference))(
      f32(host_params), f32(host_x), f32(host_target))
  value, grads = train_step(params, x, target)
  tol = {"bfloat16": 5e-2, "float16": 1e-2, "float32": 1e-4}[dtype.name]
  worst = 0.0
  for name, got, want in zip(("loss", "dw1", "db1", "dw2", "db2"), (value, *grads), (ref_loss, *ref_grads)):
    got, want = np.asarray(got, np.float32), np.asarray(want)
    err = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
    worst = max(worst, err)
    print(f"  {name:5s} max error {err:.2e} (relative to max |reference|)")
  if worst > tol:
    sys.exit(f"error {worst:.2e} exceeds the {dtype.name} tolerance {tol:.0e}")

  lr = 0.1
  sgd = jax.jit(lambda p, g: jax.tree.map(lambda a, b: (a - lr * b).astype(a.dtype), p, g))
  start = time.perf_counter()
  for _ in range(args.steps):
    value, grads = train_step(params, x, target)
    params = sgd(params, grads)
  jax.block_until_ready(params)
  step_ms = (time.perf_counter() - start) / max(args.steps, 1) * 1e3
  print(f"{args.steps} steps: {step_ms:.2f} ms/step, loss {float(value):.4f}")


if __name__ == "__main__":
  main()
