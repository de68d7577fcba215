"""A tensor-parallel MLP with jax_overlap on global arrays: jit and NamedShardings, no shard_map.

  out = gelu(x @ w1 + b1) @ w2 + b2
  x [batch, seq, hidden]  NamedSharding P(None, 'tp', None)   (sequence-sharded)
  w1 [hidden, ffn]        P(None, 'tp')  -> ag_matmul partitions as all-gather(x) @ my columns
  w2 [ffn, hidden]        P('tp', None)  -> matmul_rs partitions as my rows, then reduce-scatter

The functions are called with axis_name=None: the partitioning comes from the
input shardings, and out_shardings pin the results (output and gradients) to the
layout the next step wants. Checks the loss and gradients against a plain jnp
MLP on one device, then times training steps; the run ends with PASS or FAIL and
the tolerance (exit status 0 or 1). Uses every GPU present (at most 8), or 8 CPU
devices.

  python examples/mlp_jit.py --batch 4 --seq 512 --hidden 1024 --ffn 4096 --dtype bfloat16
"""

import functools
import sys

import mlp_common as common  # first: it sets up the devices before jax starts

import jax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jax_overlap  # noqa: E402


def mlp(x, w1, b1, w2, b2, *, algorithm):
  """The same code as a single-device MLP: the shardings of x and the weights decide the collectives."""
  h = jax.nn.gelu(jax_overlap.ag_matmul(x, w1, b1, algorithm=algorithm))
  return jax_overlap.matmul_rs(h, w2, b2, algorithm=algorithm)


def main():
  args, algorithm, dtype, mesh = common.parse_args(__doc__.splitlines()[0])
  host = common.host_data(args, dtype)
  param_sh = tuple(NamedSharding(mesh, s) for s in common.PARAM_SPECS)
  act_sh = NamedSharding(mesh, common.ACT_SPEC)
  params = tuple(jax.device_put(p, s) for p, s in zip(host[0], param_sh))
  x, target = jax.device_put(host[1], act_sh), jax.device_put(host[2], act_sh)

  fn = functools.partial(mlp, algorithm=algorithm)
  train_step = jax.jit(lambda p, x, t: jax.value_and_grad(common.loss)(p, x, t, fn),
                       out_shardings=(NamedSharding(mesh, P()), param_sh))
  value, grads = train_step(params, x, target)
  assert all(g.sharding.spec == s for g, s in zip(grads, common.PARAM_SPECS)), "gradients must keep the weights' layout"

  worst = common.check_against_reference(value, grads, host, dtype)
  common.time_training(train_step, jax.jit(common.sgd_update, out_shardings=param_sh), params, x, target, args.steps)
  return common.verdict(worst, dtype)


if __name__ == "__main__":
  sys.exit(main())
