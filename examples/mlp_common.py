"""What both MLP examples share: devices, arguments, data, the reference check and the timing.

Import it before jax: on a machine without GPUs it asks the CPU backend for 8 devices.
"""

import argparse
import os
import sys
import time

if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  # 8 CPU devices. Only the CPU backend reads this: on a GPU machine the GPUs stay the default devices.
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_overlap  # noqa: E402

PARAM_SPECS = (P(None, "tp"), P("tp"), P("tp", None), P())  # w1, b1, w2, b2
ACT_SPEC = P(None, "tp", None)  # x, the output and the target
TOLERANCE = {"bfloat16": 5e-2, "float16": 1e-2, "float32": 1e-4}
LEARNING_RATE = 0.1


def parse_args(description: str):
  """(args, algorithm, dtype, mesh): the flags, the algorithm to run, and a 1-D 'tp' mesh of every device (<= 8)."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--seq", type=int, default=128)
  parser.add_argument("--hidden", type=int, default=256)
  parser.add_argument("--ffn", type=int, default=1024)
  parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--algorithm", default=None, choices=["auto", "pipelined", "fused", "xla"],
                      help="default: fused on a GPU build with its GPUs, else auto")
  args = parser.parse_args()
  algorithm = args.algorithm or ("fused" if jax_overlap.gpu_available() else "auto")
  dtype = jnp.dtype(args.dtype)
  tp = min(len(jax.devices()), 8)
  if args.seq % tp or args.ffn % tp:
    parser.error(f"--seq ({args.seq}) and --ffn ({args.ffn}) must be divisible by the {tp} devices")
  # Auto axes: shardings flow from the inputs (and out_shardings, in the jit example).
  mesh = jax.make_mesh((tp,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:tp])
  print(f"{tp} x {jax.devices()[0].device_kind}, {jax_overlap.build_info()['platform'] or 'no'} native build; "
        f"algorithm {algorithm}; x [{args.batch}, {args.seq}, {args.hidden}], ffn {args.ffn}, {dtype.name}")
  return args, algorithm, dtype, mesh


def host_data(args, dtype):
  """(params, x, target) on the default device: random values, weights scaled by 1/sqrt(fan-in)."""
  kx, kt, *kp = jax.random.split(jax.random.key(0), 6)
  shapes = [(args.hidden, args.ffn), (args.ffn,), (args.ffn, args.hidden), (args.hidden,)]
  scales = [args.hidden ** -0.5, 0.1, args.ffn ** -0.5, 0.1]
  params = tuple(jax.random.normal(k, s, dtype) * c for k, s, c in zip(kp, shapes, scales))
  x = jax.random.normal(kx, (args.batch, args.seq, args.hidden), dtype)
  return params, x, jax.random.normal(kt, x.shape, dtype)


def mlp_reference(x, w1, b1, w2, b2):
  return jax.nn.gelu(x @ w1 + b1) @ w2 + b2


def loss(params, x, target, fn):
  return jnp.mean(jnp.square(fn(x, *params).astype(jnp.float32) - target.astype(jnp.float32)))


def check_against_reference(value, grads, host, dtype) -> float:
  """The largest error of the loss and gradients against the same MLP on one device in float32 (each printed)."""
  f32 = lambda tree: jax.tree.map(lambda a: jax.device_put(a.astype(jnp.float32), jax.devices()[0]), tree)
  ref_loss, ref_grads = jax.jit(lambda p, x, t: jax.value_and_grad(loss)(p, x, t, mlp_reference))(*f32(host))
  worst = 0.0
  for name, got, want in zip(("loss", "dw1", "db1", "dw2", "db2"), (value, *grads), (ref_loss, *ref_grads)):
    got, want = np.asarray(got, np.float32), np.asarray(want)
    err = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
    worst = max(worst, err)
    print(f"  {name:5s} max error {err:.2e} (relative to max |reference|)")
  return worst


def verdict(worst: float, dtype) -> int:
  """Prints PASS or FAIL and the tolerance as the run's last line; returns the exit status."""
  tolerance = TOLERANCE[dtype.name]
  passed = worst <= tolerance
  print(f"{'PASS' if passed else 'FAIL'}: largest error against the jnp MLP {worst:.1e} "
        f"({'within' if passed else 'above'} the {dtype.name} tolerance {tolerance:.0e})")
  return 0 if passed else 1


def time_training(train_step, sgd, params, x, target, steps: int) -> None:
  """Runs `steps` steps of train_step + sgd(params, grads) and prints the time per step."""
  start = time.perf_counter()
  for _ in range(steps):
    value, grads = train_step(params, x, target)
    params = sgd(params, grads)
  jax.block_until_ready(params)
  step_ms = (time.perf_counter() - start) / max(steps, 1) * 1e3
  print(f"{steps} steps: {step_ms:.2f} ms/step, loss {float(value):.4f}")


def sgd_update(params, grads):
  return jax.tree.map(lambda a, b: (a - LEARNING_RATE * b).astype(a.dtype), params, grads)
