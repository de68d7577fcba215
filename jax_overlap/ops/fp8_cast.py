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
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.interpreters import mlir

from jax_overlap import _compat, planning
from jax_overlap.integration import lowering, primitives
from jax_overlap.quantization import formats, numerics
from jax_overlap.runtime import backend, workspace

log = logging.getLogger("jax_overlap")

INPUT_DTYPES = ("bfloat16", "float16", "float32")

primitive = jex_core.Primitive("jax_overlap_fp8_cast")


def cast(x, scale, dtype, *, algorithm: str = "auto"):
  """x / scale rounded to the float8 format `dtype` (numerics.quantize's value). algorithm: "auto" (the kernel
  where it takes the call) or "xla" (XLA's form)."""
  # Inside shard_map the result varies over what either operand varies over (its abstract value is x's).
  axes = tuple(sorted(_compat.varying_axes(x) | _compat.varying_axes(scale), key=str))
  if axes:
    x, scale = _compat.make_varying(x, axes), _compat.make_varying(scale, axes)
  return primitive.bind(x, scale, dtype=formats.name(dtype), algorithm=algorithm)


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


def _batch_rule(args, dims, *, dtype, algorithm):
  (x, scale), (x_dim, scale_dim) = args, dims
  if scale_dim is None:  # elementwise in x
    return cast(x, scale, dtype, algorithm=algorithm), x_dim
  # A scale per batch element (a vmapped current scaling): XLA's form, which takes any scale's shape.
  log.debug("jax_overlap.fp8_cast: XLA's cast (vmapped with a scale per batch element)")
  return jax.vmap(lambda xi, si: numerics.quantize(xi, dtype, si), in_axes=(x_dim, scale_dim))(x, scale), 0


def _reference_lowering(ctx, x, scale, *, dtype, algorithm):
  del algorithm
  return mlir.lower_fun(lambda x, s: numerics.quantize(x, dtype, s), multiple_results=False)(ctx, x, scale)


def _declined(ctx, dtype: str, algorithm: str) -> str | None:
  """Why the kernel does not take the call, or None."""
  if algorithm == "xla":
    return "algorithm='xla'"
  x_dtype = formats.name(ctx.avals_in[0].dtype)
  if x_dtype not in INPUT_DTYPES:
    return f"x is {x_dtype}; the kernel takes {', '.join(INPUT_DTYPES)}"
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


def _gpu_lowering(ctx, x, scale, *, dtype, algorithm):
  why = _declined(ctx, dtype, algorithm)
  if why is not None:
    log.debug("jax_overlap.fp8_cast: XLA's cast (%s)", why)
    return _reference_lowering(ctx, x, scale, dtype=dtype, algorithm=algorithm)
  return jax.ffi.ffi_lowering(backend.current().target("fp8_cast"))(ctx, x, scale)


def register() -> None:
  primitives.register_rules(primitive, _abstract_eval, _batch_rule, primitives.untyped_lowering(_reference_lowering),
                            primitives.untyped_lowering(_gpu_lowering))
