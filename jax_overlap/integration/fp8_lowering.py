"""The GPU lowering of the fp8 cast and step-scales primitives: the kernel where it takes the call, else the XLA
form; a kernel has no partitioning rule, so global arrays over several devices take XLA's."""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_overlap import _compat
from jax_overlap.integration import lowering
from jax_overlap.planning import Declined, fp8_declined
from jax_overlap.quantization import formats
from jax_overlap.runtime import backend, workspace

log = logging.getLogger("jax_overlap")

CAST_INPUT_DTYPES = ("bfloat16", "float16", "float32")
MAX_STEP_SCALES = 4  # csrc/kernels/fp8_scales.h kMaxStepScales


def transposed_declined(shape, lead: int) -> str | None:
  """Why the transposing cast does not take x with its first `lead` dims moved last (fp8_cast.cu's rule), or None."""
  rows, cols = math.prod(shape[:lead]), math.prod(shape[lead:])
  if rows % 16 or cols % 8:
    return (f"x {list(shape)} moves {rows} rows last and {cols} columns first; the transposing kernel takes "
            f"multiples of 16 rows and 8 columns")
  if -(-rows // 128) > 65535:
    return f"x {list(shape)} has {rows} rows to move; the transposing kernel takes at most {128 * 65535}"
  return None


def kernel_declined(ctx, dtypes: tuple, algorithm: str) -> str | None:
  if algorithm == "xla":
    return "algorithm='xla'"
  try:
    lowering.native_ready(ctx)
  except Declined as e:
    return str(e)
  if not workspace.local_gpus():
    return "no GPU is known to this process"
  for dtype in dtypes:
    if (declined := fp8_declined(dtype)) is not None:
      return declined
  axis_ctx = ctx.module_context.axis_context
  if isinstance(axis_ctx, _compat.spmd_axis_context_type()):
    mesh = axis_ctx.mesh
    auto = [a for a in mesh.axis_names if a not in axis_ctx.manual_axes and mesh.shape[a] > 1]
    return f"mesh axes {auto} are not manual here: XLA partitions the cast" if auto else None
  devices = getattr(axis_ctx, "num_devices", 1)
  return f"global arrays over {devices} devices: XLA partitions the cast" if devices > 1 else None


def _cast_declined(ctx, dtype: str, algorithm: str, lead: int = 0) -> str | None:
  if algorithm == "xla":
    return "algorithm='xla'"
  x_dtype = formats.name(ctx.avals_in[0].dtype)
  if x_dtype not in CAST_INPUT_DTYPES:
    return f"x is {x_dtype}; the kernel takes {', '.join(CAST_INPUT_DTYPES)}"
  if lead and (why := transposed_declined(ctx.avals_in[0].shape, lead)) is not None:
    return why
  return kernel_declined(ctx, (dtype,), algorithm)


def cast_lowering(target: str, reference, what: str):
  """The custom call `target` (`_from`: the amax aliases amax_from's buffer, so no launch zeroes it; `_transposed`
  for lead > 0), or `reference` where the kernel declines."""
  def lower(ctx, x, scale, *amax_from, dtype, algorithm, **lead):
    why = _cast_declined(ctx, dtype, algorithm, **lead)
    if why is not None:
      log.debug("jax_overlap.fp8_cast: XLA's %s (%s)", what, why)
      return reference(ctx, x, scale, *amax_from, dtype=dtype, algorithm=algorithm, **lead)
    name = target + ("_from" if amax_from else "") + ("_transposed" if lead.get("lead") else "")
    attrs = {"lead": np.int64(lead["lead"])} if lead.get("lead") else {}
    aliases = {2: 1} if amax_from else None
    return jax.ffi.ffi_lowering(backend.current().target(name), operand_output_aliases=aliases)(
        ctx, x, scale, *amax_from, **attrs)
  return lower


def step_scales_lowering(reference):
  def lower(ctx, *operands, dtypes, algorithm):
    why = kernel_declined(ctx, dtypes, algorithm)
    if why is None and len(dtypes) > MAX_STEP_SCALES:
      why = f"{len(dtypes)} operands; the kernel takes at most {MAX_STEP_SCALES}"
    if why is not None:
      log.debug("jax_overlap.fp8_scales: XLA's step scales (%s)", why)
      return reference(ctx, *operands, dtypes=dtypes, algorithm=algorithm)
    fp8_max = np.array([float(jnp.finfo(jnp.dtype(d)).max) for d in dtypes], np.float32)
    return jax.ffi.ffi_lowering(backend.current().target("fp8_step_scales"))(ctx, *operands, fp8_max=fp8_max)
  return lower
