"""A tensor-parallel MLP with jax_overlap on global arrays: jit and NamedShardings, no shard_map.

  out = gelu(x @ w1 + b1) @ w2 + b2
  x [batch, seq, hidden]  NamedSharding P(None, 'tp', None)   (sequence-sharded)
  w1 [hidden, ffn]        P(None, 'tp')  -> ag_matmul partitions as all-gather(x) @ my columns
  w2 [ffn, hidden]        P('tp', None)  -> matmul_rs partitions as my rows, then reduce-scatter

The functions are called with axis_name=None: the partitioning comes from the
input shardings, and out_shardings pin the results (output and gradients) to the
layout the next step wants. Checks the loss and gradients against a plain jnp
MLP on one device, then times training steps. Uses every GPU present (at most
8), or 8 CPU devices.

  python examples/mlp_jit.py --batch 4 --seq 512 --hidden 1024 --ffn 4096 --dtype bfloat16
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


def mlp(x, w1, b1, w2, b2):
  """The same code as a single-device MLP: the shardings of x and the weights decide the collectives."""
  h = jax.nn.gelu(jax_overlap.ag_matmul(x, w1, b1, algorithm=ALGORITHM))
  return jax_overlap.matmul_rs(h, w2, b2, algorithm=ALGORITHM)


def mlp_reference(x, w1, b1, w2, b2):
  return jax.nn.gelu(x @ w1 + b1) @ w2 + b2


def loss(params, x, target, fn):
  return jnp.mean(jnp.square(fn(x, *params).astype(jnp.float32) - target.astype(jnp.float32)))


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
  # Auto axes: shardings flow from the inputs and out_shardings.
  mesh = jax.make_mesh((tp,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:tp])
  param_sh = tuple(NamedSharding(mesh, s) for s in PARAM_SPECS)
  act_sh = NamedSharding(mesh, ACT_SPEC)
  print(f"{tp} x {jax.devices()[0].device_kind}, {jax_overlap.build_info()['platform'] or 'no'} native build; "
        f"algorithm {ALGORITHM}; "
        f"x [{args.batch}, {args.seq}, {args.hidden}], ffn {args.ffn}, {dtype.name}")

  keys = jax.random.split(jax.random.key(0), 6)
  shapes = [(args.hidden, args.ffn), (args.ffn,), (args.ffn, args.hidden), (args.hidden,)]
  scales = [args.hidden ** -0.5, 0.1, args.ffn ** -0.5, 0.1]
  host_params = [jax.random.normal(k, s, dtype) * c for k, s, c in zip(keys[2:], shapes, scales)]
  host_x = jax.random.normal(keys[0], (args.batch, args.seq, args.hidden), dtype)
  host_target = jax.random.normal(keys[1], host_x.shape, dtype)

  params = tuple(jax.device_put(p, s) for p, s in zip(host_params, param_sh))
  x, target = jax.device_put(host_x, act_sh), jax.device_put(host_target, act_sh)

  train_step = jax.jit(lambda p, x, t: jax.value_and_grad(loss)(p, x, t, mlp),
                       out_shardings=(NamedSharding(mesh, P()), param_sh))
  sgd = jax.jit(lambda p, g, lr: jax.tree.map(lambda a, b: (a - lr * b).astype(a.dtype), p, g),
                out_shardings=param_sh)

  # The reference: the same MLP on one device, in float32, from the same values.
  f32 = lambda tree: jax.tree.map(lambda a: jax.device_put(a.astype(jnp.float32), jax.devices()[0]), tree)
  ref_loss, ref_grads = jax.jit(lambda p, x, t: jax.value_and_grad(loss)(p, x, t, mlp_reference))(
      f32(tuple(host_params)), f32(host_x), f32(host_target))
  value, grads = train_step(params, x, target)
  assert all(g.sharding.spec == s for g, s in zip(grads, PARAM_SPECS)), "gradients must keep the weights' layout"
  tol = {"bfloat16": 5e-2, "float16": 1e-2, "float32": 1e-4}[dtype.name]
  worst = 0.0
  for name, got, want in zip(("loss", "dw1", "db1", "dw2", "db2"), (value, *grads), (ref_loss, *ref_grads)):
    got, want = np.asarray(got, np.float32), np.asarray(want)
    err = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
    worst = max(worst, err)
    print(f"  {name:5s} max error {err:.2e} (relative to max |reference|)")
  if worst > tol:
    sys.exit(f"error {worst:.2e} exceeds the {dtype.name} tolerance {tol:.0e}")

  start = time.perf_counter()
  for _ in range(args.steps):
    value, grads = train_step(params, x, target)
    params = sgd(params, grads, 0.1)
  jax.block_until_ready(params)
  step_ms = (time.perf_counter() - start) / max(args.steps, 1) * 1e3
  print(f"{args.steps} steps: {step_ms:.2f} ms/step, loss {float(value):.4f}")


if __name__ == "__main__":
  main()
