"""dot_general-compatible callables, so layer libraries run their linear layers on jax_overlap.

Pass one as a layer's dot_general (or the class as dot_general_cls):

  flax.linen   Dense / DenseGeneral(dot_general=...), MultiHeadDotProductAttention(qkv_dot_general=AgDotGeneral(),
               out_dot_general=RsDotGeneral())
  flax.nnx     Linear / LinearGeneral(dot_general=...), MultiHeadAttention(qkv_dot_general=..., out_dot_general=...)

AgDotGeneral is the column-parallel layer (ag_matmul): it contracts x's last dim
with the kernel's first, kernels [K, *n] ([embed, heads, head_dim] for QKV,
[embed, 2, ffn] for a gated MLP). RsDotGeneral is the row-parallel layer
(matmul_rs): it contracts x's trailing dims with the kernel's leading ones,
kernels [*k, N] ([heads, head_dim, embed] for the attention output, [ffn, embed]).
The layer adds its bias after the call (not fused). Inputs take any leading dims.

With axis_name=None (global arrays under jit) the result is x @ kernel, and the
shardings decide the collectives; inside shard_map (axis_name given) the result
is the op's: rows gathered (AgDotGeneral) or reduce-scattered (RsDotGeneral).
`precision` is accepted and not used (the products accumulate in float32);
preferred_element_type may be None or the inputs' dtype; out_sharding is passed on.

Fp8AgDotGeneral and Fp8RsDotGeneral are the same layers in float8, for
training: they take bfloat16/float16/float32 inputs and kernels and quantize
both on every call (current scaling: the amax of the local shard, a
power-of-two scale, a cast to e4m3), the kernel straight into the K-major
layout Hopper's fp8 GEMM takes, in the same pass. Casts with no transpose in
them run on fp8_cast.py's primitive (the project's cast kernel where it takes
the call, XLA's cast of the same values otherwise). Their custom VJP quantizes
the cotangent to e5m2 the same way, so that the data gradient (the dual op)
and the weight gradient run in float8 too, and keeps float8 residuals in
place of the activation: Fp8AgDotGeneral the gathered x (half the bytes of the
bf16 gathered x the 16-bit layer keeps) with its per-shard scales,
Fp8RsDotGeneral its quantized x. Where the weight gradient contracts rows that
carry per-shard scales (the gathered x; the gathered cotangent of matmul_rs),
the scales fold into the e5m2 operand's quantization, so it stays one GEMM of
one scale per operand: exact up to that quantization's rounding (power-of-two
scales shift values exactly, numerics.py). That GEMM contracts the rows, the
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

from jax_overlap import api, autodiff, dtypes, fp8_cast, numerics, ops, primitives, remat


def _dims(dimension_numbers):
  (lhs_c, rhs_c), (lhs_b, rhs_b) = dimension_numbers
  return tuple(lhs_c), tuple(rhs_c), tuple(lhs_b), tuple(rhs_b)


def _check(op: str, lhs, rhs, dimension_numbers, preferred_element_type, contract: int, expected: str) -> None:
  if not hasattr(lhs, "ndim") or not hasattr(rhs, "ndim"):
    return  # the op names the argument that is not an array
  lhs_c, rhs_c, lhs_b, rhs_b = _dims(dimension_numbers)
  lhs_c = tuple(d % lhs.ndim for d in lhs_c)
  rhs_c = tuple(d % rhs.ndim for d in rhs_c)
  want_lhs = tuple(range(lhs.ndim - contract, lhs.ndim))
  if lhs_b or rhs_b or lhs_c != want_lhs or rhs_c != tuple(range(contract)):
    want = ((want_lhs, tuple(range(contract))), ((), ()))
    raise ValueError(f"jax_overlap.{op}: dimension_numbers must contract {expected} with no batch dims, i.e. "
                     f"{want} for x of shape {lhs.shape} and kernel of shape {rhs.shape}, got {dimension_numbers}")
  if preferred_element_type is not None and np.dtype(preferred_element_type) != np.dtype(lhs.dtype):
    raise ValueError(f"jax_overlap.{op}: preferred_element_type must be None or the inputs' dtype "
                     f"{np.dtype(lhs.dtype).name}, got {np.dtype(preferred_element_type).name}")


def _check_row_parallel(layer: str, lhs, rhs, dimension_numbers, preferred_element_type) -> int:
  """_check of a row-parallel layer (kernel [*k, N]): returns how many dims it contracts."""
  if getattr(rhs, "ndim", 0) < 2:
    raise ValueError(f"jax_overlap.{layer}: the kernel must have rank >= 2 ([*k, N]), got shape "
                     f"{getattr(rhs, 'shape', rhs)}")
  contract = rhs.ndim - 1
  _check(layer, lhs, rhs, dimension_numbers, preferred_element_type, contract,
         f"x's last {contract} dims with the kernel's first {contract}")
  return contract


@dataclasses.dataclass(frozen=True)
class AgDotGeneral:
  """lax.dot_general's signature on ag_matmul: kernel [K, *n], x [..., K].

  algorithm: "auto", "pipelined", "fused" or "xla", as jax_overlap.ag_matmul takes it.
  """

  axis_name: str | tuple | None = None
  algorithm: str = "auto"
  gather_axis: int = -2

  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
    del precision
    _check("AgDotGeneral", lhs, rhs, dimension_numbers, preferred_element_type, 1,
           "x's last dim with the kernel's first")
    return api.ag_matmul(lhs, rhs, axis_name=self.axis_name, algorithm=self.algorithm,
                         gather_axis=self.gather_axis, out_sharding=out_sharding)


@dataclasses.dataclass(frozen=True)
class RsDotGeneral:
  """lax.dot_general's signature on matmul_rs: kernel [*k, N], x [..., *k].

  algorithm: "auto", "pipelined", "fused" or "xla", as jax_overlap.matmul_rs takes it.
  """

  axis_name: str | tuple | None = None
  algorithm: str = "auto"
  scatter_axis: int | None = None

  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
    del precision
    _check_row_parallel("RsDotGeneral", lhs, rhs, dimension_numbers, preferred_element_type)
    return api.matmul_rs(lhs, rhs, axis_name=self.axis_name, algorithm=self.algorithm,
                         scatter_axis=self.scatter_axis, out_sharding=out_sharding)


# --- float8 layers ----------------------------------------------------------------------

_INPUT_DTYPES = ("bfloat16", "float16", "float32")


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
  scaling: str = "tensor"  # "tensor": one scale per operand; "block": 1x128 blocks, 128x128 tiles of the kernel

  @property
  def out_dtype(self) -> str:
    return np.dtype(jnp.promote_types(self.x_dtype, self.w_dtype)).name


SCALINGS = ("tensor", "block")


def _fp8_call(layer: str, lhs, rhs, family, **fields) -> _Fp8Call:
  if fields.get("scaling") not in SCALINGS:
    raise ValueError(f"jax_overlap.{layer}: scaling must be 'tensor' or 'block', got {fields.get('scaling')!r}")
  for name, v in (("x", lhs), ("kernel", rhs)):
    if dtypes.name(v.dtype) not in _INPUT_DTYPES:
      raise TypeError(f"jax_overlap.{layer}: {name} must have dtype {', '.join(_INPUT_DTYPES)} (the layer "
                      f"quantizes it), got {v.dtype}")
  if family is None:
    family = "fnuz" if any(dtypes.fp8_family_of(arch) == "fnuz" for _, arch in primitives.local_gpus()) else "ocp"
  elif family not in ("ocp", "fnuz"):
    raise ValueError(f"jax_overlap.{layer}: family must be None, 'ocp' or 'fnuz', got {family!r}")
  e4m3, e5m2 = dtypes.fp8_formats(family)
  return _Fp8Call(e4m3=e4m3, e5m2=e5m2, x_dtype=dtypes.name(lhs.dtype), w_dtype=dtypes.name(rhs.dtype), **fields)


def _axes(call: _Fp8Call) -> tuple:
  return tuple(call.axis_name) if isinstance(call.axis_name, (tuple, list)) else (call.axis_name,)


def _varying_in(call: _Fp8Call, x, w) -> tuple:
  """x and w made varying over the group (api._varying: JAX's transpose of that cast sums dW over replicas)."""
  if call.axis_name is None:
    return x, w
  return api._varying(_axes(call), x, w)


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
  """How the layer casts to float8 where no transpose comes with the cast: the project's kernel where it takes the
  call (fp8_cast.py; the same values as XLA's cast), XLA's with algorithm="xla"."""
  return "xla" if call.algorithm == "xla" else "auto"


def _quantized(x, w, call: _Fp8Call, kmajor) -> tuple:
  """(x8, x_scale, w8, w_scale): x and the kernel quantized to e4m3, the kernel in the K-major layout kmajor(w)
  gives. Current scaling: the transpose and the cast are one pass over w. Block scaling (w 2-D): x per 1x128
  block, the kernel per 128x128 tile."""
  if call.scaling == "block":
    return (*numerics.block_scaling(x, call.e4m3), *numerics.tile_scaling(kmajor(w), call.e4m3))
  x8, x_scale = fp8_cast.current_scaling(x, call.e4m3, algorithm=_cast_algorithm(call))
  w_scale = numerics.fp8_scale(jnp.max(jnp.abs(w)), call.e4m3)
  return x8, x_scale, numerics.quantize(kmajor(w), call.e4m3, w_scale), w_scale


def _cotangent(d, call: _Fp8Call) -> tuple:
  """(d quantized to e5m2, its scale): current scaling, or per 1x128 block of its last dim."""
  if call.scaling == "block":
    return numerics.block_scaling(d, call.e5m2)
  return fp8_cast.current_scaling(d, call.e5m2, algorithm=_cast_algorithm(call))


def _dual_kernel(w, w_scale, call: _Fp8Call) -> tuple:
  """(the kernel quantized again in its own layout, whose last dim is the dual op's contraction, with the
  forward's scale; that scale as the dual op takes it): the same float8 values as the forward's K-major kernel.
  Block scaling: the forward's tiles, transposed."""
  if call.scaling == "block":
    return numerics.tile_scaling(w, call.e4m3, w_scale.T)[0], w_scale.T
  return fp8_cast.cast(w, w_scale, call.e4m3, algorithm=_cast_algorithm(call)), w_scale


def _lead_last(v, lead: int):
  """v [*l, *f] as the matrix [prod(f), prod(l)]: its first `lead` dims (a weight gradient's contraction) last."""
  return v.reshape(math.prod(v.shape[:lead]), -1).T


def _weight_grad(at8, a_scale, bt8, b_scale, w, w_layout, call: _Fp8Call):
  """dW = a^T @ b as one float8 GEMM of the op's group of one (the vendor's fp8 GEMM where it takes the call:
  algorithm "auto", which falls back to XLA's dot; "xla" stays XLA's): at8 [Ka, L] and bt8 [Nb, L], both with
  the contraction last, the layout Hopper's fp8 GEMM takes (_lead_last, done in the quantizing passes where there
  is one). The result in w's dtype, shape and layout."""
  algorithm = "xla" if call.algorithm == "xla" else "auto"
  if call.axis_name is None:
    dw = api.matmul_rs(at8, bt8, x_scale=a_scale, w_scale=b_scale, out_dtype=call.w_dtype, w_kmajor=True,
                       algorithm=algorithm)
  else:  # the local product on this rank's operands
    at8, bt8, a_scale, b_scale = api._varying(_axes(call), at8, bt8, a_scale, b_scale)
    dw = ops.OPS["matmul_rs"].bind(at8, bt8, None, (a_scale, b_scale), axis_name=None, axis_size=1,
                                   algorithm=algorithm, w_kmajor=True, out_dtype=call.w_dtype)
  return autodiff.like(dw.reshape(w.shape), w_layout)


@dataclasses.dataclass(frozen=True)
class Fp8AgDotGeneral:
  """AgDotGeneral in float8, for training: kernel [K, *n], x [..., K], both bf16/f16/f32.

  Each call quantizes x (the amax of the local shard inside shard_map, of the whole array on
  global arrays) and the kernel to e4m3, the kernel into [*n, K] (K-major), and runs
  jax_overlap.ag_matmul on them; the result is in the inputs' dtype. The backward pass
  quantizes dy to e5m2: dx = matmul_rs(dy, kernel) in float8 (the dual op), dW = gathered_x^T @ dy
  as one float8 GEMM, with the gathered shards' scales folded into dy's quantization.
  Residuals: the gathered float8 x and its per-shard scales (jax_overlap.remat names them).

  algorithm: "auto", "pipelined" or "xla", as jax_overlap.ag_matmul takes it for float8
  operands ("fused" is 16-bit only); dW's GEMM, which has no communication, is the vendor's fp8
  GEMM where it takes the call and XLA's dot otherwise, and XLA's with "xla". family: the float8
  formats, "ocp" (float8_e4m3fn and float8_e5m2) or "fnuz" (float8_e4m3fnuz and float8_e5m2fnuz);
  None: fnuz on gfx942, OCP elsewhere. scaling: "tensor" (one scale per operand: the local shard's amax)
  or "block" (a scale per 1x128 block of x and of the cotangent, per 128x128 tile of the kernel; K and N
  multiples of 128, see "block scaling" below).
  """

  axis_name: str | tuple | None = None
  algorithm: str = "auto"
  gather_axis: int = -2
  family: str | None = None
  scaling: str = "tensor"

  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
    del precision
    _check("Fp8AgDotGeneral", lhs, rhs, dimension_numbers, preferred_element_type, 1,
           "x's last dim with the kernel's first")
    call = _fp8_call("Fp8AgDotGeneral", lhs, rhs, self.family, axis_name=self.axis_name, algorithm=self.algorithm,
                     axis=_negative(self.gather_axis, lhs.ndim), out_sharding=out_sharding, scaling=self.scaling)
    x, w = _varying_in(call, lhs, rhs)
    if call.scaling == "tensor":
      return _fp8_ag(x, w, call)
    # Block scales take a 2-D kernel: [K, *n] as [K, N], and back.
    w2 = w.reshape(w.shape[0], -1)
    _check_blocks("Fp8AgDotGeneral", *w2.shape)
    y = _fp8_ag(x, w2, call)
    return y.reshape(*y.shape[:-1], *w.shape[1:])


def _ag_forward(x, w, call: _Fp8Call):
  x8, x_scale, w8, w_scale = _quantized(x, w, call, lambda w: jnp.moveaxis(w, 0, -1))  # [K, *n] -> [*n, K]
  y, gathered, scales = api.ag_matmul(x8, w8, x_scale=x_scale, w_scale=w_scale, out_dtype=call.out_dtype,
                                      w_kmajor=True, axis_name=call.axis_name, algorithm=call.algorithm,
                                      return_gathered=True, gather_axis=call.axis, out_sharding=call.out_sharding)
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
  if call.scaling == "block":
    return autodiff.like(dx, x_layout), _block_weight_grad(gathered, scales, dy, w, w_layout, call, "Fp8AgDotGeneral")
  # dW = gathered^T @ dy over rows whose shards carry scales of their own: dy's rows times their shard's scale,
  # quantized with one scale (transposed in that pass). With one shard that is dy8 itself (power-of-two scales:
  # exactly), transposed.
  lead = functools.partial(_lead_last, lead=gathered.ndim - 1)
  if scales.shape[0] == 1:
    dyt8, dyt_scale = lead(dy8), dy_scale * scales[0]
  else:
    rows = numerics.rows_times(dy, scales, gathered.ndim + call.axis)
    dyt8, dyt_scale = numerics.current_scaling(rows, call.e5m2, lead)
  dw = _weight_grad(lead(gathered), jnp.float32(1), dyt8, dyt_scale, w, w_layout, call)
  return autodiff.like(dx, x_layout), dw


_fp8_ag = _custom_vjp(_ag_forward, _fp8_ag_bwd)


@dataclasses.dataclass(frozen=True)
class Fp8RsDotGeneral:
  """RsDotGeneral in float8, for training: kernel [*k, N], x [..., *k], both bf16/f16/f32.

  Each call quantizes x (the amax of the local shard inside shard_map, of the whole array on
  global arrays) and the kernel to e4m3, the kernel into [N, *k] (K-major), and runs
  jax_overlap.matmul_rs on them (each rank's partial scaled by its own scales); the result is in
  the inputs' dtype. The backward pass quantizes dz to e5m2: (dx, AG(dz)) = ag_matmul(dz, kernel)
  in float8 (the dual op), dW = x^T @ AG(dz) as one float8 GEMM (Fp8AgDotGeneral's), the gathered shards'
  scales folded into AG(dz) by exact power-of-two shifts. Residuals: the quantized x and its
  scale (jax_overlap.remat names them).

  algorithm, family, scaling: as Fp8AgDotGeneral's. scatter_axis: as RsDotGeneral's, but not the
  columns (-1) inside shard_map, where the dual op would gather the contraction.
  """

  axis_name: str | tuple | None = None
  algorithm: str = "auto"
  scatter_axis: int | None = None
  family: str | None = None
  scaling: str = "tensor"

  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
    del precision
    contract = _check_row_parallel("Fp8RsDotGeneral", lhs, rhs, dimension_numbers, preferred_element_type)
    scatter = _negative(self.scatter_axis, lhs.ndim - contract + 1)
    if self.axis_name is not None and scatter == -1:
      raise ValueError(f"jax_overlap.Fp8RsDotGeneral: scatter_axis={self.scatter_axis} (the output columns) is not "
                       f"supported inside shard_map (its data gradient would gather the contraction); use "
                       f"RsDotGeneral, or scatter another dim")
    call = _fp8_call("Fp8RsDotGeneral", lhs, rhs, self.family, axis_name=self.axis_name, algorithm=self.algorithm,
                     axis=scatter, out_sharding=out_sharding, scaling=self.scaling)
    x, w = _varying_in(call, lhs, rhs)
    if call.scaling == "tensor":
      return _fp8_rs(x, w, call)
    # Block scales take a 2-D kernel: [*k, N] as [K, N], x [..., *k] as [..., K].
    w2 = w.reshape(-1, w.shape[-1])
    _check_blocks("Fp8RsDotGeneral", *w2.shape)
    return _fp8_rs(x.reshape(*x.shape[:x.ndim - contract], -1), w2, call)


def _rs_forward(x, w, call: _Fp8Call):
  x8, x_scale, w8, w_scale = _quantized(x, w, call, lambda w: jnp.moveaxis(w, -1, 0))  # [*k, N] -> [N, *k]
  z = api.matmul_rs(x8, w8, x_scale=x_scale, w_scale=w_scale, out_dtype=call.out_dtype, w_kmajor=True,
                    axis_name=call.axis_name, algorithm=call.algorithm, scatter_axis=call.axis,
                    out_sharding=call.out_sharding)
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
  if call.scaling == "block":
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

def _check_blocks(layer: str, k: int, n: int) -> None:
  if k % numerics.BLOCK or n % numerics.BLOCK:
    raise ValueError(f"jax_overlap.{layer}: scaling='block' takes a kernel whose contraction K and output N are "
                     f"multiples of {numerics.BLOCK} (on each rank inside shard_map), got K={k}, N={n}")


def _rows_last(a, layer: str):
  """a [..., c] as [c, R], R the product of its leading dims (the weight gradient's contraction), which block
  scaling needs whole 128-row blocks of."""
  rows = math.prod(a.shape[:-1])
  if rows % numerics.BLOCK:
    raise ValueError(f"jax_overlap.{layer}: the weight gradient of scaling='block' contracts the rows (the product "
                     f"of x's leading dims{', gathered' if layer == 'Fp8AgDotGeneral' else ''}), which must be a "
                     f"multiple of {numerics.BLOCK}, got {rows}")
  return a.reshape(rows, a.shape[-1]).T


def _block_weight_grad(x, x_scale, dy, w, w_layout, call: _Fp8Call, layer: str):
  """dW = x^T @ dy from x [..., R, K] in float8 with its 1x128 scales and the 16-bit cotangent dy [..., R, N]: x
  blocked along the rows (e4m3), dy tiled along them (e5m2)."""
  at8, a_scale = numerics.block_scaling(_rows_last(numerics.dequantized(x, x_scale), layer), call.e4m3)
  bt8, b_scale = numerics.tile_scaling(_rows_last(dy, layer), call.e5m2)
  return _weight_grad(at8, a_scale, bt8, b_scale, w, w_layout, call)
