"""Delayed-scaling float8 layers in Flax's convention: flax.linen.Fp8DirectDotGeneralOp on the ops.

Fp8DelayedAgDotGeneral (column-parallel, ag_matmul) and Fp8DelayedRsDotGeneral (row-parallel, matmul_rs) are
linen modules with the variables of Flax's fp8 dot (Fp8DotGeneralBase's: input, kernel and output-gradient scales
and amax histories in the '_overwrite_with_gradient' collection, the same names, shapes and initial values) and
its update rule, whose new values come back as those variables' gradients, as Flax's do: a training loop that
overwrites them with their gradients (MaxText's, Flax's examples) runs them unchanged, and a state or checkpoint
of Flax's op carries over. The arithmetic is the delayed recipe's (quantization/recipes.py) on the fp8 layers'
custom VJP (layers/fp8.py).

Flax divides by the scale in the compute dtype and dequantizes the product in it; here x is multiplied by the
float32 reciprocal (the cast kernel's form) and the scales apply in float32 inside the GEMM, so values differ from
Flax's by float8 rounding where the two quotients round apart, not in the state's rule. Formats: e4m3_dtype /
e5m2_dtype, Flax's fields, either OCP (float8_e4m3fn + float8_e5m2, Flax's default: sm_89+, gfx950) or fnuz
(float8_e4m3fnuz + float8_e5m2fnuz: gfx942); a format the GPU cannot run takes the XLA path under "auto", as the
other fp8 layers' do.

This module imports flax (the layers are flax.linen modules); `import jax_overlap` does not import it until a
name of it is asked for.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax.linen import fp8_ops

from jax_overlap.layers import fp8
from jax_overlap.layers.dot_general import check_dim, check_fields, check_operands
from jax_overlap.quantization import formats, recipes


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
    fp8.check_inputs(type(self).__name__, lhs, rhs)
    return fp8.overlapped(parallel, jnp.asarray(lhs, rhs.dtype), rhs, dimension_numbers, self.meta(), layer=type(self).__name__,
                          recipe=recipes.DelayedRecipe(), axis_name=axis_name, algorithm=algorithm, axis=axis,
                          out_sharding=out_sharding, e4m3=formats.name(self.e4m3_dtype),
                          e5m2=formats.name(self.e5m2_dtype), fast_accumulation=self.fast_accumulation,
                          cast_algorithm=self.cast_algorithm, preferred_element_type=preferred_element_type)


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

  def __call__(self, lhs=None, rhs=None, dimension_numbers=None, precision=None, preferred_element_type=None,
               out_sharding=None):
    del precision
    check_operands(self, lhs, rhs, dimension_numbers)
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
    fp8.check_scatter_axis(type(self).__name__, self.axis_name, self.scatter_axis)

  def __call__(self, lhs=None, rhs=None, dimension_numbers=None, precision=None, preferred_element_type=None,
               out_sharding=None):
    del precision
    check_operands(self, lhs, rhs, dimension_numbers)
    return self.overlapped("rs", lhs, rhs, dimension_numbers, axis_name=self.axis_name, algorithm=self.algorithm,
                           axis=self.scatter_axis, out_sharding=out_sharding,
                           preferred_element_type=preferred_element_type)


