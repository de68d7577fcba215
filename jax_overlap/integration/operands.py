"""The primitives' operands by name, and the forms the GPU targets take: empty [0] where absent, a float8 call's
scales flat in the vendor GEMM's layout and its w K-major (Hopper's fp8 GEMM takes no other)."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import numpy as np
from jax.interpreters import mlir

from jax_overlap.quantization.scaling import Scales


def operands(x, w, bias, scales) -> tuple:
  return (x, w, *(() if bias is None else (bias,)), *(() if scales is None else scales.arrays()))


class Operands(NamedTuple):
  x: object
  w: object
  bias: object
  x_scale: object
  w_scale: object

  @classmethod
  def of(cls, args, has_bias: bool, scaling) -> Operands:
    x, w, *rest = args
    bias = rest[0] if has_bias else None
    x_scale, w_scale = rest[has_bias:has_bias + 2] if scaling is not None else (None, None)
    return cls(x, w, bias, x_scale, w_scale)

  def scales(self, scaling) -> Scales | None:
    return None if scaling is None else Scales(self.x_scale, self.w_scale, scaling)


def split_operands(args, has_bias: bool, scaling) -> tuple:
  o = Operands.of(args, has_bias, scaling)
  return o.x, o.w, o.bias, o.scales(scaling)


@dataclasses.dataclass(frozen=True)
class GemmCall:
  values: Operands
  avals: Operands
  scaling: object
  out_dtype: np.dtype
  w_kmajor: bool  # as given (a float8 w [k, n] is transposed for the GPU)

  @property
  def scaled(self) -> bool:
    return self.scaling is not None


def gemm_call(ctx, args, *, has_bias: bool, scaling, out_dtype, w_kmajor: bool) -> GemmCall:
  values = Operands.of(args, has_bias, scaling)
  avals = Operands.of(ctx.avals_in, has_bias, scaling)
  return GemmCall(values, avals, scaling, np.dtype(out_dtype or avals.x.dtype), bool(w_kmajor))


def lowered(ctx, fn, args, avals_in, aval_out):
  return mlir.lower_fun(fn, multiple_results=False)(ctx.replace(avals_in=avals_in, avals_out=[aval_out]), *args)[0]


def _k_major_w(ctx, call: GemmCall) -> tuple:
  w, w_aval = call.values.w, call.avals.w
  if not call.scaled or call.w_kmajor:
    return w, w_aval
  transposed = w_aval.update(shape=w_aval.shape[::-1])
  return lowered(ctx, lambda w: w.T, [w], [w_aval], transposed), transposed


def _scale_operands(ctx, call: GemmCall, x_groups: int) -> tuple:
  """The scales flat in the vendor GEMMs' layout (x's rows in `x_groups` GEMMs), f32[0] when 16-bit."""
  if not call.scaled:
    empty = np.zeros((0,), np.float32)
    return [mlir.ir_constant(empty)] * 2, [jax.core.ShapedArray((0,), np.float32)] * 2
  forms = call.scaling.gemm_forms(x_groups, call.w_kmajor)
  scale_avals = (call.avals.x_scale, call.avals.w_scale)
  flat = [jax.eval_shape(f, aval) for f, aval in zip(forms, scale_avals)]
  avals = [aval.update(shape=f.shape) for aval, f in zip(scale_avals, flat)]
  return [lowered(ctx, f, [s], [aval], out) for f, s, aval, out in
          zip(forms, (call.values.x_scale, call.values.w_scale), scale_avals, avals)], avals


def bias_by_xla(call: GemmCall, reduces_with_peers: bool) -> bool:
  """Whether XLA adds a float8 call's bias: the vendor's float8 epilogue takes one in a 16-bit output's dtype only,
  so otherwise the call writes float32 y and XLA adds the bias and rounds once. A reduction adds its own."""
  if not call.scaled or call.values.bias is None or reduces_with_peers:
    return False
  return (not call.scaling.bias_epilogue or call.avals.bias.dtype != call.out_dtype
          or call.out_dtype == np.float32)


def gemm_operands(ctx, call: GemmCall, bias_after: bool, x_groups: int) -> tuple:
  w, w_aval = _k_major_w(ctx, call)
  if call.values.bias is None or bias_after:
    empty = np.zeros((0,), call.out_dtype if call.scaled else call.avals.x.dtype)
    bias, bias_aval = mlir.ir_constant(empty), jax.core.ShapedArray(empty.shape, empty.dtype)
  else:
    bias, bias_aval = call.values.bias, call.avals.bias
  scales, scale_avals = _scale_operands(ctx, call, x_groups)
  return [call.values.x, w, bias, *scales], [call.avals.x, w_aval, bias_aval, *scale_avals]


def fused_operands(call: GemmCall) -> tuple:
  x_aval = call.avals.x
  bias, bias_aval = call.values.bias, call.avals.bias
  if bias is None:
    bias, bias_aval = mlir.ir_constant(np.zeros((0,), x_aval.dtype)), jax.core.ShapedArray((0,), x_aval.dtype)
  return [call.values.x, call.values.w, bias], [x_aval, call.avals.w, bias_aval]


def finished(ctx, call: GemmCall, y, y_aval, bias_after: bool):
  if not bias_after:
    return y
  return lowered(ctx, lambda y, b: (y + b.astype(np.float32)).astype(call.out_dtype), [y, call.values.bias],
                 [y_aval, call.avals.bias], y_aval.update(dtype=call.out_dtype))


def own_gathered_scales(ctx, call: GemmCall, aval_out):
  return lowered(ctx, call.scaling.of_whole_x, [call.values.x_scale], [call.avals.x_scale], aval_out)


def gathered_scales(ctx, call: GemmCall, flat, world: int, aval_out):
  return lowered(ctx, lambda s: call.scaling.gathered_from_gemm(s, world, aval_out.shape), [flat],
                 [flat_scales_aval(aval_out)], aval_out)


def flat_scales_aval(aval):
  return jax.core.ShapedArray((math.prod(aval.shape),), np.float32)
