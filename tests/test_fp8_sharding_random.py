"""The float8 features on global arrays under random shardings: a fixed-seed sample of layouts, checked against a
float64 NumPy reference of the same quantized computation.

Each case draws a mesh ((8,), (2, 4) or (4, 2); Auto or Explicit axes), a target (Fp8AgDotGeneral or
Fp8RsDotGeneral with their value and both gradients; ag_matmul or matmul_rs on float8 operands with their scales,
the value), a scaling (one scale per tensor, or block scales), an algorithm ("auto": the custom partitioning;
"xla": the dot XLA partitions) and a NamedSharding for each operand (the scales too, for the ops), each dim on no
axis, one or two, wherever they divide it; the README's layouts (the Flax block's kernels, the sequence on tp, the
batch on dp) come on top. On global arrays a call quantizes each whole array once (block scales per 128 block or
128x128 tile of the whole array), so the float8 values do not depend on the sharding and the reference needs none:
what is left to compare is the float32 accumulation (tolerance.py at float32). Shapes are small (128 rows, K and N
of 64 or 256): most cases shard a dim of blocks over more devices than it has (sub-axes in propagation, issue #38).
Eight layer cases draw x or the cotangent tiny (an amax below the format's max * 2^-126, where a scale computed from
amax / max was flushed to zero), the other operands away from zero so that no product is a float32 subnormal.

A failing case's id names everything it drew (e.g. `17-Fp8RsDotGeneral-block-Explicit(2,4)-xla`); the draw is
one seed's, so `-k` runs it alone. 40 cases: about 45 s of one core with jax 0.10.2, 38 s with 0.12 (compiles);
and 16 under jax.vmap (test_random_sharding_vmap), each target and scaling once per mesh type.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap
from fp8_reference import B, check, dequantized, layer_reference, mesh_of, vjp

SEED = 38
RANDOM_CASES = 32
MESHES = (((8,), ("tp",)), ((2, 4), ("dp", "tp")), ((4, 2), ("dp", "tp")))
TARGETS = ("Fp8AgDotGeneral", "Fp8RsDotGeneral", "ag_matmul", "matmul_rs")
# cases whose x or cotangent is tiny: both layers, both scalings, each operand
TINY = {0: "x", 1: "x", 8: "cotangent", 9: "cotangent", 20: "x", 21: "x", 28: "cotangent", 29: "cotangent"}


@dataclasses.dataclass(frozen=True)
class Case:
  target: str
  scaling: str
  mesh_shape: tuple
  names: tuple
  explicit: bool
  algorithm: str
  shapes: tuple  # x, w (the kernel, or the float8 w), and for the layers the cotangent
  specs: tuple  # per operand (ops: x, w, x_scale, w_scale; layers: x, w, cotangent)
  w_kmajor: bool = False
  out_spec: tuple | None = None  # out_sharding, or None
  name: str = ""
  tiny: str = ""  # "x" or "cotangent": that operand's amax below the format's max * 2^-126 (issue #38's zeros)

  @property
  def id(self) -> str:
    kind = "Explicit" if self.explicit else "Auto"
    tiny = f"-tiny_{self.tiny}" if self.tiny else ""
    return f"{self.name}-{self.target}-{self.scaling}-{kind}{self.mesh_shape}-{self.algorithm}{tiny}".replace(" ", "")


# --- drawing the cases ----------------------------------------------------------------------------------------

def _spec(rng, shape, sizes: dict) -> tuple:
  """A random valid spec for `shape`: each dim on no axis (half the time), one axis or two, wherever their product
  divides it, no axis twice."""
  free, spec = list(sizes), []
  for n in shape:
    choice = None
    if free and rng.random() < 0.5:
      k = min(len(free), int(rng.integers(1, 3)))
      axes = tuple(rng.permutation(free)[:k])
      axes = tuple(str(a) for a in axes)
      if n % math.prod(sizes[a] for a in axes) == 0:
        choice = axes[0] if k == 1 else axes
        free = [a for a in free if a not in axes]
    spec.append(choice)
  return tuple(spec)


def _random_case(i: int, rng) -> Case:
  """Case i: the targets and scalings in turn (each as often as the others), the rest drawn."""
  target, scaling = TARGETS[i % len(TARGETS)], ("tensor", "block")[i // len(TARGETS) % 2]
  mesh_shape, names = MESHES[int(rng.integers(len(MESHES)))]
  sizes = dict(zip(names, mesh_shape))
  explicit, algorithm = bool(rng.integers(2)), ("auto", "xla")[int(rng.integers(2))]
  k, n = (2 * B, 2 * B) if scaling == "block" else (64, 64)
  w_kmajor = target in ("ag_matmul", "matmul_rs") and bool(rng.integers(2))
  if target.startswith("Fp8"):
    shapes = ((2, 64, k), (k, n), (2, 64, n))
  else:
    shapes = ((2, 64, k), (n, k) if w_kmajor else (k, n))
    if scaling == "block":
      shapes += ((2, 64, k // B), (n // B, k // B) if w_kmajor else (k // B, n // B))
  specs = tuple(_spec(rng, s, sizes) for s in shapes)
  out_spec = None
  if target in ("Fp8RsDotGeneral", "matmul_rs") and rng.random() < 0.4:
    out_spec = _spec(rng, (2, 64, n), sizes)
  tiny = TINY.get(i, "")
  return Case(target, scaling, mesh_shape, names, explicit, algorithm, shapes, specs, w_kmajor, out_spec, str(i),
              tiny)


def _readme_cases() -> list:
  """The README's Flax block on global arrays: the sequence on tp (the batch on dp with two axes), the QKV kernel's
  heads, the gated MLP's ffn, the attention output's heads and the down kernel's rows on tp, each output asked
  for with the rows on tp."""
  cases, kinds = [], (("block", True), ("tensor", False), ("tensor", True), ("block", False))
  for m, (mesh_shape, names) in enumerate((((8,), ("tp",)), ((2, 4), ("dp", "tp")))):
    batch = "dp" if "dp" in names else None
    rows = (batch, "tp", None)
    e, d = 256, 32  # embed, head_dim: 8 heads of 32, the ffn 128 (two of it gated)
    layouts = (
        ("qkv", "Fp8AgDotGeneral", ((2, 64, e), (e, 8, d), (2, 64, 8, d)),
         (rows, (None, "tp", None), (batch, None, "tp", None)), None),
        ("up", "Fp8AgDotGeneral", ((2, 64, e), (e, 2, 128), (2, 64, 2, 128)),
         (rows, (None, None, "tp"), (batch, None, None, "tp")), None),
        ("out", "Fp8RsDotGeneral", ((2, 64, 8, d), (8, d, e), (2, 64, e)),
         ((batch, None, "tp", None), ("tp", None, None), rows), rows),
        ("down", "Fp8RsDotGeneral", ((2, 64, 128), (128, e), (2, 64, e)),
         ((batch, None, "tp"), ("tp", None), rows), rows),
    )
    for j, (name, target, shapes, specs, out_spec) in enumerate(layouts):  # each layout in two of the four kinds
      scaling, explicit = kinds[(j + 2 * m) % len(kinds)]
      cases.append(Case(target, scaling, mesh_shape, names, explicit, "auto", shapes, specs, False, out_spec,
                        f"readme_{name}"))
  return cases


def _cases() -> list:
  rng = np.random.default_rng(SEED)
  return [_random_case(i, rng) for i in range(RANDOM_CASES)] + _readme_cases()


CASES = _cases()


def _draw(rng, shape, top=None):
  """Unit-normal values, or with `top` magnitudes in [top / 2, top] (random signs): tiny ones that stay float32
  normals, as do their products with the others (XLA on CPU would flush subnormals)."""
  if top is None:
    return rng.standard_normal(shape).astype(np.float32)
  return (rng.choice([-1.0, 1.0], shape) * rng.uniform(0.5, 1, shape) * top).astype(np.float32)


def _op_inputs(case: Case, rng):
  """(x8, w8, x_scale, w_scale) and the float64 product: random float8 values, power-of-two scales (block scales
  of magnitudes that change from block to block)."""
  x8 = rng.standard_normal(case.shapes[0]).astype(jnp.float8_e4m3fn)
  w8 = rng.standard_normal(case.shapes[1]).astype(jnp.float8_e4m3fn)
  if case.scaling == "tensor":
    xs, ws = np.float32(0.5), np.float32(2.0 ** -5)
  else:
    xs = (2.0 ** rng.integers(-6, 3, case.shapes[2])).astype(np.float32)
    ws = (2.0 ** rng.integers(-6, 3, case.shapes[3])).astype(np.float32)
  w_value = dequantized(w8, ws)
  want = dequantized(x8, xs) @ (w_value.T if case.w_kmajor else w_value)
  return (x8, w8, xs, ws), want


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_random_sharding(case: Case, assert_close):
  rng = np.random.default_rng(SEED + 1000 * CASES.index(case))
  mesh = mesh_of(case.mesh_shape, case.names, case.explicit)
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
  out_sharding = None if case.out_spec is None else NamedSharding(mesh, P(*case.out_spec))
  if not case.target.startswith("Fp8"):
    (x8, w8, xs, ws), want = _op_inputs(case, rng)
    args = [put(x8, case.specs[0]), put(w8, case.specs[1])]
    if case.scaling == "block":
      args += [put(xs, case.specs[2]), put(ws, case.specs[3])]
    else:
      args += [jnp.float32(xs), jnp.float32(ws)]
    fn = getattr(jax_overlap, case.target)
    kw = {} if out_sharding is None else {"out_sharding": out_sharding}
    got = jax.jit(lambda x, w, xs, ws: fn(x, w, x_scale=xs, w_scale=ws, out_dtype=jnp.float32, w_kmajor=case.w_kmajor,
                                          algorithm=case.algorithm, **kw))(*args)
    check(got, want, x8.shape[-1], "value", assert_close)
    return
  # tiny: x below e4m3's max * 2^-126 (5.3e-36), or the cotangent below e5m2's (6.7e-34); the others then away
  # from zero, so that no product of theirs is a subnormal
  away = 1.0 if case.tiny else None
  x = _draw(rng, case.shapes[0], 2.0 ** -119 if case.tiny == "x" else away)
  w = _draw(rng, case.shapes[1], away) / 8
  ct = _draw(rng, case.shapes[2], 2.0 ** -112 if case.tiny == "cotangent" else away)
  ag = case.target == "Fp8AgDotGeneral"
  contract = 1 if ag else w.ndim - 1
  if case.scaling == "block" and case.tiny != "x":  # magnitudes that change from one 128 block of the contraction
    kx = math.prod(x.shape[x.ndim - contract:])
    factor = np.repeat(10.0 ** (np.arange(kx // B) % 3 - 1), B).astype(np.float32)
    x = (x.reshape(*x.shape[:x.ndim - contract], kx) * factor).reshape(x.shape)
  layer = getattr(jax_overlap, case.target)(algorithm=case.algorithm, scaling=case.scaling)
  dn = ((tuple(range(x.ndim - contract, x.ndim)), tuple(range(contract))), ((), ()))
  f = lambda x, w: layer(x, w, dn, out_sharding=out_sharding)
  got = jax.jit(lambda x, w, ct: vjp(f, x, w, ct))(*(put(a, s) for a, s in zip((x, w, ct), case.specs)))
  want = layer_reference(case.target, case.scaling, x, w, ct)
  k = (math.prod(x.shape[x.ndim - contract:]), math.prod(ct.shape[x.ndim - contract:]), math.prod(x.shape[:-contract]))
  for name, g, r, terms in zip(("value", "dx", "dW"), got, want, k):
    check(g, r, terms, name, assert_close)
  if case.explicit:  # the gradients come back in their primal's layout
    for name, g, spec in (("dx", got[1], case.specs[0]), ("dW", got[2], case.specs[1])):
      assert g.sharding.is_equivalent_to(NamedSharding(mesh, P(*spec)), g.ndim), f"{name}: {g.sharding}"


# --- under jax.vmap -------------------------------------------------------------------------------------------
# Issue 52, item 3: on an Explicit mesh a weight or a scale per element (and the layers, whose scales are per
# element under vmap) failed with JAX's ShardingTypeError. Each target and scaling once per mesh type, with what is
# batched drawn (ops: x and w, w alone, or x and both scales; layers: x, or x and the kernel) and a random spec for
# each operand (the batch dims on one axis or none).

VMAP_BATCH = 2
VMAP_CASES_PER_KIND = 16


@dataclasses.dataclass(frozen=True)
class VmapCase:
  target: str
  scaling: str
  mesh_shape: tuple
  names: tuple
  explicit: bool
  algorithm: str
  batched: str  # what the vmap batches (ops: "x_and_w", "w", "scales"; layers: "x", "x_and_w")
  specs: tuple  # per operand, of its shape with the batch dim where batched (ops: x, w, x_scale, w_scale; layers:
  # x, w, cotangent)
  name: str

  @property
  def id(self) -> str:
    kind = "Explicit" if self.explicit else "Auto"
    return (f"vmap{self.name}-{self.target}-{self.scaling}-{self.batched}-{kind}{self.mesh_shape}-"
            f"{self.algorithm}").replace(" ", "")

  def batches(self, operand: str) -> bool:
    """Whether `operand` (x, w, x_scale, w_scale, cotangent) has a batch dim."""
    if self.target.startswith("Fp8"):
      return operand != "w" or self.batched == "x_and_w"
    return {"x": self.batched != "w", "w": self.batched != "scales", "x_scale": self.batched != "w"}.get(operand, True)

  def shapes(self) -> tuple:
    """The operands' shapes (with their batch dims)."""
    # block scales: an element's rows one block (the layers' weight gradient contracts them in blocks of 128)
    m, k, n = (B, 2 * B, 2 * B) if self.scaling == "block" else (64, 64, 64)
    names = ["x", "w", "cotangent"] if self.target.startswith("Fp8") else ["x", "w", "x_scale", "w_scale"]
    one = {"x": (m, k), "w": (k, n), "cotangent": (m, n),
           "x_scale": (m, k // B) if self.scaling == "block" else (),
           "w_scale": (k // B, n // B) if self.scaling == "block" else ()}
    return tuple(((VMAP_BATCH,) if self.batches(o) else ()) + one[o] for o in names)


def _vmap_cases() -> list:
  rng = np.random.default_rng(SEED + 1)
  cases = []
  for i in range(VMAP_CASES_PER_KIND):
    target, scaling = TARGETS[i % len(TARGETS)], ("tensor", "block")[i // len(TARGETS) % 2]
    explicit = bool(i // (2 * len(TARGETS)) % 2)
    mesh_shape, names = MESHES[int(rng.integers(len(MESHES)))]
    batched = rng.choice(["x", "x_and_w"] if target.startswith("Fp8") else ["x_and_w", "w", "scales"])
    algorithm = ("auto", "xla")[int(rng.random() < 0.25)]
    case = VmapCase(target, scaling, mesh_shape, names, explicit, algorithm, str(batched), (), str(i))
    # The batch dims of every batched operand on one axis or none (JAX refuses an unbatched operand on the axis a
    # vmap maps over), the other dims drawn from the other axes.
    batch_axis = rng.choice([None, *(a for a, size in zip(names, mesh_shape) if VMAP_BATCH % size == 0)])
    sizes = {a: size for a, size in zip(names, mesh_shape) if a != batch_axis}
    operands = ("x", "w", "cotangent") if target.startswith("Fp8") else ("x", "w", "x_scale", "w_scale")
    specs = []
    for o, shape in zip(operands, case.shapes()):
      lead = (None if batch_axis is None else str(batch_axis),) if case.batches(o) else ()
      own = shape[len(lead):]
      specs.append(lead + (_spec(rng, own, sizes) if own else ()))
    cases.append(dataclasses.replace(case, specs=tuple(specs)))
  return cases


VMAP_CASES = _vmap_cases()


@pytest.mark.parametrize("case", VMAP_CASES, ids=[c.id for c in VMAP_CASES])
def test_random_sharding_vmap(case: VmapCase, assert_close):
  mesh = mesh_of(case.mesh_shape, case.names, case.explicit)
  # On an Explicit mesh under the mesh's context, as JAX asks there: from jax 0.12 on, even stock jnp arithmetic
  # under a vmap whose batch is sharded fails without it ("Resource axis ... is not found in mesh: ()").
  with jax.set_mesh(mesh) if case.explicit else contextlib.nullcontext():
    _check_vmap(case, mesh, assert_close)


def _check_vmap(case: VmapCase, mesh, assert_close):
  rng = np.random.default_rng(SEED + 1000 * (len(CASES) + VMAP_CASES.index(case)))
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
  shapes = case.shapes()
  axes = tuple(0 if case.batches(o) else None for o in (("x", "w", "cotangent") if case.target.startswith("Fp8")
                                                         else ("x", "w", "x_scale", "w_scale")))
  each = lambda a, axis, b: a if axis is None else a[b]
  if not case.target.startswith("Fp8"):
    x8, w8 = (rng.standard_normal(s).astype(jnp.float8_e4m3fn) for s in shapes[:2])
    xs, ws = ((2.0 ** rng.integers(-6, 3, s)).astype(np.float32) for s in shapes[2:])
    fn = getattr(jax_overlap, case.target)
    f = jax.vmap(lambda x, w, xs, ws: fn(x, w, x_scale=xs, w_scale=ws, out_dtype=jnp.float32,
                                         algorithm=case.algorithm), in_axes=axes)
    got = jax.jit(f)(*(put(a, s) for a, s in zip((x8, w8, xs, ws), case.specs)))
    want = np.stack([dequantized(each(x8, axes[0], b), each(xs, axes[2], b))
                     @ dequantized(each(w8, axes[1], b), each(ws, axes[3], b)) for b in range(VMAP_BATCH)])
    check(got, want, shapes[0][-1], "value", assert_close)
    return
  x, w, ct = _draw(rng, shapes[0]), _draw(rng, shapes[1]) / 8, _draw(rng, shapes[2])
  layer = getattr(jax_overlap, case.target)(algorithm=case.algorithm, scaling=case.scaling)
  dn = (((1,), (0,)), ((), ()))
  f = jax.vmap(lambda x, w: layer(x, w, dn), in_axes=axes[:2])
  got = jax.jit(lambda x, w, ct: vjp(f, x, w, ct))(*(put(a, s) for a, s in zip((x, w, ct), case.specs)))
  # Each element is a call of its own: quantized on its own, as the reference quantizes a global array.
  per_element = [layer_reference(case.target, case.scaling, x[b], each(w, axes[1], b), ct[b])
                 for b in range(VMAP_BATCH)]
  y, dx, dw = (np.stack(r) for r in zip(*per_element))
  if axes[1] is None:
    dw = dw.sum(0)
  rows = x.shape[1] * (VMAP_BATCH if axes[1] is None else 1)
  for name, g, r, terms in zip(("value", "dx", "dW"), got, (y, dx, dw), (x.shape[-1], w.shape[-1], rows)):
    check(g, r, terms, name, assert_close)
