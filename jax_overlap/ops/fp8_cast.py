"""The float8 cast of the fp8 layers' current scaling, x / scale rounded to a float8 format, as one primitive.

Its value is XLA's form, quantization/numerics.quantize: `(x.astype(float32) * (1 / scale)).astype(dtype)`,
kept as float8. On "cuda"/"rocm" it lowers to the project's kernel
(csrc/kernels/fp8_cast.cu: one pass at HBM speed, where XLA's loop fusion runs
at about half of it) when the kernel takes the call, and to XLA's form otherwise,
saying why at DEBUG level. The two agree bit for bit (tests/gpu/test_fp8_cast_kernel.py),
so which one a process takes never changes a result. The kernel takes x of
bfloat16, float16 or float32, a float8 format of the GPU's own family, and a
computation of one device's data: on one device, or each shard inside
shard_map. On global arrays over several devices it is XLA's form, which XLA
partitions (the kernel has no partitioning rule: XLA would replicate it).

cast_with_amax is the delayed-scaling layers' variant (layers/fp8_delayed.py),
a primitive of its own with two results: the cast saturated to the format's
largest finite value (numerics.quantize_saturated: their scale comes from
earlier steps and need not cover x) and max |x| as float32 (numerics.amax),
the amax those layers record, from the same pass over x: XLA's form is the
two, and the kernel's variant (the same launch rules) reads x once for both.
With lead > 0 the cast is of x with its first `lead` dims moved last (a
weight [K, N] into the K-major [N, K] the fp8 GEMM takes, or [*k, N] into
[N, *k]): the kernel's transposing variant, which takes x whose moved dims
hold a multiple of 16 elements and whose others a multiple of 8; XLA's form
(the move fused into its cast) otherwise.
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import mlir
from jax.sharding import PartitionSpec as P

from jax_overlap import _compat, planning
from jax_overlap.integration import lowering, primitives
from jax_overlap.quantization import formats, numerics
from jax_overlap.runtime import backend, workspace

log = logging.getLogger("jax_overlap")

INPUT_DTYPES = ("bfloat16", "float16", "float32")

primitive = jex_core.Primitive("jax_overlap_fp8_cast")
amax_primitive = jex_core.Primitive("jax_overlap_fp8_cast_amax")
amax_primitive.multiple_results = True


def cast(x, scale, dtype, *, algorithm: str = "auto"):
  """x / scale rounded to the float8 format `dtype` (numerics.quantize's value). algorithm: "auto" (the kernel
  where it takes the call) or "xla" (XLA's form)."""
  # Inside shard_map the result varies over what either operand varies over (its abstract value is x's).
  axes = tuple(sorted(_compat.varying_axes(x) | _compat.varying_axes(scale), key=str))
  if axes:
    x, scale = _compat.make_varying(x, axes), _compat.make_varying(scale, axes)
  return primitive.bind(x, scale, dtype=formats.name(dtype), algorithm=algorithm)


def cast_with_amax(x, scale, dtype, *, lead: int = 0, algorithm: str = "auto"):
  """(x / scale rounded to the float8 format `dtype`, saturated: numerics.quantize_saturated's value; max |x| as a
  float32 scalar: numerics.amax's), from one pass over x where the kernel takes the call. lead: the number of x's
  leading dims the cast moves last (0: x's layout; else 1 to x.ndim - 1). algorithm: as cast's."""
  if not isinstance(lead, int) or isinstance(lead, bool) or not (lead == 0 or 0 < lead < jnp.ndim(x)):
    raise ValueError(f"jax_overlap.fp8_cast.cast_with_amax: lead must be 0 or an int from 1 to x.ndim - 1 "
                     f"({jnp.ndim(x) - 1}), got {lead!r}")
  axes = tuple(sorted(_compat.varying_axes(x) | _compat.varying_axes(scale), key=str))
  if axes:
    x, scale = _compat.make_varying(x, axes), _compat.make_varying(scale, axes)
  return tuple(amax_primitive.bind(x, scale, dtype=formats.name(dtype), algorithm=algorithm, lead=lead))


def _moved(dims, lead: int) -> tuple:
  """dims with the first `lead` moved last."""
  return (*dims[lead:], *dims[:lead])


def current_scaling(x, dtype, *, algorithm: str = "auto"):
  """numerics.current_scaling with this cast: (x quantized to `dtype`, its float32 scale from the amax of x)."""
  scale = numerics.fp8_scale(jnp.max(jnp.abs(x)), dtype)
  return cast(x, scale, dtype, algorithm=algorithm), scale


def _abstract_eval(x, scale, *, dtype, algorithm):
  del algorithm
  if scale.shape != () or scale.dtype != jnp.float32:
    raise TypeError(f"jax_overlap.fp8_cast: scale must be a float32 scalar, got {scale.dtype}{list(scale.shape)}")
  if not formats.is_fp8(dtype):
    raise TypeError(f"jax_overlap.fp8_cast: dtype must be a float8 format, got {dtype}")
  return x.update(dtype=jnp.dtype(dtype), weak_type=False)


def _amax_abstract_eval(x, scale, *, dtype, algorithm, lead):
  q = _abstract_eval(x, scale, dtype=dtype, algorithm=algorithm)
  if lead:
    sharding = getattr(x, "sharding", None)
    spec = getattr(sharding, "spec", None)
    spec = None if spec is None else P(*_moved(tuple(spec) + (None,) * (x.ndim - len(spec)), lead))
    q = primitives.result_aval(x, _moved(x.shape, lead), spec, dtype).update(weak_type=False)
  return q, primitives.result_aval(x, (), None, jnp.float32).update(weak_type=False)


def _batch_rule(args, dims, *, dtype, algorithm):
  (x, scale), (x_dim, scale_dim) = args, dims
  if scale_dim is None:  # elementwise in x
    return cast(x, scale, dtype, algorithm=algorithm), x_dim
  # A scale per batch element (a vmapped current scaling): XLA's form, which takes any scale's shape.
  log.debug("jax_overlap.fp8_cast: XLA's cast (vmapped with a scale per batch element)")
  return jax.vmap(lambda xi, si: numerics.quantize(xi, dtype, si), in_axes=(x_dim, scale_dim))(x, scale), 0


def _amax_batch_rule(args, dims, *, dtype, algorithm, lead):
  """An amax per batch element: XLA's form, vmapped (the kernel's amax is of all of x)."""
  del algorithm
  (x, scale), (x_dim, scale_dim) = args, dims
  log.debug("jax_overlap.fp8_cast: XLA's cast with amax (vmapped)")
  out = jax.vmap(lambda xi, si: _amax_reference(xi, si, dtype, lead), in_axes=(x_dim, scale_dim))(x, scale)
  return out, (0, 0)


def _amax_reference(x, scale, dtype, lead: int = 0):
  moved = jnp.transpose(x, _moved(range(x.ndim), lead)) if lead else x
  return [numerics.quantize_saturated(moved, dtype, scale), numerics.amax(x)]


def _reference_lowering(ctx, x, scale, *, dtype, algorithm):
  del algorithm
  return mlir.lower_fun(lambda x, s: numerics.quantize(x, dtype, s), multiple_results=False)(ctx, x, scale)


def _transposed_declined(shape, lead: int) -> str | None:
  """Why the transposing variant does not take x of `shape` (csrc/kernels/fp8_cast.cu's
  transposed_cast_declined: its 128 x 128 tiles, 16-byte stores of out's rows and 8-element loads of x's), or
  None."""
  rows, cols = math.prod(shape[:lead]), math.prod(shape[lead:])
  if rows % 16 or cols % 8:
    return (f"x {list(shape)} moves {rows} rows last and {cols} columns first; the transposing kernel takes "
            f"multiples of 16 rows and 8 columns")
  if -(-rows // 128) > 65535:
    return f"x {list(shape)} has {rows} rows to move; the transposing kernel takes at most {128 * 65535}"
  return None


def _declined(ctx, dtype: str, algorithm: str, lead: int = 0) -> str | None:
  """Why the kernel does not take the call, or None."""
  if algorithm == "xla":
    return "algorithm='xla'"
  x_dtype = formats.name(ctx.avals_in[0].dtype)
  if x_dtype not in INPUT_DTYPES:
    return f"x is {x_dtype}; the kernel takes {', '.join(INPUT_DTYPES)}"
  if lead and (why := _transposed_declined(ctx.avals_in[0].shape, lead)) is not None:
    return why
  try:
    lowering.native_ready(ctx)
  except planning.Declined as e:
    return str(e)
  gpus = workspace.local_gpus()
  if not gpus:
    return "no GPU is known to this process"
  if (declined := planning.fp8_declined(dtype)) is not None:
    return declined
  axis_ctx = ctx.module_context.axis_context
  if isinstance(axis_ctx, _compat.spmd_axis_context_type()):
    mesh = axis_ctx.mesh
    auto = [a for a in mesh.axis_names if a not in axis_ctx.manual_axes and mesh.shape[a] > 1]
    return f"mesh axes {auto} are not manual here: XLA partitions the cast" if auto else None
  devices = getattr(axis_ctx, "num_devices", 1)
  return f"global arrays over {devices} devices: XLA partitions the cast" if devices > 1 else None


def _gpu_lowering(target: str, reference, what: str):
  """The lowering of a cast primitive on a GPU: the custom call `target` (with lead > 0, its transposing variant
  `target`_transposed), or XLA's form (`reference`) where the kernel declines the call (said at DEBUG)."""
  def lower(ctx, x, scale, *, dtype, algorithm, **lead):
    why = _declined(ctx, dtype, algorithm, **lead)
    if why is not None:
      log.debug("jax_overlap.fp8_cast: XLA's %s (%s)", what, why)
      return reference(ctx, x, scale, dtype=dtype, algorithm=algorithm, **lead)
    if lead.get("lead"):
      return jax.ffi.ffi_lowering(backend.current().target(target + "_transposed"))(
          ctx, x, scale, lead=np.int64(lead["lead"]))
    return jax.ffi.ffi_lowering(backend.current().target(target))(ctx, x, scale)
  return lower


def _amax_reference_lowering(ctx, x, scale, *, dtype, algorithm, lead):
  del algorithm
  return mlir.lower_fun(lambda x, s: _amax_reference(x, s, dtype, lead), multiple_results=True)(ctx, x, scale)


def register() -> None:
  primitives.register_rules(primitive, _abstract_eval, _batch_rule, primitives.untyped_lowering(_reference_lowering),
                            primitives.untyped_lowering(_gpu_lowering("fp8_cast", _reference_lowering, "cast")))
  primitives.register_rules(amax_primitive, _amax_abstract_eval, _amax_batch_rule,
                            primitives.untyped_lowering(_amax_reference_lowering),
                            primitives.untyped_lowering(_gpu_lowering("fp8_cast_amax", _amax_reference_lowering,
                                                                         "cast with amax")))
