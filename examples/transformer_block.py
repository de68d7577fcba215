"""A Flax NNX decoder block trained on jax_overlap's layers, timed beside the same block on stock lax.dot_general.

  h   = x + attention(rms_norm(x))        QKV kernels [E, heads, head_dim], output kernel [heads, head_dim, E]
  out = h + down(silu(gate) * up)         gate and up from one kernel [E, 2, ffn]; down [ffn, E]

x [batch, seq, E] is sharded P('dp', 'tp', None) and the projections on the heads and the ffn: the
column-parallel layers (QKV, up) take jax_overlap.AgDotGeneral() and all-gather the sequence under their
GEMM, the row-parallel ones (out, down) take jax_overlap.RsDotGeneral() and reduce-scatter it.

Each block trains from the same parameters: "stock" on lax.dot_general (XLA's collectives beside its
GEMMs), then each jax_overlap algorithm. The first --steps steps of each are checked against the block on
lax.dot_general in float32 on one device (PASS or FAIL at the dtype's tolerance); then --timed steps
of every block, taken in turns so that clock drift falls on all of them alike, are timed one by one
(block_until_ready) after one step of warm-up, and each block's median, interquartile range and
min-max are printed.

The default size follows the backend: on a GPU a step is GPU work (batch 8, seq 1024, embed 2048,
16 heads, ffn 8192, bf16: tens of ms per step on one H100), on CPU (8 host devices) a small float32
block that runs in well under a minute on 2 cores.

  python examples/transformer_block.py             # stock, auto and xla on GPUs; stock and auto on 8 CPU devices
  python examples/transformer_block.py --seq 2048 --embed 4096 --heads 32 --ffn 14336
  python examples/transformer_block.py --fp8       # the projections in float8, beside the stock bf16 block
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
# (batch, seq, embed, heads, ffn) by backend: on a GPU large enough that a step is GPU work, not host dispatch.
SIZES = {"gpu": (8, 1024, 2048, 16, 8192), "cpu": (4, 64, 64, 8, 128)}
# Largest relative error (in the 2-norm) of the loss and of any gradient.
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}
# e4m3 rounds each input and weight by up to 2^-4 (relative), e5m2 each gradient by up to 2^-3, and the errors
# compound through the block's GEMMs (the CPU default: 0.12 at most, the QKV kernels' gradients).
FP8_TOLERANCE = 0.25
LEARNING_RATE = 0.05
STOCK = "stock"


class DecoderBlock(nnx.Module):
  """Pre-norm decoder block; layers=None builds it on lax.dot_general."""

  def __init__(self, embed: int, heads: int, ffn: int, *, layers, dtype, rngs: nnx.Rngs):
    ag, rs = layers or (jax.lax.dot_general, jax.lax.dot_general)
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


def layers_of(label: str):
  """The (column-parallel, row-parallel) dot_generals a run's label names; None for the stock block."""
  if label == STOCK:
    return None
  fp8, algorithm = label.startswith("fp8 "), label.removeprefix("fp8 ")
  if fp8:
    return jax_overlap.Fp8AgDotGeneral(algorithm=algorithm), jax_overlap.Fp8RsDotGeneral(algorithm=algorithm)
  return jax_overlap.AgDotGeneral(algorithm=algorithm), jax_overlap.RsDotGeneral(algorithm=algorithm)


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
  gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  for name, on_gpu, on_cpu in zip(("batch", "seq", "embed", "heads", "ffn"), SIZES["gpu"], SIZES["cpu"]):
    parser.add_argument(f"--{name}", type=int, default=on_gpu if gpu else on_cpu,
                        help=f"default: {on_gpu} on a GPU, {on_cpu} on CPU")
  parser.add_argument("--steps", type=int, default=2, help="steps of each block checked against float32 (default 2)")
  parser.add_argument("--timed", type=int, default=10, help="timed steps of each block, after one of warm-up "
                                                            "(default 10)")
  parser.add_argument("--dtype", default=None, choices=sorted(TOLERANCE), help="default: bfloat16 on GPU, else float32")
  parser.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: min(4, devices))")
  parser.add_argument("--mesh", default="auto", choices=["auto", "explicit"], help="the mesh's axis types")
  parser.add_argument("--algorithms", default=None,
                      help="comma-separated jax_overlap algorithms to train beside the stock block (default: auto,xla "
                           "on a GPU, auto on CPU, where each block's compilation is most of the run)")
  parser.add_argument("--fp8", action="store_true",
                      help="the projections on the float8 layers (Fp8AgDotGeneral, Fp8RsDotGeneral), beside the stock "
                           "block in --dtype")
  args = parser.parse_args()
  if args.steps < 1 or args.timed < 1:
    parser.error(f"--steps ({args.steps}) and --timed ({args.timed}) must be at least 1")
  args.dtype = jnp.dtype(args.dtype or ("bfloat16" if gpu else "float32"))
  algorithms = (args.algorithms or ("auto,xla" if gpu and not args.fp8 else "auto")).split(",")
  args.labels = [STOCK] + [f"fp8 {a}" if args.fp8 else a for a in algorithms]
  devices = jax.devices()
  args.tp = args.tp or min(4, len(devices))
  if len(devices) % args.tp or args.seq % args.tp or args.heads % args.tp or args.ffn % args.tp:
    parser.error(f"--tp {args.tp} must divide the {len(devices)} devices, --seq, --heads and --ffn")
  args.dp = len(devices) // args.tp
  if args.batch % args.dp:
    parser.error(f"--batch ({args.batch}) must be divisible by the data-parallel size {args.dp}")
  args.gpu = gpu
  return args


def relative_error(got, want, floor: float = 1e-30) -> float:
  """||got - want|| / max(||want||, floor), in float64."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / max(float(np.linalg.norm(want)), floor))


def gradient_error(grads, ref_grads) -> float:
  """The largest relative error of any gradient. A gradient that cancels to zero (the key bias: softmax ignores a
  shift shared by a query's logits) keeps its terms' rounding, so each is measured against at least a hundredth
  of the largest gradient's norm."""
  pairs = [(g, np.asarray(r, np.float64)) for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))]
  floor = 1e-2 * max(float(np.linalg.norm(r)) for _, r in pairs)
  return max(relative_error(g, r, floor) for g, r in pairs)


class Run:
  """One block: its compiled step and its parameters as training moves them."""

  def __init__(self, label, args, mesh, init, x, target):
    self.label = label
    model = DecoderBlock(args.embed, args.heads, args.ffn, layers=layers_of(label), dtype=args.dtype,
                         rngs=nnx.Rngs(1))
    graphdef, _ = nnx.split(model, nnx.Param)
    shardings = param_shardings(init, mesh)
    self.params = jax.tree.map(lambda p, s: jax.device_put(p.astype(args.dtype), s), init, shardings)
    act = NamedSharding(mesh, X_SPEC)
    self.x, self.target = (jax.device_put(a.astype(args.dtype), act) for a in (x, target))
    step = jax.jit(make_train_step(graphdef), out_shardings=(NamedSharding(mesh, P()), shardings, shardings))
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
      self.step = step.lower(self.params, self.x, self.target).compile()
    print(f"{label}: compiled in {time.perf_counter() - t0:.1f} s")
    self.times, self.worst, self.loss = [], 0.0, None

  def train(self):
    """One step; returns (loss, gradients) of the parameters it started from."""
    loss, grads, self.params = self.step(self.params, self.x, self.target)
    self.loss = loss
    return loss, grads

  def timed(self):
    start = time.perf_counter()
    jax.block_until_ready(self.train())
    return time.perf_counter() - start


def spread(times) -> str:
  ms = 1e3 * np.asarray(times)
  q1, median, q3 = np.percentile(ms, [25, 50, 75])
  return f"median {median:.2f} ms/step, IQR {q1:.2f}-{q3:.2f}, min-max {ms.min():.2f}-{ms.max():.2f}"


def what_it_shows(args) -> str:
  if not args.gpu:
    return ("On CPU devices every call takes the XLA path: these times check that the example runs, and say nothing "
            "about a GPU.")
  if args.tp == 1:
    return ("One device per tensor-parallel group: no collective runs, so this compares the GEMM path alone "
            "(jax_overlap's group of one: XLA's dot in 16 bits, the vendor's fp8 GEMM in float8) with stock "
            "lax.dot_general. The overlap of communication with GEMMs needs --tp 2 or more GPUs.")
  return (f"tp {args.tp}: the stock block and algorithm='xla' run XLA's all-gather and reduce-scatter beside their "
          f"GEMMs; 'auto' overlaps them under the GEMMs where its cost model predicts a gain (the XLA path "
          f"elsewhere). auto against xla is what the overlap wins back at this size; against stock, also what the "
          f"rest of jax_overlap's path costs or saves.")


def main():
  args = parse_args()
  axis_type = AxisType.Explicit if args.mesh == "explicit" else AxisType.Auto
  mesh = jax.make_mesh((args.dp, args.tp), ("dp", "tp"), axis_types=(axis_type, axis_type))
  print(f"{len(jax.devices())} x {jax.devices()[0].device_kind} as dp {args.dp} x tp {args.tp} ({args.mesh} mesh); "
        f"jax_overlap runs {jax_overlap.build_info()['runs']}")
  print(f"x [{args.batch}, {args.seq}, {args.embed}], {args.heads} heads, ffn {args.ffn}, {args.dtype.name}; "
        f"{args.steps} checked and {args.timed} timed steps of each block")
  kx, kt = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (args.batch, args.seq, args.embed), jnp.float32)
  target = jax.random.normal(kt, x.shape, jnp.float32)

  one = jax.devices()[0]
  ref_graphdef, init = nnx.split(DecoderBlock(args.embed, args.heads, args.ffn, layers=None, dtype=jnp.float32,
                                              rngs=nnx.Rngs(1)), nnx.Param)
  ref_step = jax.jit(make_train_step(ref_graphdef))
  ref_x, ref_target = jax.device_put(x, one), jax.device_put(target, one)

  def reference(params):
    """(loss, gradients) of the block on lax.dot_general in float32 on one device, at `params`."""
    loss, grads, _ = ref_step(jax.tree.map(lambda p: jax.device_put(np.asarray(p, np.float32), one), params), ref_x,
                              ref_target)
    return loss, grads

  # Stock lax.dot_general cannot type these layouts on Explicit axes (x's sequence and a kernel's output dim on one
  # axis: the product would name it twice), which is what jax_overlap's layers resolve; the stock block runs on the
  # same devices with the axes Auto.
  stock_mesh = mesh if args.mesh == "auto" else jax.make_mesh((args.dp, args.tp), ("dp", "tp"),
                                                              axis_types=(AxisType.Auto, AxisType.Auto))
  runs = [Run(label, args, stock_mesh if label == STOCK else mesh, init, x, target) for label in args.labels]
  for run in runs:
    for i in range(args.steps):
      ref_loss, ref_grads = reference(run.params)
      loss, grads = run.train()
      err = max(relative_error(loss, ref_loss), gradient_error(grads, ref_grads))
      run.worst = max(run.worst, err)
      print(f"{run.label}: step {i + 1}/{args.steps}  loss {float(loss):.6f}  reference {float(ref_loss):.6f}  "
            f"error (loss and gradients) {err:.1e}")
  for run in runs:
    run.timed()
  for _ in range(args.timed):
    for run in runs:
      run.times.append(run.timed())

  stock = np.median(runs[0].times)
  for run in runs:
    against = "" if run.label == STOCK else f"; {stock / np.median(run.times):.2f}x the stock block's speed"
    print(f"{run.label}: {spread(run.times)} over {len(run.times)} steps{against}; loss after "
          f"{args.steps + 1 + args.timed} steps {float(run.loss):.6f}, largest error {run.worst:.1e}")
  print(what_it_shows(args))

  checked = [(run.worst, FP8_TOLERANCE if run.label.startswith("fp8") else TOLERANCE[args.dtype.name], run.label)
             for run in runs[1:]]
  worst, tolerance, label = max(checked, key=lambda c: c[0] / c[1])
  ok = all(err <= tol for err, tol, _ in checked)
  kind = "float8" if label.startswith("fp8") else args.dtype.name
  print(f"{'PASS' if ok else 'FAIL'}: largest error against the lax.dot_general block in float32 {worst:.1e} "
        f"({label}: {'within' if worst <= tolerance else 'above'} the {kind} tolerance {tolerance:.2g}; the stock "
        f"block's own: {runs[0].worst:.1e})")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
