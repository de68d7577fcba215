"""flax.linen.Fp8DirectDotGeneralOp on the ops, with Flax's variables and update rule, so training loops and
checkpoints carry over; values differ by float8 rounding only (x times the float32 reciprocal where Flax divides)."""

from __future__ import annotations

import jax.numpy as jnp
from flax.linen import fp8_ops

from jax_overlap.layers import fp8
from jax_overlap.layers.dot_general import check_dim, check_fields, check_operands
from jax_overlap.quantization import formats, recipes


class Fp8DelayedDotGeneralBase(fp8_ops.Fp8DotGeneralBase):
  """Flax's variables, their checks, and `overlapped`, for a module named otherwise (maxtext/hook.py) too."""

  ALGORITHMS = fp8.Fp8Layer.ALGORITHMS
  fast_accumulation: bool = True  # as Flax's forward dot, at precision DEFAULT
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
    return (self.input_scale.value, self.input_amax_history.value, self.kernel_scale.value,
            self.kernel_amax_history.value, self.output_grad_scale.value, self.output_grad_amax_history.value)

  def overlapped(self, parallel: str, lhs, rhs, dimension_numbers, *, axis_name, algorithm: str, axis,
                 out_sharding=None, preferred_element_type=None):
    """fp8.overlapped on this module's variables, x first cast to the kernel's dtype as Flax's op does."""
    fp8.check_inputs(type(self).__name__, lhs, rhs)
    return fp8.overlapped(parallel, jnp.asarray(lhs, rhs.dtype), rhs, dimension_numbers, self.meta(), layer=type(self).__name__,
                          recipe=recipes.DelayedRecipe(), axis_name=axis_name, algorithm=algorithm, axis=axis,
                          out_sharding=out_sharding, e4m3=formats.name(self.e4m3_dtype),
                          e5m2=formats.name(self.e5m2_dtype), fast_accumulation=self.fast_accumulation,
                          cast_algorithm=self.cast_algorithm, preferred_element_type=preferred_element_type)


class Fp8DelayedAgDotGeneral(Fp8DelayedDotGeneralBase):
  """flax.linen.Fp8DirectDotGeneralOp on ag_matmul: the column-parallel layer, kernel [K, *n], x [..., K].

  Pass it as a linen layer's dot_general_cls. Fields as Fp8AgDotGeneral's (fast_accumulation True, as Flax's op),
  and Flax's e4m3_dtype, e5m2_dtype (the OCP or the fnuz pair) and amax_history_length (1024).

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

  As Fp8DelayedAgDotGeneral, with scatter_axis as Fp8RsDotGeneral's.

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


