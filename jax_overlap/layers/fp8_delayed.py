"""Delayed-scaling float8 layers in Flax's convention: flax.linen.Fp8DirectDotGeneralOp on the ops.

Fp8DelayedAgDotGeneral (column-parallel, ag_matmul) and Fp8DelayedRsDotGeneral
(row-parallel, matmul_rs) are linen modules with the variables of Flax's fp8
dot (Fp8DotGeneralBase's setup: input, kernel and output-gradient scales and
amax histories in the '_overwrite_with_gradient' collection, the same names,
shapes and initial values) and its update rule (fp8_ops.update_fp8_meta: the
step's scale from the history's largest amax and the previous scale, then the
step's amax rolled into the history), whose new values come back as those
variables' gradients, as Flax's do: a training loop that overwrites them with
their gradients (MaxText's, Flax's examples) runs them unchanged, and a state
or checkpoint of Flax's op carries over.

What differs from Flax's op is where the arithmetic runs: a step's scales come
from ops/fp8_scales.py's step_scales (one kernel for x's and the kernel's, with
the zeros their amaxes start from), x and the kernel are cast to e4m3 with them
on ops/fp8_cast.py's cast_with_amax, which gives the amax the history records
from the same pass over the operand (the kernel's cast is into the K-major
layout the fp8 GEMM takes), and the GEMMs
are the ops' in float8: the forward ag_matmul / matmul_rs, the data gradient
the dual op on the cotangent cast to e5m2, the weight gradient one float8
GEMM (layers/fp8.py's). Flax divides by
the scale in the compute dtype and dequantizes the product in it; here x is
multiplied by the float32 reciprocal (the cast kernel's form) and the scales
apply in float32 inside the GEMM, so values differ from Flax's by float8
rounding where the two quotients round apart, not in the state's rule.

The scale a step uses depends only on earlier steps, so values beyond it
saturate (Flax clips alike). Amaxes are of the whole operand: on global arrays
XLA reduces over the shards; inside shard_map the layer takes the max over the
axes x varies over (the group at least), so every rank records the same
history. Formats: e4m3_dtype / e5m2_dtype, Flax's fields, either OCP
(float8_e4m3fn + float8_e5m2, Flax's default: sm_89+, gfx950) or fnuz
(float8_e4m3fnuz + float8_e5m2fnuz: gfx942); a format the GPU cannot run takes
the XLA path under "auto", as the other fp8 layers' do.

This module imports flax (the layers are flax.linen modules); `import jax_overlap` does not import it until a
name of it is asked for.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops
from jax import lax

from jax_overlap import _compat, api, remat
from jax_overlap.integration import autodiff
from jax_overlap.layers import fp8
from jax_overlap.layers.dot_general import check_column_parallel, check_dim, check_fields, check_row_parallel
from jax_overlap.ops import fp8_cast, fp8_scales
from jax_overlap.quantization import formats


# --- the state: Flax's update rule ----------------------------------------------------------------------------

def _float32(v):
  """A meta variable's value in float32 (Flax's fp8 meta dtype, fm32, converted as fp8_ops does)."""
  return lax.convert_element_type(v, jnp.float32) if v.dtype == fp8_ops.fm32 else v


def _scalar(scale):
  """A scale variable ((1,)-shaped, as Flax keeps it) as the float32 scalar the ops take."""
  return jnp.reshape(_float32(scale), ()).astype(jnp.float32)


def step_scales(metas, dtypes, call: fp8._Fp8Call) -> tuple[tuple, tuple]:
  """(the scales a step casts with, the zeros their casts' amaxes start from) for (scale, history) pairs `metas`
  and float8 formats `dtypes`: fp8_ops.update_fp8_meta's new scales, which depend on the history and the previous
  scale only, so they are known before the step's amaxes (ops/fp8_scales.py: one kernel for all of them)."""
  return fp8_scales.step_scales([_scalar(s) for s, _ in metas], [_float32(h) for _, h in metas], dtypes,
                                algorithm=fp8._cast_algorithm(call))


def recorded(amax, step, scale, history) -> tuple:
  """(scale, history) variables after a step that cast with scale `step` an operand whose max |value| is `amax`:
  fp8_ops.update_fp8_meta's new values (the new scale is the step's; the history rolled back one place, the amax
  first), in the variables' dtypes and shapes. The history as one select of the rolled history, which XLA fuses
  into one kernel (Flax's roll and then update in place take two)."""
  fmax32 = scale.dtype == fp8_ops.fm32 and history.dtype == fp8_ops.fm32
  h = lax.convert_element_type(history, jnp.float32) if fmax32 else history
  first = lax.broadcasted_iota(jnp.int32, h.shape, 0) == 0
  new_history = jnp.where(first, amax.astype(h.dtype), jnp.roll(h, -1, axis=0))
  new_scale = jnp.reshape(step, jnp.shape(scale)).astype(jnp.float32)
  if fmax32:
    return lax.convert_element_type(new_scale, fp8_ops.fp32_max_grad), lax.convert_element_type(
        new_history, fp8_ops.fp32_max_grad)
  return new_scale, new_history


def _whole_amax(amax, call: fp8._Fp8Call):
  """The amax of the whole operand inside shard_map: the max over the axes this rank's amax varies over (without
  varying-axes types, over the group)."""
  if call.axis_name is None:
    return amax
  axes = tuple(sorted(_compat.varying_axes(amax), key=str)) or fp8._axes(call)
  return lax.pmax(amax, axes)


def _cast(v, scale, amax_from, dtype, call: fp8._Fp8Call, lead: int = 0) -> tuple:
  """(v cast to `dtype` with the step's scale, saturated, its first `lead` dims moved last; the whole operand's
  amax, the max of amax_from and |v|), from one pass over v."""
  q, amax = fp8_cast.cast_with_amax(v, scale, dtype, lead=lead, algorithm=fp8._cast_algorithm(call),
                                    amax_from=amax_from)
  return q, _whole_amax(amax, call)


# --- the custom VJP -----------------------------------------------------------------------------------------
# meta: (input scale, input history, kernel scale, kernel history, output-grad scale, output-grad history), the
# variables as Flax holds them. Their cotangents are their new values (Flax's '_overwrite_with_gradient'): the
# input and kernel ones from the forward pass, the output-gradient ones from the backward pass.

def _custom_vjp(forward, backward):
  @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
  def layer(x, w, meta, call: fp8._Fp8Call):
    return forward(x, w, meta, call)[0]

  layer.defvjp(forward, backward)
  return layer


def _forward_scales(x, w, meta, call: fp8._Fp8Call, lead: int) -> tuple:
  """(x8, x's step scale, w8 K-major (its first `lead` dims moved last), w's step scale, the new input and kernel
  meta)."""
  x_scale, x_history, w_scale, w_history = meta[:4]
  (xs, ws), (x_from, w_from) = step_scales(((x_scale, x_history), (w_scale, w_history)), (call.e4m3,) * 2, call)
  x8, x_amax = _cast(x, xs, x_from, call.e4m3, call)
  w8, w_amax = _cast(w, ws, w_from, call.e4m3, call, lead)
  new_meta = (*recorded(x_amax, xs, x_scale, x_history), *recorded(w_amax, ws, w_scale, w_history))
  return x8, xs, w8, ws, new_meta


def _cotangent(d, meta, call: fp8._Fp8Call) -> tuple:
  """(d cast to e5m2 with the step's output-gradient scale, that scale, the new output-gradient meta)."""
  g_scale, g_history = meta
  (gs,), (g_from,) = step_scales(((g_scale, g_history),), (call.e5m2,), call)
  d8, amax = _cast(d, gs, g_from, call.e5m2, call)
  return d8, gs, recorded(amax, gs, g_scale, g_history)


def _ag_forward(x, w, meta, call: fp8._Fp8Call):
  x8, xs, w8, ws, new_meta = _forward_scales(x, w, meta, call, lead=1)  # [K, *n] -> [*n, K]
  y, gathered, _ = api.ag_matmul(x8, w8, x_scale=xs, w_scale=ws, out_dtype=call.out_dtype,
                                 fast_accumulation=call.fast_accumulation, w_kmajor=True, axis_name=call.axis_name,
                                 algorithm=call.algorithm, return_gathered=True, gather_axis=call.axis,
                                 out_sharding=call.out_sharding)
  residuals = (gathered, remat.tag(xs, remat.AG_GATHERED_SCALES), w, remat.tag(ws, remat.AG_W_SCALE), meta[4:],
               new_meta, fp8._layouts(call, x, w))
  return y, residuals


def _ag_backward(call: fp8._Fp8Call, residuals, dy):
  gathered, xs, w, ws, g_meta, new_meta, (x_layout, w_layout) = residuals
  dy8, gs, new_g_meta = _cotangent(dy, g_meta, call)
  # dx = RS(dy @ W^T): the kernel cast again in its own layout [K, *n] (contraction n last), with the step's scale
  w8, _ = fp8_cast.cast_with_amax(w, ws, call.e4m3, algorithm=fp8._cast_algorithm(call))
  scatter = None if x_layout is not None else call.axis
  dx = api.matmul_rs(dy8, w8, x_scale=gs, w_scale=ws, out_dtype=call.x_dtype, w_kmajor=True,
                     axis_name=call.axis_name, algorithm=call.algorithm, scatter_axis=scatter,
                     **fp8._dual_layout(x_layout))
  # dW = gathered^T @ dy: one scale per operand (every shard's x has the step's scale)
  lead = functools.partial(fp8._lead_last, lead=gathered.ndim - 1)
  dw = fp8._weight_grad(lead(gathered), xs, lead(dy8), gs, w, w_layout, call)
  return autodiff.like(dx, x_layout), dw, (*new_meta, *new_g_meta)


def _rs_forward(x, w, meta, call: fp8._Fp8Call):
  x8, xs, w8, ws, new_meta = _forward_scales(x, w, meta, call, lead=w.ndim - 1)  # [*k, N] -> [N, *k]
  z = api.matmul_rs(x8, w8, x_scale=xs, w_scale=ws, out_dtype=call.out_dtype,
                    fast_accumulation=call.fast_accumulation, w_kmajor=True, axis_name=call.axis_name,
                    algorithm=call.algorithm, scatter_axis=call.axis, out_sharding=call.out_sharding)
  residuals = (remat.tag(x8, remat.RS_X_FP8), remat.tag(xs, remat.RS_X_SCALE), w, remat.tag(ws, remat.RS_W_SCALE),
               meta[4:], new_meta, fp8._layouts(call, x, w))
  return z, residuals


def _rs_backward(call: fp8._Fp8Call, residuals, dz):
  x8, xs, w, ws, g_meta, new_meta, (x_layout, w_layout) = residuals
  dz8, gs, new_g_meta = _cotangent(dz, g_meta, call)
  # (dx, AG(dz)) = ag_matmul(dz, W^T): the kernel cast again in its own layout [*k, N] (contraction N last)
  w8, _ = fp8_cast.cast_with_amax(w, ws, call.e4m3, algorithm=fp8._cast_algorithm(call))
  gather = -2 if call.axis in (None, -1) else call.axis
  dx, dz_gathered, _ = api.ag_matmul(dz8, w8, x_scale=gs, w_scale=ws, out_dtype=call.x_dtype, w_kmajor=True,
                                     axis_name=call.axis_name, algorithm=call.algorithm, return_gathered=True,
                                     gather_axis=gather, **fp8._dual_layout(x_layout))
  # dW = x^T @ AG(dz): every shard of AG(dz) has the step's scale
  lead = functools.partial(fp8._lead_last, lead=dz_gathered.ndim - 1)
  dw = fp8._weight_grad(lead(x8), xs, lead(dz_gathered), gs, w, w_layout, call)
  return autodiff.like(dx, x_layout), dw, (*new_meta, *new_g_meta)


_delayed_ag = _custom_vjp(_ag_forward, _ag_backward)
_delayed_rs = _custom_vjp(_rs_forward, _rs_backward)


# --- the layers ------------------------------------------------------------------------------------------------

class Fp8DelayedDotGeneralBase(fp8_ops.Fp8DotGeneralBase):
  """What the delayed-scaling layers share: Flax's variables (Fp8DotGeneralBase: amax_history_length, e4m3_dtype,
  e5m2_dtype), their checks, and the overlapped dots on them (`overlapped`), which a module named otherwise (to keep
  another library's state paths) may call on its own variables."""

  ALGORITHMS = fp8.Fp8Layer.ALGORITHMS
  # The forward GEMM with the vendor's fast fp8 accumulation (jax_overlap.ag_matmul's fast_accumulation), as
  # Flax's op runs it (its forward dot at precision DEFAULT, XLA's fast accumulation; its gradients' at HIGHEST,
  # which the gradients' GEMMs here match).
  fast_accumulation: bool = True
  # How x, the kernel and the cotangent are cast to float8 (fp8.CAST_ALGORITHMS): "auto", the cast kernels where
  # they take the call (one pass for the cast and the amax); "xla", XLA's forms, which XLA can fuse into the
  # operations that produce the operands.
  cast_algorithm: str = "auto"

  def __post_init__(self):
    super().__post_init__()
    fp8.check_cast_algorithm(type(self).__name__, self.cast_algorithm)
    if not isinstance(self.fast_accumulation, bool):
      raise TypeError(f"jax_overlap.{type(self).__name__}: fast_accumulation must be True or False, got "
                      f"{self.fast_accumulation!r}")
    check_fields(type(self).__name__, getattr(self, "axis_name", None), getattr(self, "algorithm", "auto"),
                 self.ALGORITHMS)
    pair = (formats.name(self.e4m3_dtype), formats.name(self.e5m2_dtype))
    if pair not in (formats.fp8_formats("ocp"), formats.fp8_formats("fnuz")):
      raise ValueError(f"jax_overlap.{type(self).__name__}: e4m3_dtype and e5m2_dtype must be one family's pair, "
                       f"{formats.fp8_formats('ocp')} (OCP) or {formats.fp8_formats('fnuz')} (fnuz), got {pair}")
    if not isinstance(self.amax_history_length, int) or self.amax_history_length < 1:
      raise ValueError(f"jax_overlap.{type(self).__name__}: amax_history_length must be a positive int, got "
                       f"{self.amax_history_length!r}")

  def meta(self) -> tuple:
    """The variables' values in the order the custom VJP takes them."""
    return (self.input_scale.value, self.input_amax_history.value, self.kernel_scale.value,
            self.kernel_amax_history.value, self.output_grad_scale.value, self.output_grad_amax_history.value)

  def overlapped(self, parallel: str, lhs, rhs, dimension_numbers, *, axis_name, algorithm: str, axis,
                 out_sharding=None, preferred_element_type=None):
    """The layer's dot on this module's variables: parallel "ag" (kernel [K, *n], x [..., K]; axis: x's gathered
    dim) or "rs" (kernel [*k, N], x [..., *k]; axis: the output dim scattered onto, None: the plan's). x is cast to
    the kernel's dtype first, the computation dtype (Flax's op does so too); the result is in it."""
    layer = type(self).__name__
    for name, v in (("x", lhs), ("kernel", rhs)):
      if formats.name(v.dtype) not in fp8_cast.INPUT_DTYPES:
        raise TypeError(f"jax_overlap.{layer}: {name} must have dtype {', '.join(fp8_cast.INPUT_DTYPES)} (the layer "
                        f"quantizes it), got {v.dtype}")
    x = jnp.asarray(lhs, rhs.dtype)
    if parallel == "ag":
      check_column_parallel(layer, x, rhs, dimension_numbers, preferred_element_type)
      axis = fp8._negative(axis, x.ndim)
      run = _delayed_ag
    else:
      contract = check_row_parallel(layer, x, rhs, dimension_numbers, preferred_element_type)
      axis = fp8._negative(axis, x.ndim - contract + 1)
      if axis_name is not None and axis == -1:
        raise ValueError(f"jax_overlap.{layer}: scatter_axis=-1 (the output columns) is not supported inside "
                         f"shard_map (its data gradient would gather the contraction); scatter another dim")
      run = _delayed_rs
    call = fp8._Fp8Call(axis_name=axis_name, algorithm=algorithm, axis=axis, out_sharding=out_sharding,
                        e4m3=formats.name(self.e4m3_dtype), e5m2=formats.name(self.e5m2_dtype),
                        x_dtype=formats.name(x.dtype), w_dtype=formats.name(rhs.dtype),
                        fast_accumulation=self.fast_accumulation, cast_algorithm=self.cast_algorithm)
    x, w = fp8._varying_in(call, x, rhs)
    return run(x, w, self.meta(), call)


class Fp8DelayedAgDotGeneral(Fp8DelayedDotGeneralBase):
  """flax.linen.Fp8DirectDotGeneralOp on ag_matmul: the column-parallel layer, kernel [K, *n], x [..., K].

  A linen module with Flax's fp8 variables and update rule (this module's docstring); pass it where Flax's op
  goes, as a linen layer's dot_general_cls (flax.linen.Dense(..., dot_general_cls=Fp8DelayedAgDotGeneral)).
  axis_name, gather_axis: as jax_overlap.AgDotGeneral's. algorithm: "auto", "pipelined" or "xla", as
  jax_overlap.Fp8AgDotGeneral's. e4m3_dtype, e5m2_dtype: the OCP pair (default) or the fnuz pair.
  amax_history_length: Flax's (1024). fast_accumulation: the forward GEMM's, True as in Flax's op (the
  gradients' GEMMs promote their sums to float32, as Flax's do). cast_algorithm: "auto", "kernels" or "xla", as
  jax_overlap.Fp8AgDotGeneral's (here for x, the kernel and the cotangent).

  Example (flax.linen, bf16 compute, on sharded global arrays under jit):

    layer = nn.DenseGeneral(4096, dtype=jnp.bfloat16, dot_general_cls=Fp8DelayedAgDotGeneral)
  """

  axis_name: str | tuple | None = None
  algorithm: str = "auto"
  gather_axis: int = -2

  def __post_init__(self):
    super().__post_init__()
    check_dim(type(self).__name__, "gather_axis", self.gather_axis, optional=False)

  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
    del precision
    return self.overlapped("ag", lhs, rhs, dimension_numbers, axis_name=self.axis_name, algorithm=self.algorithm,
                           axis=self.gather_axis, out_sharding=out_sharding,
                           preferred_element_type=preferred_element_type)


class Fp8DelayedRsDotGeneral(Fp8DelayedDotGeneralBase):
  """flax.linen.Fp8DirectDotGeneralOp on matmul_rs: the row-parallel layer, kernel [*k, N], x [..., *k].

  As Fp8DelayedAgDotGeneral, with scatter_axis as jax_overlap.Fp8RsDotGeneral's (not the columns, -1, inside
  shard_map).

  Example (flax.linen, bf16 compute, on sharded global arrays under jit):

    layer = nn.DenseGeneral(1024, dtype=jnp.bfloat16, dot_general_cls=Fp8DelayedRsDotGeneral)
  """

  axis_name: str | tuple | None = None
  algorithm: str = "auto"
  scatter_axis: int | None = None

  def __post_init__(self):
    super().__post_init__()
    check_dim(type(self).__name__, "scatter_axis", self.scatter_axis, optional=True)
    if self.axis_name is not None and self.scatter_axis == -1:
      raise ValueError(f"jax_overlap.{type(self).__name__}: scatter_axis=-1 (the output columns) is not supported "
                       f"inside shard_map (its data gradient would gather the contraction); scatter another dim")

  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
    del precision
    return self.overlapped("rs", lhs, rhs, dimension_numbers, axis_name=self.axis_name, algorithm=self.algorithm,
                           axis=self.scatter_axis, out_sharding=out_sharding,
                           preferred_element_type=preferred_element_type)


