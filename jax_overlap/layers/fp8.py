"""The float8 layers: AgDotGeneral and RsDotGeneral (layers/dot_general.py) in float8, for training.

Fp8AgDotGeneral and Fp8RsDotGeneral are the same layers in float8, for
training: they take bfloat16/float16/float32 inputs and kernels and quantize
both on every call (current scaling: the amax of the local shard, a
power-of-two scale, a cast to e4m3), the kernel straight into the K-major
layout Hopper's fp8 GEMM takes, in the same pass. Casts with no transpose in
them run on ops/fp8_cast.py's primitive (the project's cast kernel where it takes
the call, XLA's cast of the same values otherwise). Their custom VJP quantizes
the cotangent to e5m2 the same way, so that the data gradient (the dual op)
and the weight gradient run in float8 too, and keeps float8 residuals in
place of the activation: Fp8AgDotGeneral the gathered x (half the bytes of the
bf16 gathered x the 16-bit layer keeps) with its per-shard scales,
Fp8RsDotGeneral its quantized x. Where the weight gradient contracts rows that
carry per-shard scales (the gathered x; the gathered cotangent of matmul_rs),
the scales fold into the e5m2 operand's quantization, so it stays one GEMM of
one scale per operand: exact up to that quantization's rounding (power-of-two
scales shift values exactly, quantization/numerics.py). That GEMM contracts the rows, the
outer dim of both operands, so both are transposed for it (Hopper's fp8 GEMM
takes K-major operands only): the cotangent within its quantizing pass, the
float8 residual in a pass of its own.

With scaling="block" the same layers quantize with block scales (the ops' 1x128
x 128x128 scales; see "block scaling" below).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_overlap import _sharding, api, remat
from jax_overlap.integration import autodiff
from jax_overlap.layers.dot_general import Layer, check_column_parallel, check_dim, check_row_parallel
from jax_overlap.ops import OPS, fp8_cast
from jax_overlap.quantization import formats, numerics, scaling
from jax_overlap.quantization.scaling import BLOCK, BLOCK_SIZE, Scales
from jax_overlap.runtime import workspace


# What the layers quantize: the cast's inputs.
_INPUT_DTYPES = fp8_cast.INPUT_DTYPES
FAMILIES = ("ocp", "fnuz")
# The layers' cast_algorithm: "kernels", the project's one-pass cast kernel where it takes the call
# (ops/fp8_cast.py), or "xla", XLA's cast of the same values, which XLA can fuse into the operation producing the
# operand (a norm, an activation, the kernel's conversion from float32), where a kernel, a custom call, reads the
# operand back from memory. "auto" is "kernels": faster on an operand read from memory (bench_fp8_delayed.py); where
# XLA's fusions produce the operands, as in MaxText, "xla" is (jax_overlap/maxtext/hook.py).
CAST_ALGORITHMS = ("auto", "kernels", "xla")


@dataclasses.dataclass(frozen=True)
class _Fp8Call:
  """One fp8 layer call, besides its operands (static: the custom VJP's nondiff argument)."""

  axis_name: str | tuple | None
  algorithm: str
  axis: int | None  # ag: x's gather dim; rs: the output's scatter dim (None: the plan's)
  out_sharding: object
  e4m3: str  # x's and the kernel's format
  e5m2: str  # the cotangent's format
  x_dtype: str
  w_dtype: str
  scaling: scaling.Scaling = scaling.TENSOR  # TENSOR: one scale per operand; BLOCK: 1x128 blocks, 128x128 tiles
  fast_accumulation: bool = False  # the forward GEMM's (api.ag_matmul's); the gradients' GEMMs promote to float32
  cast_algorithm: str = "auto"  # the float8 casts' (_cast_algorithm); CAST_ALGORITHMS

  @property
  def out_dtype(self) -> str:
    return np.dtype(jnp.promote_types(self.x_dtype, self.w_dtype)).name


class Fp8Layer(Layer):
  """What the float8 layers share: their fields checked at construction (Layer's, and family and scaling)."""

  ALGORITHMS = tuple(a for a in api.ALGORITHMS if formats.takes(a, "float8_e4m3fn") or a in ("auto", "xla"))

  def __post_init__(self):
    super().__post_init__()
    name = type(self).__name__
    if self.family is not None and self.family not in FAMILIES:
      raise ValueError(f"jax_overlap.{name}: family must be None (the GPU's), 'ocp' or 'fnuz', got {self.family!r}")
    if self.scaling not in scaling.MODES:
      raise ValueError(f"jax_overlap.{name}: scaling must be one of {tuple(scaling.MODES)}, got {self.scaling!r}")
    check_fast_accumulation(name, self.fast_accumulation, scaling.MODES[self.scaling])
    check_cast_algorithm(name, self.cast_algorithm)

  def forward_fast_accumulation(self) -> bool:
    """Whether the forward GEMM accumulates fast: fast_accumulation, None meaning so for tensor scales."""
    return not scaling.MODES[self.scaling].blocks if self.fast_accumulation is None else self.fast_accumulation

  def _call(self, lhs, rhs, **fields) -> _Fp8Call:
    """This call's _Fp8Call, after the checks of its inputs' dtypes."""
    layer = type(self).__name__
    for name, v in (("x", lhs), ("kernel", rhs)):
      if formats.name(v.dtype) not in _INPUT_DTYPES:
        raise TypeError(f"jax_overlap.{layer}: {name} must have dtype {', '.join(_INPUT_DTYPES)} (the layer "
                        f"quantizes it), got {v.dtype}")
    family = self.family
    if family is None:
      family = "fnuz" if any(formats.fp8_family_of(arch) == "fnuz" for _, arch in workspace.local_gpus()) else "ocp"
    e4m3, e5m2 = formats.fp8_formats(family)
    return _Fp8Call(axis_name=self.axis_name, algorithm=self.algorithm, e4m3=e4m3, e5m2=e5m2,
                    x_dtype=formats.name(lhs.dtype), w_dtype=formats.name(rhs.dtype),
                    scaling=scaling.MODES[self.scaling], fast_accumulation=self.forward_fast_accumulation(),
                    cast_algorithm=self.cast_algorithm, **fields)


def check_fast_accumulation(layer: str, fast_accumulation, mode: scaling.Scaling) -> None:
  """A layer's fast_accumulation field: None or a bool, not True with block scales (ValueError, TypeError)."""
  if fast_accumulation is not None and not isinstance(fast_accumulation, bool):
    raise TypeError(f"jax_overlap.{layer}: fast_accumulation must be None, True or False, got {fast_accumulation!r}")
  if fast_accumulation and mode.blocks:
    raise ValueError(f"jax_overlap.{layer}: fast_accumulation=True takes scaling='tensor'; block scales apply per "
                     f"128 elements of K, where the GEMM promotes its sums to float32 anyway")


def check_cast_algorithm(layer: str, cast_algorithm) -> None:
  """A layer's cast_algorithm field: one of CAST_ALGORITHMS (ValueError)."""
  if cast_algorithm not in CAST_ALGORITHMS:
    raise ValueError(f"jax_overlap.{layer}: cast_algorithm must be one of {CAST_ALGORITHMS}, got {cast_algorithm!r}")


def _axes(call: _Fp8Call) -> tuple:
  return tuple(call.axis_name) if isinstance(call.axis_name, (tuple, list)) else (call.axis_name,)


def _varying_in(call: _Fp8Call, x, w) -> tuple:
  """x and w made varying over the group (autodiff.varying: JAX's transpose of that cast sums dW over replicas)."""
  if call.axis_name is None:
    return x, w
  return autodiff.varying(_axes(call), x, w)


def _negative(axis, ndim: int):
  """An int dim index as a negative one (anything else as it is: the op names what is wrong with it)."""
  if isinstance(axis, (int, np.integer)) and not isinstance(axis, bool) and axis >= 0:
    return int(axis) - ndim
  return axis


def _layouts(call: _Fp8Call, x, w) -> tuple:
  """What dx and dW are laid out like on global arrays (autodiff.layout). x itself is not kept: on an Explicit
  mesh its type says it, and on an Auto mesh the dual op's plan scatters dx onto x's sharded dim (keeping x
  alive for shard_alike would undo the float8 residual)."""
  x_layout = autodiff.layout(x, call.axis_name)
  return (x_layout if isinstance(x_layout, autodiff.Layout) else None), autodiff.layout(w, call.axis_name)


def _dual_layout(x_layout) -> dict:
  """The dual op's out_sharding: x's type on an Explicit mesh, else the plan's."""
  return {"out_sharding": None if x_layout is None else x_layout.sharding}


def _custom_vjp(forward, backward):
  """layer(x, w, call) whose value is forward's first result, with the VJP forward / backward."""
  @functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
  def layer(x, w, call: _Fp8Call):
    return forward(x, w, call)[0]

  layer.defvjp(forward, backward)
  return layer


def _cast_algorithm(call: _Fp8Call) -> str:
  """How the layer casts to float8 where ops/fp8_cast.py casts: its kernel where it takes the call (the same values
  as XLA's cast), XLA's with algorithm="xla" or cast_algorithm="xla"."""
  return "xla" if "xla" in (call.algorithm, call.cast_algorithm) else "auto"


def _quantized(x, w, call: _Fp8Call, kmajor) -> tuple:
  """(x8, x_scale, w8, w_scale): x and the kernel quantized to e4m3, the kernel in the K-major layout kmajor(w)
  gives. Current scaling: the transpose and the cast are one pass over w. Block scaling (w 2-D): x per 1x128
  block, the kernel per 128x128 tile."""
  if call.scaling.blocks:
    return (*numerics.block_scaling(x, call.e4m3), *numerics.tile_scaling(kmajor(w), call.e4m3))
  x8, x_scale = fp8_cast.current_scaling(x, call.e4m3, algorithm=_cast_algorithm(call))
  w_scale = numerics.fp8_scale(jnp.max(jnp.abs(w)), call.e4m3)
  return x8, x_scale, numerics.quantize(kmajor(w), call.e4m3, w_scale), w_scale


def _cotangent(d, call: _Fp8Call) -> tuple:
  """(d quantized to e5m2, its scale): current scaling, or per 1x128 block of its last dim."""
  if call.scaling.blocks:
    return numerics.block_scaling(d, call.e5m2)
  return fp8_cast.current_scaling(d, call.e5m2, algorithm=_cast_algorithm(call))


def _dual_kernel(w, w_scale, call: _Fp8Call) -> tuple:
  """(the kernel quantized again in its own layout, whose last dim is the dual op's contraction, with the
  forward's scale; that scale as the dual op takes it): the same float8 values as the forward's K-major kernel.
  Block scaling: the forward's tiles, transposed."""
  if call.scaling.blocks:
    return numerics.tile_scaling(w, call.e4m3, w_scale.T)[0], w_scale.T
  return fp8_cast.cast(w, w_scale, call.e4m3, algorithm=_cast_algorithm(call)), w_scale


def _lead_last(v, lead: int):
  """v [*l, *f] as [prod(f), *l]: its first `lead` dims (a weight gradient's contraction) last, kept as dims of their
  own for the op to contract (rows of several dims, sharded on a minor one, have no merged layout without moving
  them)."""
  v = jnp.transpose(v, (*range(lead, v.ndim), *range(lead)))
  return _sharding.reshape(v, (-1, *v.shape[v.ndim - lead:]))


def _weight_grad(at8, a_scale, bt8, b_scale, w, w_layout, call: _Fp8Call):
  """dW = a^T @ b as one float8 GEMM of the op's group of one (the vendor's fp8 GEMM where it takes the call:
  algorithm "auto", which falls back to XLA's dot; "xla" stays XLA's): at8 [Ka, *l] and bt8 [Nb, *l], both with
  the contraction last, the layout Hopper's fp8 GEMM takes (_lead_last, done in the quantizing passes where there
  is one). The result in w's dtype, shape and layout."""
  algorithm = "xla" if call.algorithm == "xla" else "auto"
  if call.axis_name is None:
    dw = api.matmul_rs(at8, bt8, x_scale=a_scale, w_scale=b_scale, out_dtype=call.w_dtype, w_kmajor=True,
                       algorithm=algorithm)
  else:  # the local product on this rank's operands
    at8, bt8, a_scale, b_scale = autodiff.varying(_axes(call), at8, bt8, a_scale, b_scale)
    dw = OPS["matmul_rs"].rules.bind(at8, bt8, None, Scales(a_scale, b_scale, call.scaling), axis_name=None,
                                     axis_size=1, algorithm=algorithm, w_kmajor=True, out_dtype=call.w_dtype)
  return autodiff.like(_sharding.reshape(dw, w.shape), w_layout)


@dataclasses.dataclass(frozen=True)
class Fp8AgDotGeneral(Fp8Layer):
  """AgDotGeneral in float8, for training: kernel [K, *n], x [..., K], both bf16/f16/f32.

  Each call quantizes x (the amax of the local shard inside shard_map, of the whole array on
  global arrays) and the kernel to e4m3, the kernel into [*n, K] (K-major), and runs
  jax_overlap.ag_matmul on them; the result is in the inputs' dtype. The backward pass
  quantizes dy to e5m2: dx = matmul_rs(dy, kernel) in float8 (the dual op), dW = gathered_x^T @ dy
  as one float8 GEMM, with the gathered shards' scales folded into dy's quantization.
  Residuals: the gathered float8 x and its per-shard scales (jax_overlap.remat names them).

  axis_name, gather_axis: as AgDotGeneral's. algorithm: "auto", "pipelined" or "xla", as
  jax_overlap.ag_matmul takes it for float8 operands ("fused" is 16-bit only); dW's GEMM, which has
  no communication, is the vendor's fp8 GEMM where it takes the call and XLA's dot otherwise, and
  XLA's with "xla". family: the float8 formats, "ocp" (float8_e4m3fn and float8_e5m2) or "fnuz"
  (float8_e4m3fnuz and float8_e5m2fnuz); None: fnuz on gfx942, OCP elsewhere. scaling: "tensor" (one
  scale per operand: the local shard's amax) or "block" (a scale per 1x128 block of x and of the
  cotangent, per 128x128 tile of the kernel; K and N multiples of 128, see "block scaling" below).
  fast_accumulation: whether the forward GEMM takes the vendor's fast fp8 accumulation
  (jax_overlap.ag_matmul's fast_accumulation: TransformerEngine's forward numerics); None (default):
  so with tensor scales, not with block scales, which take none. The gradients' GEMMs never do.
  cast_algorithm: how x, the cotangent and the data gradient's kernel are cast to float8 (tensor scales):
  "kernels", the project's one-pass cast kernel where it takes the call; "xla", XLA's cast of the same
  values, which XLA can fuse into the operation that produces the operand, where the kernel reads it back
  from memory; "auto" (default), the kernels (faster on an operand read from memory; in a model whose
  operands come out of XLA's fusions, as in MaxText, "xla" can be faster).

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

  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
    del precision
    check_column_parallel("Fp8AgDotGeneral", lhs, rhs, dimension_numbers, preferred_element_type)
    call = self._call(lhs, rhs, axis=_negative(self.gather_axis, lhs.ndim), out_sharding=out_sharding)
    x, w = _varying_in(call, lhs, rhs)
    if not call.scaling.blocks:
      return _fp8_ag(x, w, call)
    # Block scales take a 2-D kernel: [K, *n] as [K, N], and back.
    w2 = _sharding.reshape(w, (w.shape[0], -1))
    BLOCK.check_dims("Fp8AgDotGeneral (scaling='block', each rank's kernel)", *w2.shape)
    y = _fp8_ag(x, w2, call)
    return _sharding.reshape(y, (*y.shape[:-1], *w.shape[1:]))


def _ag_forward(x, w, call: _Fp8Call):
  x8, x_scale, w8, w_scale = _quantized(x, w, call, lambda w: jnp.moveaxis(w, 0, -1))  # [K, *n] -> [*n, K]
  y, gathered, scales = api.ag_matmul(x8, w8, x_scale=x_scale, w_scale=w_scale, out_dtype=call.out_dtype,
                                      fast_accumulation=call.fast_accumulation, w_kmajor=True,
                                      axis_name=call.axis_name, algorithm=call.algorithm, return_gathered=True,
                                      gather_axis=call.axis, out_sharding=call.out_sharding)
  return y, (gathered, scales, w, remat.tag(w_scale, remat.AG_W_SCALE), _layouts(call, x, w))


def _fp8_ag_bwd(call: _Fp8Call, residuals, dy):
  gathered, scales, w, w_scale, (x_layout, w_layout) = residuals
  dy8, dy_scale = _cotangent(dy, call)
  # dx = RS(dy @ W^T): the kernel quantized again in its own layout [K, *n], whose contraction (n) is last; on an
  # Explicit mesh laid out as x's type says, else scattered onto x's gathered dim
  w8, dual_scale = _dual_kernel(w, w_scale, call)
  scatter = None if x_layout is not None else call.axis
  dx = api.matmul_rs(dy8, w8, x_scale=dy_scale, w_scale=dual_scale, out_dtype=call.x_dtype, w_kmajor=True,
                     axis_name=call.axis_name, algorithm=call.algorithm, scatter_axis=scatter,
                     **_dual_layout(x_layout))
  if call.scaling.blocks:
    return autodiff.like(dx, x_layout), _block_weight_grad(gathered, scales, dy, w, w_layout, call, "Fp8AgDotGeneral")
  # dW = gathered^T @ dy over rows whose shards carry scales of their own: dy's rows times their shard's scale,
  # quantized with one scale (transposed in that pass). With one shard that is dy8 itself, transposed, and the
  # shard's scale stays the gathered x's (the product of the two scales may underflow float32 where dW does not).
  lead = functools.partial(_lead_last, lead=gathered.ndim - 1)
  if scales.shape[0] == 1:
    dyt8, dyt_scale, gathered_scale = lead(dy8), dy_scale, scales[0]
  else:
    rows = numerics.rows_times(dy, scales, gathered.ndim + call.axis)
    (dyt8, dyt_scale), gathered_scale = numerics.current_scaling(rows, call.e5m2, lead), jnp.float32(1)
  dw = _weight_grad(lead(gathered), gathered_scale, dyt8, dyt_scale, w, w_layout, call)
  return autodiff.like(dx, x_layout), dw


_fp8_ag = _custom_vjp(_ag_forward, _fp8_ag_bwd)


@dataclasses.dataclass(frozen=True)
class Fp8RsDotGeneral(Fp8Layer):
  """RsDotGeneral in float8, for training: kernel [*k, N], x [..., *k], both bf16/f16/f32.

  Each call quantizes x (the amax of the local shard inside shard_map, of the whole array on
  global arrays) and the kernel to e4m3, the kernel into [N, *k] (K-major), and runs
  jax_overlap.matmul_rs on them (each rank's partial scaled by its own scales); the result is in
  the inputs' dtype. The backward pass quantizes dz to e5m2: (dx, AG(dz)) = ag_matmul(dz, kernel)
  in float8 (the dual op), dW = x^T @ AG(dz) as one float8 GEMM (Fp8AgDotGeneral's), the gathered shards'
  scales folded into AG(dz) by exact power-of-two shifts. Residuals: the quantized x and its
  scale (jax_overlap.remat names them).

  axis_name: as RsDotGeneral's. algorithm, family, scaling, fast_accumulation, cast_algorithm: as
  Fp8AgDotGeneral's.
  scatter_axis: as RsDotGeneral's, but not the columns (-1) inside shard_map, where the dual op would
  gather the contraction.

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
    if self.axis_name is not None and self.scatter_axis == -1:
      raise ValueError(f"jax_overlap.Fp8RsDotGeneral: scatter_axis={self.scatter_axis} (the output columns) is not "
                       f"supported inside shard_map (its data gradient would gather the contraction); use "
                       f"RsDotGeneral, or scatter another dim")

  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
    del precision
    contract = check_row_parallel("Fp8RsDotGeneral", lhs, rhs, dimension_numbers, preferred_element_type)
    scatter = _negative(self.scatter_axis, lhs.ndim - contract + 1)
    if self.axis_name is not None and scatter == -1:
      raise ValueError(f"jax_overlap.Fp8RsDotGeneral: scatter_axis={self.scatter_axis} (the output columns) is not "
                       f"supported inside shard_map (its data gradient would gather the contraction); use "
                       f"RsDotGeneral, or scatter another dim")
    call = self._call(lhs, rhs, axis=scatter, out_sharding=out_sharding)
    x, w = _varying_in(call, lhs, rhs)
    if not call.scaling.blocks:
      return _fp8_rs(x, w, call)
    # Block scales take a 2-D kernel: [*k, N] as [K, N], x [..., *k] as [..., K].
    w2 = _sharding.reshape(w, (-1, w.shape[-1]))
    BLOCK.check_dims("Fp8RsDotGeneral (scaling='block', each rank's kernel)", *w2.shape)
    return _fp8_rs(_sharding.reshape(x, (*x.shape[:x.ndim - contract], -1)), w2, call)


def _rs_forward(x, w, call: _Fp8Call):
  x8, x_scale, w8, w_scale = _quantized(x, w, call, lambda w: jnp.moveaxis(w, -1, 0))  # [*k, N] -> [N, *k]
  z = api.matmul_rs(x8, w8, x_scale=x_scale, w_scale=w_scale, out_dtype=call.out_dtype,
                    fast_accumulation=call.fast_accumulation, w_kmajor=True, axis_name=call.axis_name,
                    algorithm=call.algorithm, scatter_axis=call.axis, out_sharding=call.out_sharding)
  residuals = (remat.tag(x8, remat.RS_X_FP8), remat.tag(x_scale, remat.RS_X_SCALE), w,
               remat.tag(w_scale, remat.RS_W_SCALE), _layouts(call, x, w))
  return z, residuals


def _fp8_rs_bwd(call: _Fp8Call, residuals, dz):
  x8, x_scale, w, w_scale, (x_layout, w_layout) = residuals
  dz8, dz_scale = _cotangent(dz, call)
  # (dx, AG(dz)) = ag_matmul(dz, W^T): the kernel quantized again in its own layout [*k, N], contraction (N) last
  w8, dual_scale = _dual_kernel(w, w_scale, call)
  gather = -2 if call.axis in (None, -1) else call.axis
  dx, dz_gathered, dz_scales = api.ag_matmul(
      dz8, w8, x_scale=dz_scale, w_scale=dual_scale, out_dtype=call.x_dtype, w_kmajor=True,
      axis_name=call.axis_name, algorithm=call.algorithm, return_gathered=True, gather_axis=gather,
      **_dual_layout(x_layout))
  if call.scaling.blocks:
    # the gathered cotangent's value from its float8 blocks (exact), blocked along the rows again
    dw = _block_weight_grad(x8, x_scale, numerics.dequantized(dz_gathered, dz_scales), w, w_layout, call,
                            "Fp8RsDotGeneral")
    return autodiff.like(dx, x_layout), dw
  # dW = x^T @ AG(dz): the gathered shards' scales folded into AG(dz), one scale for all of it (transposed in that
  # pass)
  lead = functools.partial(_lead_last, lead=dz_gathered.ndim - 1)
  dzt8, dzt_scale = numerics.rescaled_rows(dz_gathered, dz_scales, dz_gathered.ndim + gather, lead)
  dw = _weight_grad(lead(x8), x_scale, dzt8, dzt_scale, w, w_layout, call)
  return autodiff.like(dx, x_layout), dw


_fp8_rs = _custom_vjp(_rs_forward, _fp8_rs_bwd)


# --- block scaling ----------------------------------------------------------------------
# The DeepSeek-V3 recipe on the ops' block scales: x and the cotangent quantized per 1x128 block of their last dim
# (the contraction of the forward and of the dual op), the kernel per 128x128 tile, each block's scale a power of two
# from its amax (numerics.block_scaling, tile_scaling). The dual op reads the kernel in its own layout with the same
# tiles' scales (transposed): the same float8 values. The weight gradient contracts the rows, so both of its
# operands are quantized again with their blocks along the rows: x from its float8 value (dequantized: exact), the
# cotangent from its 16-bit value; then one block-scaled GEMM of the group of one. Shards that are whole blocks
# (K and N multiples of 128 on each rank) quantize as the whole array does, so the result does not depend on the
# sharding but through the ops' reductions.

def _rows_last(a, layer: str):
  """a [..., c] as [c, R], R the product of its leading dims (the weight gradient's contraction), which block
  scaling needs whole 128-row blocks of."""
  rows = math.prod(a.shape[:-1])
  if rows % BLOCK_SIZE:
    raise ValueError(f"jax_overlap.{layer}: the weight gradient of scaling='block' contracts the rows (the product "
                     f"of x's leading dims{', gathered' if layer == 'Fp8AgDotGeneral' else ''}), which must be a "
                     f"multiple of {BLOCK_SIZE}, got {rows}")
  return _sharding.reshape(a, (rows, a.shape[-1])).T


def _block_weight_grad(x, x_scale, dy, w, w_layout, call: _Fp8Call, layer: str):
  """dW = x^T @ dy from x [..., R, K] in float8 with its 1x128 scales and the 16-bit cotangent dy [..., R, N]: x
  blocked along the rows (e4m3), dy tiled along them (e5m2)."""
  at8, a_scale = numerics.block_scaling(_rows_last(numerics.dequantized(x, x_scale), layer), call.e4m3)
  bt8, b_scale = numerics.tile_scaling(_rows_last(dy, layer), call.e5m2)
  return _weight_grad(at8, a_scale, bt8, b_scale, w, w_layout, call)
