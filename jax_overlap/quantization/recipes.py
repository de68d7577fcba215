"""The float8 training recipes under the layers' one custom VJP; a new one is a Recipe subclass, registered.
Power-of-two scales keep rescalings exact, so per-shard scales fold into one operand's."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jax_overlap import _compat, _sharding
from jax_overlap.quantization import numerics
from jax_overlap.quantization.scaling import BLOCK, BLOCK_SIZE, TENSOR, Scaling


def kmajor(w, lead: int):
  return jnp.transpose(w, (*range(lead, w.ndim), *range(lead)))


def lead_last(v, lead: int):
  """v [*l, *f] as [prod(f), *l], l unmerged: rows sharded on a minor dim have no merged layout without moving."""
  return _sharding.reshape(kmajor(v, lead), (-1, *v.shape[:lead]))


class Recipe:
  """`call` is the layer's Fp8Call. The base class serves recipes of one scale per operand."""

  name: str = ""
  scaling: Scaling = TENSOR
  stateful = False
  fast_accumulation_default = True

  def __repr__(self) -> str:
    return f"{type(self).__name__}()"

  def __eq__(self, other) -> bool:
    return type(other) is type(self)

  def __hash__(self) -> int:
    return hash(type(self))

  def fast_accumulation(self, layer: str, value) -> bool:
    """The forward GEMM's accumulation from a layer's field (None: this recipe's default)."""
    if value is not None and not isinstance(value, bool):
      raise TypeError(f"jax_overlap.{layer}: fast_accumulation must be None, True or False, got {value!r}")
    if value is None:
      return self.fast_accumulation_default
    try:
      self.scaling.accumulating(value)
    except ValueError as e:
      raise ValueError(f"jax_overlap.{layer}: fast_accumulation=True with scaling={self.name!r}: {e}") from None
    return value

  def ag_operands(self, x, w, layer: str) -> tuple:
    """(x, w as the GEMM takes them, y back in the layer's shape) for a kernel [K, *n]."""
    del layer
    return x, w, lambda y: y

  def rs_operands(self, x, w, contract: int, layer: str) -> tuple:
    del contract, layer
    return x, w

  def quantize(self, x, w, state, call, lead: int) -> tuple:
    """(x8, x_scale, w8 K-major, w_scale, what the backward keeps of `state`)."""
    raise NotImplementedError

  def cotangent(self, d, kept, call) -> tuple:
    """(d in e5m2, its scale, the state's cotangent); `kept`: quantize's last result."""
    raise NotImplementedError

  def dual_kernel(self, w, w_scale, call) -> tuple:
    """(w in e4m3 in its own layout, the forward's float8 values; its scale)."""
    return call.casts.cast(w, w_scale, call.e4m3), w_scale

  def ag_weight_grad(self, gathered, scales, dy, dy8, dy_scale, axis: int, call) -> tuple:
    """(a, a_scale, b, b_scale): dW = gathered^T @ dy's float8 operands, rows last; `axis` negative."""
    del dy, axis, call
    lead = functools.partial(lead_last, lead=gathered.ndim - 1)
    return lead(gathered), scales[0], lead(dy8), dy_scale

  def rs_weight_grad(self, x8, x_scale, dz_gathered, dz_scales, axis: int, call) -> tuple:
    del axis, call
    lead = functools.partial(lead_last, lead=dz_gathered.ndim - 1)
    return lead(x8), x_scale, lead(dz_gathered), dz_scales[0]


class TensorRecipe(Recipe):
  """Current scaling: a power-of-two scale per operand from its amax (inside shard_map the local shard's)."""

  name = "tensor"

  def quantize(self, x, w, state, call, lead):
    del state
    x8 = call.casts.cast(x, x_scale := numerics.fp8_scale(jnp.max(jnp.abs(x)), call.e4m3), call.e4m3)
    # XLA transposes and casts the kernel in one pass over w.
    w_scale = numerics.fp8_scale(jnp.max(jnp.abs(w)), call.e4m3)
    return x8, x_scale, numerics.quantize(kmajor(w, lead), call.e4m3, w_scale), w_scale, ()

  def cotangent(self, d, kept, call):
    del kept
    scale = numerics.fp8_scale(jnp.max(jnp.abs(d)), call.e5m2)
    return call.casts.cast(d, scale, call.e5m2), scale, ()

  def ag_weight_grad(self, gathered, scales, dy, dy8, dy_scale, axis, call):
    # dy's rows times their shard's scale, requantized with one scale: dW stays one GEMM of a scale per operand.
    # With one shard the scales' product is not formed: it may underflow float32 where dW does not.
    if scales.shape[0] == 1:
      return super().ag_weight_grad(gathered, scales, dy, dy8, dy_scale, axis, call)
    lead = functools.partial(lead_last, lead=gathered.ndim - 1)
    rows = numerics.rows_times(dy, scales, gathered.ndim + axis)
    dyt8, dyt_scale = numerics.current_scaling(rows, call.e5m2, lead)
    return lead(gathered), jnp.float32(1), dyt8, dyt_scale

  def rs_weight_grad(self, x8, x_scale, dz_gathered, dz_scales, axis, call):
    lead = functools.partial(lead_last, lead=dz_gathered.ndim - 1)
    dzt8, dzt_scale = numerics.rescaled_rows(dz_gathered, dz_scales, dz_gathered.ndim + axis, lead)
    return lead(x8), x_scale, dzt8, dzt_scale


class BlockRecipe(Recipe):
  """DeepSeek-V3's: x and the cotangent per 1x128 block of their last dim, the kernel per 128x128 tile. dW contracts
  the rows, so its operands are requantized in blocks along the rows (x from its float8 value, exactly)."""

  name = "block"
  scaling = BLOCK
  fast_accumulation_default = False

  def ag_operands(self, x, w, layer):
    w2 = _sharding.reshape(w, (w.shape[0], -1))
    BLOCK.check_dims(f"{layer} (scaling='block', each rank's kernel)", *w2.shape)
    return x, w2, lambda y: _sharding.reshape(y, (*y.shape[:-1], *w.shape[1:]))

  def rs_operands(self, x, w, contract, layer):
    w2 = _sharding.reshape(w, (-1, w.shape[-1]))
    BLOCK.check_dims(f"{layer} (scaling='block', each rank's kernel)", *w2.shape)
    return _sharding.reshape(x, (*x.shape[:x.ndim - contract], -1)), w2

  def quantize(self, x, w, state, call, lead):
    del state
    return (*numerics.block_scaling(x, call.e4m3), *numerics.tile_scaling(kmajor(w, lead), call.e4m3), ())

  def cotangent(self, d, kept, call):
    del kept
    return (*numerics.block_scaling(d, call.e5m2), ())

  def dual_kernel(self, w, w_scale, call):
    return numerics.tile_scaling(w, call.e4m3, w_scale.T)[0], w_scale.T

  def ag_weight_grad(self, gathered, scales, dy, dy8, dy_scale, axis, call):
    del dy8, dy_scale, axis
    return self._weight_grad(gathered, scales, dy, call, "x's leading dims, gathered")

  def rs_weight_grad(self, x8, x_scale, dz_gathered, dz_scales, axis, call):
    del axis
    return self._weight_grad(x8, x_scale, numerics.dequantized(dz_gathered, dz_scales), call, "x's leading dims")

  @staticmethod
  def _weight_grad(x8, x_scale, d, call, rows_are: str) -> tuple:
    def rows_last(a):
      rows = math.prod(a.shape[:-1])
      if rows % BLOCK_SIZE:
        raise ValueError(f"jax_overlap.{call.layer}: the weight gradient of scaling='block' contracts the rows (the "
                         f"product of {rows_are}), which must be a multiple of {BLOCK_SIZE}, got {rows}")
      return _sharding.reshape(a, (rows, a.shape[-1])).T
    at8, a_scale = numerics.block_scaling(rows_last(numerics.dequantized(x8, x_scale)), call.e4m3)
    bt8, b_scale = numerics.tile_scaling(rows_last(d), call.e5m2)
    return at8, a_scale, bt8, b_scale


class DelayedRecipe(Recipe):
  """Flax's delayed scaling: the state is Flax's six variables, its cotangent their new value. A step's scale precedes
  its amax, so one pass casts (saturating) and takes the amax, of the whole operand: every rank's history is one."""

  name = "delayed"
  stateful = True

  def quantize(self, x, w, state, call, lead):
    x_scale, x_history, w_scale, w_history, *g_meta = state
    (xs, ws), (x_from, w_from) = _step_scales(((x_scale, x_history), (w_scale, w_history)), (call.e4m3,) * 2, call)
    x8, x_amax = _cast(x, xs, x_from, call.e4m3, call)
    w8, w_amax = _cast(w, ws, w_from, call.e4m3, call, lead)
    recorded_meta = (*recorded(x_amax, xs, x_scale, x_history), *recorded(w_amax, ws, w_scale, w_history))
    return x8, xs, w8, ws, (tuple(g_meta), recorded_meta)

  def cotangent(self, d, kept, call):
    (g_scale, g_history), recorded_meta = kept
    (gs,), (g_from,) = _step_scales(((g_scale, g_history),), (call.e5m2,), call)
    d8, amax = _cast(d, gs, g_from, call.e5m2, call)
    return d8, gs, (*recorded_meta, *recorded(amax, gs, g_scale, g_history))

  def dual_kernel(self, w, w_scale, call):
    return call.casts.cast_with_amax(w, w_scale, call.e4m3)[0], w_scale


# Flax's fp8 meta is in an extended dtype (fp8_ops.fm32, gradients accumulated by max): arithmetic in float32.

def _float32(v):
  return lax.convert_element_type(v, jnp.float32) if jax.dtypes.issubdtype(v.dtype, jax.dtypes.extended) else v


def _step_scales(metas, dtypes, call) -> tuple[tuple, tuple]:
  """(the step's scales, the zeros their casts' amaxes start from) for (scale, history) pairs, in one kernel."""
  scalars = [jnp.reshape(_float32(s), ()).astype(jnp.float32) for s, _ in metas]
  return call.casts.step_scales(scalars, [_float32(h) for _, h in metas], dtypes)


def _cast(v, scale, amax_from, dtype, call, lead: int = 0) -> tuple:
  q, amax = call.casts.cast_with_amax(v, scale, dtype, lead=lead, amax_from=amax_from)
  if call.axis_name is None:
    return q, amax
  # Without varying-axes types the amax varies over the group.
  axes = tuple(sorted(_compat.varying_axes(amax), key=str)) or call.axes
  return q, lax.pmax(amax, axes)


def recorded(amax, step, scale, history) -> tuple:
  """update_fp8_meta's new (scale, history): one select of the rolled history (Flax's roll-then-update: two kernels)."""
  meta_dtype = scale.dtype if scale.dtype == history.dtype and jax.dtypes.issubdtype(
      scale.dtype, jax.dtypes.extended) else None
  h = history if meta_dtype is None else lax.convert_element_type(history, jnp.float32)
  first = lax.broadcasted_iota(jnp.int32, h.shape, 0) == 0
  new_history = jnp.where(first, amax.astype(h.dtype), jnp.roll(h, -1, axis=0))
  new_scale = jnp.reshape(step, jnp.shape(scale)).astype(jnp.float32)
  if meta_dtype is None:
    return new_scale, new_history
  return lax.convert_element_type(new_scale, meta_dtype), lax.convert_element_type(new_history, meta_dtype)


RECIPES: dict[str, type[Recipe]] = {}


def register(cls: type[Recipe]) -> type[Recipe]:
  if not cls.name or cls.name in RECIPES:
    raise ValueError(f"jax_overlap.recipes.register: {cls.__name__} needs a name of its own, got {cls.name!r}")
  RECIPES[cls.name] = cls
  return cls


for _cls in (TensorRecipe, BlockRecipe, DelayedRecipe):
  register(_cls)


def stateless() -> tuple:
  return tuple(name for name, cls in RECIPES.items() if not cls.stateful)
