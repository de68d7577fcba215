"""A tensor-parallel MLP with jax_overlap inside jax.shard_map: forward and backward under jit.

  out = gelu(x @ w1 + b1) @ w2 + b2
  x [batch, seq, hidden]  sequence-sharded over 'tp'
  w1 [hidden, ffn]        column-sharded   ag_matmul: gather the sequence, multiply by my columns
  w2 [ffn, hidden]        row-sharded      matmul_rs: multiply by my rows, reduce-scatter the sequence

Checks the loss and gradients against the same MLP in plain jnp on one device,
then times training steps; the run ends with PASS or FAIL and the tolerance (exit
status 0 or 1). Uses every GPU present (at most 8), or 8 CPU devices.

  python examples/mlp_shard_map.py --batch 4 --seq 512 --hidden 1024 --ffn 4096 --dtype bfloat16
"""

import functools
import sys

import mlp_common as common  # first: it sets up the devices before jax starts

import jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import jax_overlap  # noqa: E402


def mlp_local(x, w1, b1, w2, b2, *, algorithm):
  """One rank's view: x is its sequence shard, the weights its shards."""
  h = jax.nn.gelu(jax_overlap.ag_matmul(x, w1, b1, axis_name="tp", algorithm=algorithm))
  return jax_overlap.matmul_rs(h, w2, b2, axis_name="tp", algorithm=algorithm)


def main():
  args, algorithm, dtype, mesh = common.parse_args(__doc__.splitlines()[0])
  host = common.host_data(args, dtype)
  # Place the arrays as shard_map's in_specs split them, so no step re-distributes them.
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  params = tuple(put(p, s) for p, s in zip(host[0], common.PARAM_SPECS))
  x, target = put(host[1], common.ACT_SPEC), put(host[2], common.ACT_SPEC)

  mlp = jax.shard_map(functools.partial(mlp_local, algorithm=algorithm), mesh=mesh,
                      in_specs=(common.ACT_SPEC, *common.PARAM_SPECS), out_specs=common.ACT_SPEC)
  train_step = jax.jit(lambda p, x, t: jax.value_and_grad(common.loss)(p, x, t, mlp))

  worst = common.check_against_reference(*train_step(params, x, target), host, dtype)
  common.time_training(train_step, jax.jit(common.sgd_update), params, x, target, args.steps)
  return common.verdict(worst, dtype)


if __name__ == "__main__":
  sys.exit(main())
