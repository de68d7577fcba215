"""The delayed-scaling step before the casts as one primitive: per operand, the scale (Flax's update_fp8_meta
rule) and a zero its cast's amax starts from. On a GPU one launch serves a step's operands in place of XLA's
reduction, division and memset per cast, dividing as XLA's GPU code does: the path never changes the state."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.interpreters import mlir

from jax_overlap import _compat
from jax_overlap.integration import fp8_lowering, primitives
from jax_overlap.quantization import formats

log = logging.getLogger("jax_overlap")

primitive = jex_core.Primitive("jax_overlap_fp8_step_scales")
primitive.multiple_results = True


def step_scales(scales, histories, dtypes, *, algorithm: str = "auto") -> tuple[tuple, tuple]:
  """(the step's scales, float32 zeros) from each operand's previous scale, amax history and float8 format."""
  if not (len(scales) == len(histories) == len(dtypes) >= 1):
    raise ValueError(f"jax_overlap.fp8_scales.step_scales: one scale, history and dtype per operand, got "
                     f"{len(scales)}, {len(histories)} and {len(dtypes)}")
  operands = [v for pair in zip(scales, histories) for v in pair]
  axes = tuple(sorted(set().union(*(_compat.varying_axes(v) for v in operands)), key=str))
  if axes:
    operands = [_compat.make_varying(v, axes) for v in operands]
  out = primitive.bind(*operands, dtypes=tuple(formats.name(d) for d in dtypes), algorithm=algorithm)
  return tuple(out[0::2]), tuple(out[1::2])


def _abstract_eval(*operands, dtypes, algorithm):
  del algorithm
  scales, histories = operands[0::2], operands[1::2]
  for s in scales:
    if s.shape != () or s.dtype != jnp.float32:
      raise TypeError(f"jax_overlap.fp8_scales: scales must be float32 scalars, got {s.dtype}{list(s.shape)}")
  lengths = {h.shape for h in histories}
  if any(h.dtype != jnp.float32 for h in histories) or len(lengths) != 1 or len(next(iter(lengths))) != 1 or \
      next(iter(lengths))[0] < 1:
    raise TypeError(f"jax_overlap.fp8_scales: histories must be float32 vectors of one length >= 1, got "
                    f"{[f'{h.dtype}{list(h.shape)}' for h in histories]}")
  for d in dtypes:
    if not formats.is_fp8(d):
      raise TypeError(f"jax_overlap.fp8_scales: dtypes must be float8 formats, got {d}")
  scalar = scales[0].update(shape=(), dtype=jnp.float32, weak_type=False)
  return [scalar] * (2 * len(dtypes))


def _reference(*operands, dtypes):
  """Flax's rule (fp8_ops.compute_scale of the history's max, margin 0) and a zero, per operand."""
  from flax.linen import fp8_ops
  out = []
  for scale, history, dtype in zip(operands[0::2], operands[1::2], dtypes):
    fp8_max = fp8_ops.get_fp8_max(jnp.dtype(dtype), jnp.float32)
    out += [fp8_ops.compute_scale(jnp.max(history, axis=0), scale, fp8_max), jnp.zeros((), jnp.float32)]
  return out


def _reference_lowering(ctx, *operands, dtypes, algorithm):
  del algorithm
  return mlir.lower_fun(lambda *a: _reference(*a, dtypes=dtypes), multiple_results=True)(ctx, *operands)


def _batch_rule(args, dims, *, dtypes, algorithm):
  del algorithm
  log.debug("jax_overlap.fp8_scales: XLA's step scales (vmapped)")
  out = jax.vmap(lambda *a: _reference(*a, dtypes=dtypes), in_axes=tuple(dims))(*args)
  return out, [0] * len(out)


def register() -> None:
  primitives.register_rules(primitive, _abstract_eval, _batch_rule,
                            primitives.untyped_lowering(_reference_lowering),
                            primitives.untyped_lowering(fp8_lowering.step_scales_lowering(_reference_lowering)))
