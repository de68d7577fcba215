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
(the move fused into its cast) otherwise. With amax_from (a float32 >= 0,
ops/fp8_scales.py's zero) the amax is max(amax_from, max |x|): the kernel
accumulates into amax_from's buffer, given to it as its amax result
(operand_output_aliases), so no launch zeroes the amax first.
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


def cast_with_amax(x, scale, dtype, *, lead: int = 0, algorithm: str = "auto", amax_from=None):
  """(x / scale rounded to the float8 format `dtype`, saturated: numerics.quantize_saturated's value; max |x| as a
  float32 scalar: numerics.amax's), from one pass over x where the kernel takes the call. lead: the number of x's
  leading dims the cast moves last (0: x's layout; else 1 to x.ndim - 1). algorithm: as cast's. amax_from: None,
  or a float32 scalar >= 0 the amax starts from (the amax is then max(amax_from, max |x|))."""
  if not isinstance(lead, int) or isinstance(lead, bool) or not (lead == 0 or 0 < lead < jnp.ndim(x)):
    raise ValueError(f"jax_overlap.fp8_cast.cast_with_amax: lead must be 0 or an int from 1 to x.ndim - 1 "
                     f"({jnp.ndim(x) - 1}), got {lead!r}")
  operands = (x, scale) if amax_from is None else (x, scale, amax_from)
  axes = tuple(sorted(set().union(*(_compat.varying_axes(v) for v in operands)), key=str))
  if axes:
    operands = tuple(_compat.make_varying(v, axes) for v in operands)
  return tuple(amax_primitive.bind(*operands, dtype=formats.name(dtype), algorithm=algorithm, lead=lead))


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
  if scale_dim is None:  # elementwise in x
    return cast(x, scale, dtype, algorithm=algorithm), x_dim
  # A scale per batch element (a vmapped current scaling): XLA's form, which takes any scale's shape.
  log.debug("jax_overlap.fp8_cast: XLA's cast (vmapped with a scale per batch element)")
  return jax.vmap(lambda xi, si: numerics.quantize(xi, dtype, si), in_axes=(x_dim, scale_dim))(x, scale), 0


def _amax_batch_rule(args, dims, *, dtype, algorithm, lead):
  """An amax per batch element: XLA's form, vmapped (the kernel's amax is of all of x)."""
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
  return kernel_declined(ctx, (dtype,), algorithm)


def kernel_declined(ctx, dtypes: tuple, algorithm: str) -> str | None:
  """Why the project's fp8 kernels (this cast's, ops/fp8_scales.py's) do not take a call into the float8 formats
  `dtypes` in the lowering context `ctx`, or None: algorithm "xla", no native module or GPU, a format the GPU
  cannot run, or global arrays over several devices (XLA partitions the call)."""
  if algorithm == "xla":
    return "algorithm='xla'"
  try:
    lowering.native_ready(ctx)
  except planning.Declined as e:
    return str(e)
  gpus = workspace.local_gpus()
  if not gpus:
    return "no GPU is known to this process"
  for dtype in dtypes:
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
  """The lowering of a cast primitive on a GPU: the custom call `target` (with amax_from, `target`_from, whose amax
  result is amax_from's buffer; with lead > 0, the transposing variant `target`[_from]_transposed), or XLA's form
  (`reference`) where the kernel declines the call (said at DEBUG)."""
  def lower(ctx, x, scale, *amax_from, dtype, algorithm, **lead):
    why = _declined(ctx, dtype, algorithm, **lead)
    if why is not None:
      log.debug("jax_overlap.fp8_cast: XLA's %s (%s)", what, why)
      return reference(ctx, x, scale, *amax_from, dtype=dtype, algorithm=algorithm, **lead)
    name = target + ("_from" if amax_from else "") + ("_transposed" if lead.get("lead") else "")
    attrs = {"lead": np.int64(lead["lead"])} if lead.get("lead") else {}
    aliases = {2: 1} if amax_from else None
    return jax.ffi.ffi_lowering(backend.current().target(name), operand_output_aliases=aliases)(
        ctx, x, scale, *amax_from, **attrs)
  return lower


def _amax_reference_lowering(ctx, *operands, dtype, algorithm, lead):
  del algorithm
  return mlir.lower_fun(lambda *a: _amax_reference(*a, dtype=dtype, lead=lead), multiple_results=True)(
      ctx, *operands)


def register() -> None:
  primitives.register_rules(primitive, _abstract_eval, _batch_rule, primitives.untyped_lowering(_reference_lowering),
                            primitives.untyped_lowering(_gpu_lowering("fp8_cast", _reference_lowering, "cast")))
  primitives.register_rules(amax_primitive, _amax_abstract_eval, _amax_batch_rule,
                            primitives.untyped_lowering(_amax_reference_lowering),
                            primitives.untyped_lowering(_gpu_lowering("fp8_cast_amax", _amax_reference_lowering,
                                                                         "cast with amax")))
