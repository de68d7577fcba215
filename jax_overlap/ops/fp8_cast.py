"""The fp8 layers' cast, x / scale rounded to float8, as a primitive: numerics.quantize, or on a GPU the project's
kernel, bit for bit the same. cast_with_amax (delayed scaling) saturates, since a scale from earlier steps need not
cover x, and returns the amax from the same pass, accumulated into amax_from's buffer where given."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.interpreters import mlir
from jax.sharding import PartitionSpec as P

from jax_overlap import _compat
from jax_overlap.integration import fp8_lowering, primitives
from jax_overlap.quantization import formats, numerics

log = logging.getLogger("jax_overlap")

INPUT_DTYPES = fp8_lowering.CAST_INPUT_DTYPES

primitive = jex_core.Primitive("jax_overlap_fp8_cast")
amax_primitive = jex_core.Primitive("jax_overlap_fp8_cast_amax")
amax_primitive.multiple_results = True


def cast(x, scale, dtype, *, algorithm: str = "auto"):
  """x / scale rounded to the float8 format `dtype`. algorithm: "auto" or "xla"."""
  # The abstract value is x's, so x must vary over whatever the scale does.
  axes = tuple(sorted(_compat.varying_axes(x) | _compat.varying_axes(scale), key=str))
  if axes:
    x, scale = _compat.make_varying(x, axes), _compat.make_varying(scale, axes)
  return primitive.bind(x, scale, dtype=formats.name(dtype), algorithm=algorithm)


def cast_with_amax(x, scale, dtype, *, lead: int = 0, algorithm: str = "auto", amax_from=None):
  """(x / scale saturated to `dtype`, max(amax_from, max |x|)); lead: x's leading dims moved last (K-major)."""
  if not isinstance(lead, int) or isinstance(lead, bool) or not (lead == 0 or 0 < lead < jnp.ndim(x)):
    raise ValueError(f"jax_overlap.fp8_cast.cast_with_amax: lead must be 0 or an int from 1 to x.ndim - 1 "
                     f"({jnp.ndim(x) - 1}), got {lead!r}")
  operands = (x, scale) if amax_from is None else (x, scale, amax_from)
  axes = tuple(sorted(set().union(*(_compat.varying_axes(v) for v in operands)), key=str))
  if axes:
    operands = tuple(_compat.make_varying(v, axes) for v in operands)
  return tuple(amax_primitive.bind(*operands, dtype=formats.name(dtype), algorithm=algorithm, lead=lead))


def _moved(dims, lead: int) -> tuple:
  return (*dims[lead:], *dims[:lead])


def current_scaling(x, dtype, *, algorithm: str = "auto"):
  scale = numerics.fp8_scale(jnp.max(jnp.abs(x)), dtype)
  return cast(x, scale, dtype, algorithm=algorithm), scale


def _abstract_eval(x, scale, *, dtype, algorithm):
  del algorithm
  if scale.shape != () or scale.dtype != jnp.float32:
    raise TypeError(f"jax_overlap.fp8_cast: scale must be a float32 scalar, got {scale.dtype}{list(scale.shape)}")
  if not formats.is_fp8(dtype):
    raise TypeError(f"jax_overlap.fp8_cast: dtype must be a float8 format, got {dtype}")
  return x.update(dtype=jnp.dtype(dtype), weak_type=False)


def _amax_abstract_eval(x, scale, *amax_from, dtype, algorithm, lead):
  if amax_from and (amax_from[0].shape != () or amax_from[0].dtype != jnp.float32):
    raise TypeError(f"jax_overlap.fp8_cast: amax_from must be a float32 scalar, got "
                    f"{amax_from[0].dtype}{list(amax_from[0].shape)}")
  q = _abstract_eval(x, scale, dtype=dtype, algorithm=algorithm)
  if lead:
    sharding = getattr(x, "sharding", None)
    spec = getattr(sharding, "spec", None)
    spec = None if spec is None else P(*_moved(tuple(spec) + (None,) * (x.ndim - len(spec)), lead))
    q = primitives.result_aval(x, _moved(x.shape, lead), spec, dtype).update(weak_type=False)
  return q, primitives.result_aval(x, (), None, jnp.float32).update(weak_type=False)


def _batch_rule(args, dims, *, dtype, algorithm):
  (x, scale), (x_dim, scale_dim) = args, dims
  if scale_dim is None:
    return cast(x, scale, dtype, algorithm=algorithm), x_dim
  log.debug("jax_overlap.fp8_cast: XLA's cast (vmapped with a scale per batch element)")
  return jax.vmap(lambda xi, si: numerics.quantize(xi, dtype, si), in_axes=(x_dim, scale_dim))(x, scale), 0


def _amax_batch_rule(args, dims, *, dtype, algorithm, lead):
  """XLA's form, vmapped: the kernel's amax is of all of x."""
  del algorithm
  log.debug("jax_overlap.fp8_cast: XLA's cast with amax (vmapped)")
  out = jax.vmap(lambda *a: _amax_reference(*a, dtype=dtype, lead=lead), in_axes=tuple(dims))(*args)
  return out, (0, 0)


def _amax_reference(x, scale, *amax_from, dtype, lead: int = 0):
  moved = jnp.transpose(x, _moved(range(x.ndim), lead)) if lead else x
  amax = numerics.amax(x)
  return [numerics.quantize_saturated(moved, dtype, scale), jnp.maximum(amax_from[0], amax) if amax_from else amax]


def _reference_lowering(ctx, x, scale, *, dtype, algorithm):
  del algorithm
  return mlir.lower_fun(lambda x, s: numerics.quantize(x, dtype, s), multiple_results=False)(ctx, x, scale)


def _amax_reference_lowering(ctx, *operands, dtype, algorithm, lead):
  del algorithm
  return mlir.lower_fun(lambda *a: _amax_reference(*a, dtype=dtype, lead=lead), multiple_results=True)(
      ctx, *operands)


def register() -> None:
  primitives.register_rules(primitive, _abstract_eval, _batch_rule, primitives.untyped_lowering(_reference_lowering),
                            primitives.untyped_lowering(fp8_lowering.cast_lowering("fp8_cast", _reference_lowering, "cast")))
  primitives.register_rules(amax_primitive, _amax_abstract_eval, _amax_batch_rule,
                            primitives.untyped_lowering(_amax_reference_lowering),
                            primitives.untyped_lowering(fp8_lowering.cast_lowering("fp8_cast_amax", _amax_reference_lowering,
                                                                                      "cast with amax")))
