"""The float8 layers for training, and the custom VJP every recipe runs (fp8_delayed.py's too). The kernel is
quantized straight into K-major, the only layout Hopper's fp8 GEMM takes; residuals are float8."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_overlap import _sharding, api, remat
from jax_overlap.integration import autodiff
from jax_overlap.layers.dot_general import Layer, check_bound, check_column_parallel, check_dim, check_row_parallel
from jax_overlap.ops import OPS, fp8_cast, fp8_scales
from jax_overlap.quantization import formats, recipes
from jax_overlap.quantization.scaling import Scales
from jax_overlap.runtime import backend

FAMILIES = ("ocp", "fnuz")
# "auto" is "kernels", faster on an operand read from memory; "xla" fuses the cast into the operand's producer,
# which wins where XLA's fusions produce the operands (MaxText: maxtext/hook.py AUTO_FP8_CAST).
CAST_ALGORITHMS = ("auto", "kernels", "xla")


@dataclasses.dataclass(frozen=True)
class Casts:
  algorithm: str

  def cast(self, x, scale, dtype):
    return fp8_cast.cast(x, scale, dtype, algorithm=self.algorithm)

  def cast_with_amax(self, x, scale, dtype, lead: int = 0, amax_from=None):
    return fp8_cast.cast_with_amax(x, scale, dtype, lead=lead, algorithm=self.algorithm, amax_from=amax_from)

  def step_scales(self, scales, histories, dtypes):
    return fp8_scales.step_scales(scales, histories, dtypes, algorithm=self.algorithm)


@dataclasses.dataclass(frozen=True)
class Fp8Call:
  """One fp8 layer call besides its operands and state: the custom VJP's static argument."""

  layer: str
  recipe: recipes.Recipe
  axis_name: str | tuple | None
  algorithm: str
  axis: int | None  # ag: x's gather dim; rs: the output's scatter dim (None: the plan's)
  out_sharding: object
  e4m3: str  # x's and the kernel's format
  e5m2: str
  x_dtype: str
  w_dtype: str
  fast_accumulation: bool
  cast_algorithm: str = "auto"

  @property
  def out_dtype(self) -> str:
    return np.dtype(jnp.promote_types(self.x_dtype, self.w_dtype)).name

  @property
  def axes(self) -> tuple:
    return tuple(self.axis_name) if isinstance(self.axis_name, (tuple, list)) else (self.axis_name,)

  @property
  def casts(self) -> Casts:
    return Casts("xla" if "xla" in (self.algorithm, self.cast_algorithm) else "auto")


def gpu_family() -> str:
  """fnuz where a local GPU is gfx942-class, else OCP; jax's devices tell before set-up, so tracing sets nothing up."""
  machine = backend.current()
  if machine.state.prepared:
    archs = [d.arch for d in machine.state.devices.values()]
  else:
    archs = [getattr(d, "compute_capability", "") or getattr(d, "device_kind", "") for d in machine.local_gpus()]
  fnuz = any(formats.fp8_family_of(str(a).split(":")[0]) == "fnuz" or any(m in str(a) for m in ("MI300", "MI325"))
             for a in archs)
  return "fnuz" if fnuz else "ocp"


class Fp8Layer(Layer):
  ALGORITHMS = tuple(a for a in api.ALGORITHMS if formats.takes(a, "float8_e4m3fn") or a in ("auto", "xla"))

  def __post_init__(self):
    super().__post_init__()
    name = type(self).__name__
    if self.family is not None and self.family not in FAMILIES:
      raise ValueError(f"jax_overlap.{name}: family must be None (the GPU's), 'ocp' or 'fnuz', got {self.family!r}")
    if self.scaling not in recipes.stateless():
      if self.scaling in recipes.RECIPES:
        raise ValueError(f"jax_overlap.{name}: scaling={self.scaling!r} keeps state between steps; use "
                         f"jax_overlap.Fp8Delayed{name[3:]}, a flax.linen module that holds it")
      raise ValueError(f"jax_overlap.{name}: scaling must be one of {recipes.stateless()}, got {self.scaling!r}")
    self.recipe.fast_accumulation(name, self.fast_accumulation)
    check_cast_algorithm(name, self.cast_algorithm)

  @property
  def recipe(self) -> recipes.Recipe:
    return recipes.RECIPES[self.scaling]()

  def forward_fast_accumulation(self) -> bool:
    return self.recipe.fast_accumulation(type(self).__name__, self.fast_accumulation)

  def _overlapped(self, parallel: str, axis, lhs, rhs, dimension_numbers, preferred_element_type, out_sharding):
    e4m3, e5m2 = formats.fp8_formats(self.family or gpu_family())
    return overlapped(parallel, lhs, rhs, dimension_numbers, (), layer=type(self).__name__, recipe=self.recipe,
                      axis_name=self.axis_name, algorithm=self.algorithm, axis=axis, out_sharding=out_sharding,
                      e4m3=e4m3, e5m2=e5m2, fast_accumulation=self.forward_fast_accumulation(),
                      cast_algorithm=self.cast_algorithm, preferred_element_type=preferred_element_type)


def check_cast_algorithm(layer: str, cast_algorithm) -> None:
  if cast_algorithm not in CAST_ALGORITHMS:
    raise ValueError(f"jax_overlap.{layer}: cast_algorithm must be one of {CAST_ALGORITHMS}, got {cast_algorithm!r}")


def check_scatter_axis(layer: str, axis_name, scatter_axis, given=None) -> None:
  if axis_name is not None and scatter_axis == -1:
    raise ValueError(f"jax_overlap.{layer}: scatter_axis={scatter_axis if given is None else given} (the output "
                     f"columns) is not supported inside shard_map (its data gradient would gather the contraction); "
                     f"use RsDotGeneral, or scatter another dim")


def check_inputs(layer: str, lhs, rhs) -> None:
  for name, v in (("x", lhs), ("kernel", rhs)):
    if formats.name(v.dtype) not in fp8_cast.INPUT_DTYPES:
      raise TypeError(f"jax_overlap.{layer}: {name} must have dtype {', '.join(fp8_cast.INPUT_DTYPES)} (the layer "
                      f"quantizes it), got {v.dtype}")


def _negative(axis, ndim: int):
  if isinstance(axis, (int, np.integer)) and not isinstance(axis, bool) and axis >= 0:
    return int(axis) - ndim
  return axis


def overlapped(parallel: str, lhs, rhs, dimension_numbers, state, *, layer: str, recipe: recipes.Recipe, axis_name,
               algorithm: str, axis, out_sharding, e4m3: str, e5m2: str, fast_accumulation: bool,
               cast_algorithm: str, preferred_element_type=None):
  """A float8 layer's dot, parallel "ag" (axis: x's gathered dim) or "rs" (the output dim scattered onto); `state`
  () for a stateless recipe. The result is in the inputs' promoted dtype."""
  check_inputs(layer, lhs, rhs)
  if parallel == "ag":
    check_column_parallel(layer, lhs, rhs, dimension_numbers, preferred_element_type)
    axis = _negative(axis, lhs.ndim)
  else:
    contract = check_row_parallel(layer, lhs, rhs, dimension_numbers, preferred_element_type)
    given, axis = axis, _negative(axis, lhs.ndim - contract + 1)
    check_scatter_axis(layer, axis_name, axis, given)
  check_bound(layer, axis_name)
  call = Fp8Call(layer=layer, recipe=recipe, axis_name=axis_name, algorithm=algorithm, axis=axis,
                 out_sharding=out_sharding, e4m3=e4m3, e5m2=e5m2, x_dtype=formats.name(lhs.dtype),
                 w_dtype=formats.name(rhs.dtype), fast_accumulation=fast_accumulation, cast_algorithm=cast_algorithm)
  x, w = lhs, rhs
  if axis_name is not None:
    x, w = autodiff.varying(call.axes, x, w)
  if parallel == "ag":
    x, w, restore = recipe.ag_operands(x, w, layer)
    return restore(_fp8_ag(x, w, state, call))
  x, w = recipe.rs_operands(x, w, contract, layer)
  return _fp8_rs(x, w, state, call)


def _layouts(call: Fp8Call, x, w) -> tuple:
  """dx's and dW's layouts on global arrays. x is not kept (shard_alike on it would undo the float8 residual): on an
  Auto mesh the dual op scatters onto x's sharded dim."""
  x_layout = autodiff.layout(x, call.axis_name)
  return (x_layout if isinstance(x_layout, autodiff.Layout) else None), autodiff.layout(w, call.axis_name)


def _dual_layout(x_layout) -> dict:
  return {"out_sharding": None if x_layout is None else x_layout.sharding}


def _custom_vjp(forward, backward):
  @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
  def layer(x, w, state, call: Fp8Call):
    return forward(x, w, state, call)[0]

  layer.defvjp(forward, backward)
  return layer


def _weight_grad(at8, a_scale, bt8, b_scale, w, w_layout, call: Fp8Call):
  """dW = a^T @ b, one float8 GEMM of a group of one (at8 [Ka, *l], bt8 [Nb, *l]), in w's dtype, shape, layout."""
  algorithm = "xla" if call.algorithm == "xla" else "auto"
  if call.axis_name is None:
    dw = api.matmul_rs(at8, bt8, x_scale=a_scale, w_scale=b_scale, out_dtype=call.w_dtype, w_kmajor=True,
                       algorithm=algorithm)
  else:
    at8, bt8, a_scale, b_scale = autodiff.varying(call.axes, at8, bt8, a_scale, b_scale)
    dw = OPS["matmul_rs"].rules.bind(at8, bt8, None, Scales(a_scale, b_scale, call.recipe.scaling), axis_name=None,
                                     axis_size=1, algorithm=algorithm, w_kmajor=True, out_dtype=call.w_dtype)
  return autodiff.like(_sharding.reshape(dw, w.shape), w_layout)


def _ag_forward(x, w, state, call: Fp8Call):
  x8, x_scale, w8, w_scale, kept = call.recipe.quantize(x, w, state, call, lead=1)  # [K, *n] -> [*n, K]
  y, gathered, scales = api.ag_matmul(x8, w8, x_scale=x_scale, w_scale=w_scale, out_dtype=call.out_dtype,
                                      fast_accumulation=call.fast_accumulation, w_kmajor=True,
                                      axis_name=call.axis_name, algorithm=call.algorithm, return_gathered=True,
                                      gather_axis=call.axis, out_sharding=call.out_sharding)
  return y, (gathered, scales, w, remat.tag(w_scale, remat.AG_W_SCALE), kept, _layouts(call, x, w))


def _ag_backward(call: Fp8Call, residuals, dy):
  gathered, scales, w, w_scale, kept, (x_layout, w_layout) = residuals
  dy8, dy_scale, state_cotangent = call.recipe.cotangent(dy, kept, call)
  w8, dual_scale = call.recipe.dual_kernel(w, w_scale, call)
  dx = api.matmul_rs(dy8, w8, x_scale=dy_scale, w_scale=dual_scale, out_dtype=call.x_dtype, w_kmajor=True,
                     axis_name=call.axis_name, algorithm=call.algorithm,
                     scatter_axis=None if x_layout is not None else call.axis, **_dual_layout(x_layout))
  operands = call.recipe.ag_weight_grad(gathered, scales, dy, dy8, dy_scale, call.axis, call)
  return autodiff.like(dx, x_layout), _weight_grad(*operands, w, w_layout, call), state_cotangent


_fp8_ag = _custom_vjp(_ag_forward, _ag_backward)


def _rs_forward(x, w, state, call: Fp8Call):
  x8, x_scale, w8, w_scale, kept = call.recipe.quantize(x, w, state, call, lead=w.ndim - 1)  # [*k, N] -> [N, *k]
  z = api.matmul_rs(x8, w8, x_scale=x_scale, w_scale=w_scale, out_dtype=call.out_dtype,
                    fast_accumulation=call.fast_accumulation, w_kmajor=True, axis_name=call.axis_name,
                    algorithm=call.algorithm, scatter_axis=call.axis, out_sharding=call.out_sharding)
  residuals = (remat.tag(x8, remat.RS_X_FP8), remat.tag(x_scale, remat.RS_X_SCALE), w,
               remat.tag(w_scale, remat.RS_W_SCALE), kept, _layouts(call, x, w))
  return z, residuals


def _rs_backward(call: Fp8Call, residuals, dz):
  x8, x_scale, w, w_scale, kept, (x_layout, w_layout) = residuals
  dz8, dz_scale, state_cotangent = call.recipe.cotangent(dz, kept, call)
  w8, dual_scale = call.recipe.dual_kernel(w, w_scale, call)
  gather = -2 if call.axis in (None, -1) else call.axis
  dx, dz_gathered, dz_scales = api.ag_matmul(
      dz8, w8, x_scale=dz_scale, w_scale=dual_scale, out_dtype=call.x_dtype, w_kmajor=True,
      axis_name=call.axis_name, algorithm=call.algorithm, return_gathered=True, gather_axis=gather,
      **_dual_layout(x_layout))
  operands = call.recipe.rs_weight_grad(x8, x_scale, dz_gathered, dz_scales, gather, call)
  return autodiff.like(dx, x_layout), _weight_grad(*operands, w, w_layout, call), state_cotangent


_fp8_rs = _custom_vjp(_rs_forward, _rs_backward)


@dataclasses.dataclass(frozen=True)
class Fp8AgDotGeneral(Fp8Layer):
  """AgDotGeneral in float8, for training: kernel [K, *n], x [..., K], both bf16/f16/f32, quantized to e4m3 each
  call and the cotangent to e5m2, so dx (matmul_rs) and dW run in float8 too. Residuals: jax_overlap.remat.

  axis_name, gather_axis: as AgDotGeneral's. algorithm: "auto", "pipelined" or "xla" ("fused" is 16-bit only).
  family: "ocp" or "fnuz" (None: fnuz on gfx942, else OCP). scaling: "tensor" (one scale per operand, the local
  shard's amax) or "block" (1x128 blocks of x and the cotangent, 128x128 tiles of the kernel; K, N and the gathered
  rows multiples of 128). fast_accumulation: the forward GEMM's (None: with tensor scales only); the gradients'
  GEMMs never. cast_algorithm: "kernels", "xla" (fusable into the operand's producer) or "auto" (the kernels).

  Example (flax.nnx, bf16 in and out):

    layer = nnx.Linear(512, 2048, dot_general=jax_overlap.Fp8AgDotGeneral(), param_dtype=jnp.bfloat16,
                       dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  """

  axis_name: str | tuple | None = None
  algorithm: str = "auto"
  gather_axis: int = -2
  family: str | None = None
  scaling: str = "tensor"
  fast_accumulation: bool | None = None
  cast_algorithm: str = "auto"

  def __post_init__(self):
    super().__post_init__()
    check_dim("Fp8AgDotGeneral", "gather_axis", self.gather_axis, optional=False)

  def _dot(self, lhs, rhs, dimension_numbers, preferred_element_type, out_sharding):
    return self._overlapped("ag", self.gather_axis, lhs, rhs, dimension_numbers, preferred_element_type, out_sharding)


@dataclasses.dataclass(frozen=True)
class Fp8RsDotGeneral(Fp8Layer):
  """RsDotGeneral in float8, for training: kernel [*k, N], x [..., *k], both bf16/f16/f32; as Fp8AgDotGeneral, with
  dx by ag_matmul. axis_name: as RsDotGeneral's; scatter_axis too, but not the columns (-1) inside shard_map, where
  the dual op would gather the contraction. The other fields as Fp8AgDotGeneral's.

  Example (flax.nnx, bf16 in and out):

    layer = nnx.Linear(2048, 512, dot_general=jax_overlap.Fp8RsDotGeneral(), param_dtype=jnp.bfloat16,
                       dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  """

  axis_name: str | tuple | None = None
  algorithm: str = "auto"
  scatter_axis: int | None = None
  family: str | None = None
  scaling: str = "tensor"
  fast_accumulation: bool | None = None
  cast_algorithm: str = "auto"

  def __post_init__(self):
    super().__post_init__()
    check_dim("Fp8RsDotGeneral", "scatter_axis", self.scatter_axis, optional=True)
    check_scatter_axis("Fp8RsDotGeneral", self.axis_name, self.scatter_axis)

  def _dot(self, lhs, rhs, dimension_numbers, preferred_element_type, out_sharding):
    return self._overlapped("rs", self.scatter_axis, lhs, rhs, dimension_numbers, preferred_element_type,
                            out_sharding)
