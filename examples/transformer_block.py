"""A Flax NNX decoder block trained on jax_overlap: one argument per layer, NamedShardings, jit.

  h   = x + attention(rms_norm(x))        QKV kernels [E, heads, head_dim], output kernel [heads, head_dim, E]
  out = h + down(silu(gate) * up)         gate and up from one kernel [E, 2, ffn]; down [ffn, E]

Sequence parallelism over 'tp' (x [batch, seq, E] sharded P('dp', 'tp', None); the projections
sharded on the heads and the ffn) and data parallelism over 'dp'. The column-parallel layers take
dot_general=jax_overlap.AgDotGeneral() (all-gather the sequence, then multiply), the row-parallel
ones dot_general=jax_overlap.RsDotGeneral() (multiply, then reduce-scatter the sequence); everything
else is stock Flax.

Each step's loss and gradients are checked against the same block with lax.dot_general, at the
same parameters, on one device in float32; the run ends with PASS or FAIL and the tolerance. Step
times exclude compilation (each step function is compiled before the timed steps). On a GPU it
trains once per algorithm (default: auto, then xla) and prints both step times.

--fp8 trains the block on jax_overlap.Fp8AgDotGeneral / Fp8RsDotGeneral instead: every projection's
GEMM in float8, forward and backward (inputs and weights quantized to e4m3 each call, gradients to
e5m2), checked against the same float32 reference at the float8 tolerance; on a GPU it then also
trains the bf16 block on algorithm="xla" and prints both step times.

The defaults run in well under a minute on a 2-core machine with 8 CPU host devices; keep --steps
small there (XLA's CPU collectives on 8 host devices over 2 cores were seen to abort after about
30 steps).

  python examples/transformer_block.py                     # 8 CPU devices (dp 2 x tp 4) when there is no GPU
  python examples/transformer_block.py --seq 2048 --embed 4096 --heads 32 --ffn 14336 --dtype bfloat16
  python examples/transformer_block.py --fp8                # the projections in float8
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
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

try:
  from flax import nnx  # noqa: E402
except ImportError:
  sys.exit("this example needs flax: pip install '.[examples]'")

import jax_overlap  # noqa: E402

X_SPEC = P("dp", "tp", None)
# Parameter layouts by (layer, parameter); key and value are laid out like query.
PARAM_SPECS = {
    ("query", "kernel"): P(None, "tp", None), ("query", "bias"): P("tp", None),  # [E, heads, head_dim]
    ("out", "kernel"): P("tp", None, None), ("out", "bias"): P(),  # [heads, head_dim, E]
    ("up", "kernel"): P(None, None, "tp"), ("up", "bias"): P(None, "tp"),  # [E, 2, ffn]
    ("down", "kernel"): P("tp", None), ("down", "bias"): P(),  # [ffn, E]
    ("norm1", "scale"): P(), ("norm2", "scale"): P(),
}
# Largest relative error (in the 2-norm) of the loss and of any gradient.
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}
# The same with the projections in float8: e4m3 rounds each input and weight by up to 2^-4 (relative), e5m2
# each gradient by up to 2^-3, and the errors compound through the block's GEMMs (the default sizes on CPU:
# 0.12 at most, the QKV kernels' gradients; the loss 0.2%).
FP8_TOLERANCE = 0.25
LEARNING_RATE = 0.05


class DecoderBlock(nnx.Module):
  """Pre-norm decoder block. algorithm=None builds it on lax.dot_general (the reference)."""

  def __init__(self, embed: int, heads: int, ffn: int, *, algorithm, dtype, rngs: nnx.Rngs, fp8: bool = False):
    if algorithm is None:
      ag = rs = jax.lax.dot_general
    elif fp8:
      ag, rs = jax_overlap.Fp8AgDotGeneral(algorithm=algorithm), jax_overlap.Fp8RsDotGeneral(algorithm=algorithm)
    else:
      ag, rs = jax_overlap.AgDotGeneral(algorithm=algorithm), jax_overlap.RsDotGeneral(algorithm=algorithm)
    self.norm1 = nnx.RMSNorm(embed, dtype=dtype, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=embed, decode=False, dtype=dtype,
                                       qkv_dot_general=ag, out_dot_general=rs, rngs=rngs)
    self.norm2 = nnx.RMSNorm(embed, dtype=dtype, rngs=rngs)
    self.up = nnx.LinearGeneral(embed, (2, ffn), dtype=dtype, dot_general=ag, rngs=rngs)
    self.down = nnx.Linear(ffn, embed, dtype=dtype, dot_general=rs, rngs=rngs)

  def __call__(self, x):
    mask = nnx.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    h = x + self.attn(self.norm1(x), mask=mask)
    g = self.up(self.norm2(h))
    return h + self.down(nnx.silu(g[..., 0, :]) * g[..., 1, :])


def loss_fn(model, x, target):
  return jnp.mean(jnp.square(model(x).astype(jnp.float32) - target.astype(jnp.float32)))


def make_train_step(graphdef):
  def step(params, x, target):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), x, target))(params)
    new = jax.tree.map(lambda p, g: (p - LEARNING_RATE * g).astype(p.dtype), params, grads)
    return loss, grads, new
  return step


def param_shardings(params, mesh):
  def sharding(path, _):
    names = [str(p.key) for p in path if hasattr(p, "key")]
    layer = "query" if names[-2] in ("key", "value") else names[-2]
    return NamedSharding(mesh, PARAM_SPECS[(layer, names[-1])])
  return jax.tree_util.tree_map_with_path(sharding, params)


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq", type=int, default=64)
  parser.add_argument("--embed", type=int, default=64)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--ffn", type=int, default=128)
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument("--dtype", default=None, choices=sorted(TOLERANCE), help="default: bfloat16 on GPU, else float32")
  parser.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: min(4, devices))")
  parser.add_argument("--mesh", default="auto", choices=["auto", "explicit"], help="the mesh's axis types")
  parser.add_argument("--algorithms", default=None,
                      help="comma-separated algorithms to train with (default: auto,xla on GPU, else auto; with "
                           "--fp8: auto)")
  parser.add_argument("--fp8", action="store_true",
                      help="the projections on the float8 layers (Fp8AgDotGeneral, Fp8RsDotGeneral); on a GPU the "
                           "bf16 block on algorithm='xla' too, for the step time")
  args = parser.parse_args()
  gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
  args.dtype = jnp.dtype(args.dtype or ("bfloat16" if gpu else "float32"))
  args.algorithms = (args.algorithms or ("auto,xla" if gpu and not args.fp8 else "auto")).split(",")
  # (label, algorithm, float8 layers): what trains, and against which tolerance
  args.runs = [(f"fp8 {a}" if args.fp8 else a, a, args.fp8) for a in args.algorithms]
  if args.fp8 and gpu:
    args.runs.append(("bf16 xla", "xla", False))
  devices = jax.devices()
  args.tp = args.tp or min(4, len(devices))
  if len(devices) % args.tp or args.seq % args.tp or args.heads % args.tp or args.ffn % args.tp:
    parser.error(f"--tp {args.tp} must divide the {len(devices)} devices, --seq, --heads and --ffn")
  args.dp = len(devices) // args.tp
  if args.batch % args.dp:
    parser.error(f"--batch ({args.batch}) must be divisible by the data-parallel size {args.dp}")
  return args


def host_data(args):
  kx, kt = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (args.batch, args.seq, args.embed), jnp.float32)
  return x, jax.random.normal(kt, x.shape, jnp.float32)


def relative_error(got, want, floor: float = 1e-30) -> float:
  """||got - want|| / ||want|| (or / floor, when that is larger), in float64."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / max(float(np.linalg.norm(want)), floor))


def gradient_error(grads, ref_grads) -> float:
  """The largest relative error of any gradient. A gradient that cancels to zero (the key bias: softmax
  ignores a shift shared by a query's logits) keeps its terms' rounding, so each is measured against at
  least a hundredth of the largest gradient's norm."""
  pairs = [(g, np.asarray(r, np.float64)) for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))]
  floor = 1e-2 * max(float(np.linalg.norm(r)) for _, r in pairs)
  return max(relative_error(g, r, floor) for g, r in pairs)


def train(args, algorithm, fp8, mesh, init, x, target, reference):
  """Trains `steps` steps from `init` with jax_overlap; returns (worst error against the reference, ms per step,
  the last loss)."""
  model = DecoderBlock(args.embed, args.heads, args.ffn, algorithm=algorithm, dtype=args.dtype, rngs=nnx.Rngs(1),
                       fp8=fp8)
  graphdef, _ = nnx.split(model, nnx.Param)
  shardings = param_shardings(init, mesh)
  params = jax.tree.map(lambda p, s: jax.device_put(p.astype(args.dtype), s), init, shardings)
  act = NamedSharding(mesh, X_SPEC)
  x, target = jax.device_put(x.astype(args.dtype), act), jax.device_put(target.astype(args.dtype), act)
  step = jax.jit(make_train_step(graphdef), out_shardings=(NamedSharding(mesh, P()), shardings, shardings))
  t0 = time.perf_counter()
  with jax.set_mesh(mesh):
    step = step.lower(params, x, target).compile()
  print(f"  compiled in {time.perf_counter() - t0:.1f} s")
  worst, times = 0.0, []
  for i in range(args.steps):
    ref_loss, ref_grads = reference(params)  # the block without jax_overlap, at the same parameters
    start = time.perf_counter()
    loss, grads, params = step(params, x, target)
    loss = float(loss)  # waits for the step
    times.append(time.perf_counter() - start)
    err = max(relative_error(loss, ref_loss), gradient_error(grads, ref_grads))
    worst = max(worst, err)
    print(f"  step {i + 1}/{args.steps}  loss {loss:.6f}  reference {float(ref_loss):.6f}  "
          f"error (loss and gradients) {err:.1e}  {times[-1] * 1e3:.1f} ms")
  timed = times[1:] or times  # the first run of a compiled step still warms up
  return worst, 1e3 * sum(timed) / len(timed), loss


def main():
  args = parse_args()
  axis_type = AxisType.Explicit if args.mesh == "explicit" else AxisType.Auto
  mesh = jax.make_mesh((args.dp, args.tp), ("dp", "tp"), axis_types=(axis_type, axis_type))
  info = jax_overlap.build_info()
  print(f"{len(jax.devices())} x {jax.devices()[0].device_kind} as dp {args.dp} x tp {args.tp} ({args.mesh} mesh); "
        f"jax_overlap runs {info['runs']}")
  print(f"x [{args.batch}, {args.seq}, {args.embed}], {args.heads} heads, ffn {args.ffn}, {args.dtype.name}, "
        f"{args.steps} steps")
  x, target = host_data(args)
  one = jax.devices()[0]
  reference_model = DecoderBlock(args.embed, args.heads, args.ffn, algorithm=None, dtype=jnp.float32,
                                 rngs=nnx.Rngs(1))
  ref_graphdef, init = nnx.split(reference_model, nnx.Param)
  ref_step = jax.jit(make_train_step(ref_graphdef))
  ref_x, ref_target = jax.device_put(x, one), jax.device_put(target, one)

  def reference(params):
    """(loss, gradients) of the block on lax.dot_general, in float32 on one device, at `params`."""
    loss, grads, _ = ref_step(jax.tree.map(lambda p: jax.device_put(np.asarray(p, np.float32), one), params), ref_x,
                              ref_target)
    return loss, grads

  results, verdicts = {}, []
  for label, algorithm, fp8 in args.runs:
    print(f"{'float8 layers, ' if fp8 else ''}algorithm {algorithm}:")
    results[label] = train(args, algorithm, fp8, mesh, init, x, target, reference)
    tolerance, kind = (FP8_TOLERANCE, "float8") if fp8 else (TOLERANCE[args.dtype.name], args.dtype.name)
    verdicts.append((results[label][0] <= tolerance, label, results[label][0], tolerance, kind))
  for label, (err, ms, loss) in results.items():
    print(f"{label}: {ms:.2f} ms/step (compilation excluded), loss after {args.steps} steps {loss:.6f}, "
          f"largest error {err:.1e}")
  if args.fp8 and "bf16 xla" in results:
    base_ms, base_loss = results["bf16 xla"][1:]
    for label, (_, ms, loss) in results.items():
      if label != "bf16 xla":
        print(f"{label} against the bf16 block on XLA: {base_ms / ms:.2f}x its step time's speed, loss after "
              f"{args.steps} steps {loss:.6f} against {base_loss:.6f}")
  ok = all(v[0] for v in verdicts)
  worst = max(verdicts, key=lambda v: v[2] / v[3])
  print(f"{'PASS' if ok else 'FAIL'}: largest error against the lax.dot_general block {worst[2]:.1e} ({worst[1]}: "
        f"{'within' if worst[0] else 'above'} the {worst[4]} tolerance {worst[3]:.2g})")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
