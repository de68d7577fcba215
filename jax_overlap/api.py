"""The public ops: argument checks at trace time, one driver (_drive), and one custom VJP for both, each op being
the other's gradient, so the GPU algorithms serve the backward pass (first-order reverse mode)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import math

import jax
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jax_overlap import _compat, planning, remat
from jax_overlap._sharding import has_explicit_axes, spec_of
from jax_overlap.integration import autodiff, partitioning, primitives
from jax_overlap.ops import OPS
from jax_overlap.ops import all_gather as all_gather_op
from jax_overlap.quantization import formats, scaling
from jax_overlap.runtime import backend, native

log = logging.getLogger("jax_overlap")

ALGORITHMS = ("auto", "xla", *formats.GPU_ALGORITHMS)


@dataclasses.dataclass(frozen=True)
class Call:
  """How one call runs besides its operands (static under jit)."""

  op: str
  axes: tuple | None  # None for global arrays
  size: int
  algorithm: str
  axis: int | None  # the op's dim argument, negative; None: the plan's
  request: tuple | None = None  # global arrays: the output spec asked for
  w_kmajor: bool = False
  outputs: int = 1
  out_dtype: str = ""

  def dual(self, op: str, axis, request=None, outputs: int = 1) -> Call:
    """The call of `op` the backward pass makes: the same group and algorithm, w in the other layout."""
    return dataclasses.replace(self, op=op, axis=axis, request=request, w_kmajor=not self.w_kmajor,
                               outputs=outputs)


def _check_algorithm(op_name: str, algorithm) -> None:
  if algorithm not in ALGORITHMS:
    raise ValueError(f"jax_overlap.{op_name}: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
  if algorithm in formats.GPU_ALGORITHMS and backend.current().platform is None:
    raise ValueError(f"jax_overlap.{op_name}: algorithm={algorithm!r} needs the native GPU extension, and this "
                     f"installation has none ({native.build_info().get('note', '')}); use 'auto' or 'xla'")


def _check_arrays(op_name: str, x, w, bias) -> None:
  for name, v in (("x", x), ("w", w)) + ((("bias", bias),) if bias is not None else ()):
    if not hasattr(v, "shape") or not hasattr(v, "dtype"):
      raise TypeError(f"jax_overlap.{op_name}: {name} must be an array, got {type(v).__name__}")
    if not formats.accepted(v.dtype):
      raise TypeError(f"jax_overlap.{op_name}: {name} must have dtype {formats.described()}, got {v.dtype}")
  if x.ndim < 2:
    raise ValueError(f"jax_overlap.{op_name}: x must have rank >= 2 ([..., rows, K]), got shape {x.shape}")
  if w.ndim < 2:
    raise ValueError(f"jax_overlap.{op_name}: w must have rank >= 2, got shape {w.shape}")


def _out_dtype_name(op_name: str, out_dtype) -> str | None:
  if out_dtype is None:
    return None
  try:
    return np.dtype(out_dtype).name
  except TypeError:
    raise TypeError(f"jax_overlap.{op_name}: out_dtype must be a dtype or None, got {out_dtype!r}") from None


def _check_dtypes(op_name: str, x, w, bias, x_scale, w_scale, out_dtype, w_kmajor: bool,
                  fast_accumulation=False) -> tuple:
  """(Scales of float8 operands or None, the result's dtype name)."""
  out_dtype = _out_dtype_name(op_name, out_dtype)
  if not isinstance(fast_accumulation, (bool, np.bool_)):
    raise TypeError(f"jax_overlap.{op_name}: fast_accumulation must be a bool, got {fast_accumulation!r}")
  fp8 = formats.is_fp8(x.dtype), formats.is_fp8(w.dtype)
  if any(fp8) and not all(fp8):
    raise TypeError(f"jax_overlap.{op_name}: x and w must both be float8 or neither (a float8 call quantizes both "
                    f"operands), got x {x.dtype}, w {w.dtype}")
  if not any(fp8):
    if w.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
      got = f"x {x.dtype}, w {w.dtype}" + (f", bias {bias.dtype}" if bias is not None else "")
      raise TypeError(f"jax_overlap.{op_name}: x, w and bias must share one dtype, got {got}")
    for name, scale in (("x_scale", x_scale), ("w_scale", w_scale)):
      if scale is not None:
        raise TypeError(f"jax_overlap.{op_name}: {name} applies to float8 operands only, got {name} with x and w "
                        f"of dtype {x.dtype}")
    if fast_accumulation:
      raise TypeError(f"jax_overlap.{op_name}: fast_accumulation applies to float8 operands only, got "
                      f"fast_accumulation=True with x and w of dtype {x.dtype}")
    if out_dtype is not None and out_dtype != formats.name(x.dtype):
      raise TypeError(f"jax_overlap.{op_name}: out_dtype must be None or x's dtype {x.dtype} for {x.dtype} "
                      f"operands (other out_dtypes are for float8 operands), got {out_dtype}")
    return None, formats.name(x.dtype)
  if formats.fp8_family(x.dtype) != formats.fp8_family(w.dtype):
    raise TypeError(f"jax_overlap.{op_name}: x and w must be float8 formats of one family, OCP (float8_e4m3fn, "
                    f"float8_e5m2) or fnuz (float8_e4m3fnuz, float8_e5m2fnuz): no GPU runs both; got x {x.dtype}, "
                    f"w {w.dtype}")
  if formats.is_e5m2(x.dtype) and formats.is_e5m2(w.dtype):
    raise TypeError(f"jax_overlap.{op_name}: x and w cannot both be e5m2 (the fp8 GEMMs take e5m2 on one side "
                    f"at most: gradients times e4m3 values), got x {x.dtype}, w {w.dtype}")
  out_name = out_dtype or formats.FP8_DEFAULT_OUT
  if out_name not in formats.OUT_DTYPES:
    raise TypeError(f"jax_overlap.{op_name}: out_dtype must be one of {formats.OUT_DTYPES} (or None: "
                    f"{formats.FP8_DEFAULT_OUT}) for float8 operands, got {out_name}")
  if bias is not None and formats.name(bias.dtype) not in (out_name, "float32"):
    raise TypeError(f"jax_overlap.{op_name}: bias must have out_dtype {out_name} or float32 with float8 operands, "
                    f"got {bias.dtype}")
  scales = scaling.of(op_name, x, w, x_scale, w_scale, bool(w_kmajor))
  if fast_accumulation and scales.scaling.blocks:
    raise ValueError(f"jax_overlap.{op_name}: fast_accumulation=True takes tensor scales (float32 scalars), got "
                     f"block scales: they apply per 128 elements of K, where the GEMM promotes its sums to float32 "
                     f"anyway")
  return dataclasses.replace(scales, scaling=scales.scaling.accumulating(bool(fast_accumulation))), out_name


def _check_gpu_dtype(op_name: str, algorithm: str, x, w) -> None:
  if algorithm not in formats.GPU_ALGORITHMS or not formats.is_fp8(x.dtype):
    return
  if not formats.takes(algorithm, formats.name(x.dtype)):
    raise ValueError(f"jax_overlap.{op_name}: algorithm={algorithm!r} does not take float8 operands (the fused "
                     f"kernels are 16-bit only; {algorithm!r} takes {', '.join(formats.dtypes_for(algorithm))}), got "
                     f"x {x.dtype}; use 'pipelined', 'auto' or 'xla'")
  declined = planning.fp8_declined(x.dtype, w.dtype)
  if declined:
    raise ValueError(f"jax_overlap.{op_name}: algorithm={algorithm!r} cannot run {declined}; use algorithm='auto' "
                     f"or 'xla' (the XLA path serves every float8 format)")


def _check_operands(op, x, w, bias, w_kmajor) -> tuple:
  _check_arrays(op.name, x, w, bias)
  if not isinstance(w_kmajor, (bool, np.bool_)):
    raise TypeError(f"jax_overlap.{op.name}: w_kmajor must be a bool, got {w_kmajor!r}")
  return op.arguments.check_operands(x, w, bias, bool(w_kmajor))


_LOCAL_SHAPES = " (inside jax.shard_map the shapes are each rank's local blocks, not the global arrays')"


@contextlib.contextmanager
def _local_shapes(axis_name):
  if axis_name is None:
    yield
    return
  try:
    yield
  except ValueError as e:
    raise ValueError(f"{e}{_LOCAL_SHAPES}") from None


def _check_axis(op: str, name: str, value, ndim: int, last: int, of: str) -> int:
  """value, a dim index in [-ndim, last] or [0, ndim + last], as a negative index."""
  valid = f"an int in [{-ndim}, {last}] or [0, {ndim + last}]"
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"jax_overlap.{op}: {name} must be {valid}, got {value!r}")
  index = int(value) - ndim if value >= 0 else int(value)
  if not -ndim <= index <= last:
    raise ValueError(f"jax_overlap.{op}: {name} must be {valid} for this call's {ndim}-dim {of}, got {value}")
  return index


def _check_out_sharding(op: str, out_sharding, out_shape: tuple, axis_name) -> None:
  if out_sharding is None:
    return
  if axis_name is not None:
    raise ValueError(f"jax_overlap.{op}: out_sharding applies to global arrays (axis_name=None); inside "
                     f"shard_map the output is this rank's block, got axis_name={axis_name!r}")
  if not isinstance(out_sharding, (NamedSharding, PartitionSpec)):
    raise TypeError(f"jax_overlap.{op}: out_sharding must be a NamedSharding or a PartitionSpec, "
                    f"got {type(out_sharding).__name__}")
  spec = out_sharding.spec if isinstance(out_sharding, NamedSharding) else out_sharding
  if len(spec) > len(out_shape):
    raise ValueError(f"jax_overlap.{op}: out_sharding has {len(spec)} entries for a {len(out_shape)}-dim output, "
                     f"got {spec}")
  mesh = out_sharding.mesh if isinstance(out_sharding, NamedSharding) else jax.sharding.get_abstract_mesh()
  if isinstance(out_sharding, PartitionSpec) and mesh.empty:
    raise ValueError(f"jax_overlap.{op}: out_sharding={out_sharding} is a PartitionSpec, which needs a mesh: "
                     f"pass a NamedSharding, or set one with jax.set_mesh")
  # Uneven shards are refused: no plan makes them (_sharding.py), and an Explicit mesh refuses a reshard after.
  for dim, (axes, size) in enumerate(zip(spec_of(spec, len(out_shape)), out_shape)):
    missing = [a for a in axes or () if a not in mesh.shape]
    if missing:
      raise ValueError(f"jax_overlap.{op}: out_sharding={spec} names {missing}, which the mesh "
                       f"{tuple(mesh.axis_names)} does not have")
    parts = math.prod(mesh.shape[a] for a in axes or ())
    if size % parts:
      raise ValueError(f"jax_overlap.{op}: out_sharding={spec} splits the output's dim {dim} ({size}) over "
                       f"{axes} ({parts} parts), which does not divide it; shard that dim on axes whose size "
                       f"divides {size}, or leave it unsharded")


def axis_group(op: str, axis_name) -> tuple[tuple, int]:
  """(axes, size) of a shard_map axis name or tuple of names; ValueError if unbound."""
  axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  if not axes or not all(isinstance(a, str) for a in axes):
    raise TypeError(f"jax_overlap.{op}: axis_name must be a mesh axis name or a tuple of them, got {axis_name!r}")
  try:
    size = 1
    for a in axes:
      size *= _compat.axis_size(a)
  except NameError as e:
    bound = _compat.bound_axis_names()
    where = f"the axes bound here are {bound}" if bound else "no axis is bound here"
    raise ValueError(f"jax_overlap.{op}: axis_name {axis_name!r} is not bound here ({where}); call it inside "
                     f"jax.shard_map over a mesh with that axis, or pass axis_name=None for global arrays "
                     f"under jit") from e
  return axes, size


def _constrain(out, out_sharding):
  """out in out_sharding's layout: a constraint, or a reshard where out's type or out_sharding's mesh is Explicit."""
  if out_sharding is None:
    return out
  if autodiff.explicit_sharding(out) is None and not has_explicit_axes(getattr(out_sharding, "mesh", None)):
    return lax.with_sharding_constraint(out, out_sharding)
  if spec_of(jax.typeof(out).sharding, out.ndim) == spec_of(out_sharding, out.ndim):
    return out
  return jax.sharding.reshard(out, out_sharding)


def _forward(x, w, bias, scales, call: Call) -> tuple:
  op = OPS[call.op]
  if call.axes is None:
    results = partitioning.call(op, x, w, bias, scales, algorithm=call.algorithm, w_kmajor=call.w_kmajor,
                                axis=call.axis, out_dtype=call.out_dtype, request=call.request)
  else:
    results = op.on_shards(x, w, bias, scales, axes=call.axes, size=call.size, algorithm=call.algorithm,
                           w_kmajor=call.w_kmajor, out_dtype=call.out_dtype, axis=call.axis)
  return tuple(results) if op.results.multiple else (results,)


def _taken(results: tuple, call: Call):
  return results[0] if call.outputs == 1 else results[:call.outputs]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _differentiable(x, w, bias, scales, call: Call):
  return _taken(_forward(x, w, bias, scales, call), call)


def _differentiable_fwd(x, w, bias, scales, call: Call):
  if scales is not None:
    raise TypeError(f"jax_overlap.{call.op}: differentiating a call with float8 operands (x {x.dtype}, w {w.dtype}) "
                    f"is not supported: their cotangents would be rounded to a float8 format without a scale. Train "
                    f"through the layers jax_overlap.Fp8AgDotGeneral and Fp8RsDotGeneral (bf16/f32 inputs, "
                    f"quantized each call, gradients in fp8 with scales of their own), or pass algorithm='xla' for "
                    f"JAX's own derivative of the plain ops")
  results = _forward(x, w, bias, scales, call)
  layouts = tuple(autodiff.layout(v, call.axes) for v in (x, w, bias))
  return _taken(results, call), (OPS[call.op].backward.residual(x, results), w, bias, layouts)


def _differentiable_bwd(call: Call, residuals, cotangents):
  cotangents = cotangents if call.outputs > 1 else (cotangents,)
  return (*OPS[call.op].backward.grads(call, residuals, cotangents, _differentiable), None)


_differentiable.defvjp(_differentiable_fwd, _differentiable_bwd)


# JAX's refusals of forward mode through a custom VJP (the second: in an eager shard_map); with
# jax_use_direct_linearize off, reverse mode has JVP tracers too and only these words tell the two apart.
_FORWARD_MODE = ("can't apply forward-mode autodiff (jvp) to a custom_vjp function", "unhashable type: 'Unhashable'")


def _reverse_mode(x, w, bias, scales, call: Call):
  """Forward mode is refused up front: under jit JAX refuses only when it lowers the tangent, after the call."""
  message = primitives.unsupported(call.op, "forward-mode differentiation (jax.jvp, jax.jacfwd)", call.algorithm)
  if _compat.forward_mode(x, w, bias, *(() if scales is None else scales.arrays())):
    raise TypeError(message)
  try:
    return _differentiable(x, w, bias, scales, call)
  except TypeError as e:
    if not str(e).startswith(_FORWARD_MODE):
      raise
    raise TypeError(message) from e


def _drive(op, x, w, bias, *, x_scale, w_scale, out_dtype, fast_accumulation, w_kmajor, axis_name, algorithm,
           dim, every_result: bool, out_sharding):
  name, arguments = op.name, op.arguments
  _check_algorithm(name, algorithm)
  with _local_shapes(axis_name):
    out_shape = _check_operands(op, x, w, bias, w_kmajor)
    scales, out_name = _check_dtypes(name, x, w, bias, x_scale, w_scale, out_dtype, w_kmajor, fast_accumulation)
  _check_gpu_dtype(name, algorithm, x, w)
  outputs = len(op.results.of_call(scales is not None)) if every_result else 1
  if dim is not None or not arguments.dim_optional:
    of = "x" if arguments.dim_of_x else "output"
    dim = _check_axis(name, arguments.dim, dim, x.ndim if arguments.dim_of_x else len(out_shape),
                      arguments.dim_last, of)
  _check_out_sharding(name, out_sharding, out_shape, axis_name)
  if axis_name is None:
    request = None if out_sharding is None else tuple(spec_of(out_sharding, len(out_shape)))
    call = Call(name, None, 1, algorithm, dim, request, w_kmajor=bool(w_kmajor), outputs=outputs,
                out_dtype=out_name)
    if op.results.gathers:
      scales = _shared_x_scale(scales, None, x)
  else:
    axes, size = axis_group(name, axis_name)
    with _local_shapes(axis_name):
      dim, out_shape = arguments.grouped(dim, x, out_shape, size, axis_name)
    call = Call(name, axes, size, algorithm, dim, w_kmajor=bool(w_kmajor), outputs=outputs, out_dtype=out_name)
    if op.results.gathers:
      scales = _shared_x_scale(scales, axes, x)
    x, w, bias, scales = _varying_operands(axes, x, w, bias, scales)
  if 0 in x.shape or 0 in w.shape:
    results = arguments.empty(x, w, bias, scales, call, out_shape)
  elif algorithm == "xla" or op.xla.required(call):
    results = op.xla.plain(x, w, bias, scales, call)
    results = tuple(results) if op.results.multiple else (results,)
  else:
    taken = _reverse_mode(x, w, bias, scales, call)
    results = taken if outputs > 1 else (taken,)
  results = (_constrain(results[0], out_sharding), *results[1:outputs])
  tagged = tuple(remat.tag(v, tag) for v, tag in zip(results, op.results.tags))
  return tagged[0] if outputs == 1 else tagged


_FP8_ARGS = """
  Float8 operands (x and w both float8: float8_e4m3fn or float8_e5m2 where the GPU has OCP fp8, sm_89+ and
  gfx950; float8_e4m3fnuz or float8_e5m2fnuz on gfx942; one family, not both e5m2):
    x_scale, w_scale: float32 scalars (shape (), or any size-1 shape such as (1,)), required: an operand's value
              is x.astype(float32) * x_scale.
              Inside shard_map each rank's own (ranks may differ: no amax all-reduce is needed before
              quantizing); on global arrays one scale per array. Refused for other dtypes. An ag_matmul
              x_scale that is every rank's (global, or passed into shard_map replicated: invariant over
              axis_name) is shared by the gathered shards, which then take one GEMM per stage and one dot on
              the XLA path instead of one per shard.
              Or block scales (DeepSeek-V3's recipe), float32 arrays for both: x_scale [..., rows, K/128], one
              per row and 128 elements of K; w_scale one per 128x128 tile of w, [K/128, N/128] ([N/128, K/128]
              with w_kmajor); w 2-D, K and N multiples of 128. Each element's value is its block's scale
              times it. Inside shard_map each rank's own blocks of its own operands (ag_matmul gathers them
              with x's rows: gathered_scales [..., T*rows, K/128]); on global arrays sharded as their operands.
              The GPU path is cuBLASLt's block-scaled GEMM on Hopper (sm_90), each GEMM's rows a multiple
              of 4 and, in a group of two or more, x without batch dims; any other call takes the XLA path
              (a float32 dot of the dequantized operands: no fp8 GEMM of XLA's takes block scales).
    out_dtype: the result's dtype, bfloat16 (default), float16 or float32; for other operands None or x's
              dtype. bias is in out_dtype or float32 and added once in float32.
    fast_accumulation: False (default): the GEMM promotes its partial sums to float32 as the K loop goes
              (torch._scaled_mm's default). True (tensor scales only): the vendor's fast fp8 accumulation,
              faster on Hopper and less precise over long K (cuBLASLt's FAST_ACCUM; XLA's fp8 GEMM at
              precision DEFAULT; the forward GEMM of Flax's and TransformerEngine's recipes). AMD's MFMA
              accumulates in float32 either way.
  The GEMM accumulates in float32 with both scales applied. On the XLA path (every format, every backend)
  the operands are converted to float32 and scaled into one dot (per shard, unless shared), the form XLA
  rewrites into its own fp8 GEMM (at precision HIGHEST, or DEFAULT with fast_accumulation). A format the GPU
  cannot run is an error for algorithm="pipelined" naming the dtype and the device, and takes the XLA path under
  "auto"; "fused" is 16-bit only. Differentiating a float8 call raises (its operands are quantized values):
  train through Fp8AgDotGeneral / Fp8RsDotGeneral, or pass algorithm="xla" for JAX's own derivative of the
  plain ops.
  w_kmajor=True: w is stored with the contraction last (every dtype); Hopper's fp8 GEMM takes K-major
  operands only, so on the GPU path a float8 w in the other layout is transposed, one pass of w per call.
"""


def _with_fp8_args(doc: str) -> str:
  """Both dedented: Python >= 3.13 dedents a function's docstring at compile time, not a module's string."""
  return inspect.cleandoc(doc) + "\n\n" + inspect.cleandoc(_FP8_ARGS)


def ag_matmul(x, w, bias=None, *, x_scale=None, w_scale=None, out_dtype=None, fast_accumulation: bool = False,
              w_kmajor: bool = False, axis_name=None, algorithm: str = "auto", return_gathered: bool = False,
              gather_axis: int = -2, out_sharding=None):
  """All-gather x's rows over a mesh axis and multiply by w: the column-parallel linear layer.

  Inside jax.shard_map (axis_name: a bound mesh axis or a tuple of them, T ranks in all):
    x:    [..., m, K] this rank's rows, gathered along gather_axis (any dim but the last; default -2)
    w:    [K, *n] this rank's shard of the weight ([*n, K] with w_kmajor=True); bias: [*n] or None
    returns all_gather(x) @ w + bias [..., T*m, *n] in x's dtype (float8: out_dtype); with return_gathered=True,
    (y, gathered_x[, gathered_scales: float32 [T], each shard's x_scale]).
  With axis_name=None: global arrays under jit, partitioned from the input shardings (docs/api.md) and laid out by
  out_sharding (NamedSharding or PartitionSpec); gathered_scales is then [1].

  algorithm: "auto" (default): a GPU algorithm where the cost model predicts a gain over XLA, else the XLA path;
             "pipelined": the vendor GEMM per chunk of rows while copy engines move the chunks; "fused": one
             persistent kernel of data movers and GEMM tiles; "xla": all_gather + dot as plain JAX ops, no overlap,
             every JAX transformation. The GPU algorithms raise where they cannot run.
  Differentiable in reverse mode (float8: see below) and vmappable; checkpoint names: jax_overlap.remat.

  Example (the column-parallel half of a Megatron MLP; x's rows and w's columns sharded on "tp"):

    import jax, numpy as np
    import jax_overlap
    from jax.sharding import AxisType, PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("tp",), axis_types=(AxisType.Auto,))
    f = jax.jit(jax.shard_map(lambda x, w: jax_overlap.ag_matmul(x, w, axis_name="tp"), mesh=mesh,
                              in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp")))
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((64, 32), np.float32), rng.standard_normal((32, 48), np.float32)  # [M, K], [K, N]
    y = f(x, w)   # x @ w [M, N], its columns on "tp"
    np.testing.assert_allclose(y, x @ w, rtol=1e-4, atol=1e-4)
  """
  return _drive(OPS["ag_matmul"], x, w, bias, x_scale=x_scale, w_scale=w_scale, out_dtype=out_dtype,
                fast_accumulation=fast_accumulation, w_kmajor=w_kmajor, axis_name=axis_name, algorithm=algorithm,
                dim=gather_axis, every_result=return_gathered, out_sharding=out_sharding)


ag_matmul.__doc__ = _with_fp8_args(ag_matmul.__doc__)


def matmul_rs(x, w, bias=None, *, x_scale=None, w_scale=None, out_dtype=None, fast_accumulation: bool = False,
              w_kmajor: bool = False, axis_name=None, algorithm: str = "auto", scatter_axis: int | None = None,
              out_sharding=None):
  """Multiply by w and reduce-scatter the partial products: the row-parallel linear layer.

  Inside jax.shard_map (axis_name bound, T ranks):
    x:    [..., M, *k] with the contraction k sharded; w: [*k, N] this rank's shard ([N, *k] with w_kmajor=True)
    bias: [N] or None, added once after the reduction
    returns psum_scatter(x @ w) + bias [..., M/T, N] in x's dtype (float8: out_dtype), scattered onto scatter_axis
    (default -2; divisible by T; -1 takes the XLA path, adding this rank's block of bias).
  With axis_name=None: global arrays under jit, partitioned from the input shardings (docs/api.md) and scattered
  onto scatter_axis, else the dim out_sharding shards, else the rows.

  algorithm: as ag_matmul's: "auto" (default): a GPU algorithm where it gains, else the XLA path; "pipelined": the
             vendor GEMM per chunk of rows; "fused": one persistent kernel; "xla": dot + psum_scatter as plain JAX
             ops. Every path rounds each rank's partial to the result's dtype (float16's stay float32) and sums them
             in float32 in rank order.
  Differentiable in reverse mode (float8: see below) and vmappable; checkpoint name "jax_overlap.matmul_rs".

  Example (the row-parallel half of a Megatron MLP; h's and w's contraction sharded on "tp"):

    import jax, numpy as np
    import jax_overlap
    from jax.sharding import AxisType, PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("tp",), axis_types=(AxisType.Auto,))
    f = jax.jit(jax.shard_map(lambda h, w: jax_overlap.matmul_rs(h, w, axis_name="tp"), mesh=mesh,
                              in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None)))
    rng = np.random.default_rng(0)
    h, w = rng.standard_normal((64, 48), np.float32), rng.standard_normal((48, 32), np.float32)  # [M, F], [F, N]
    z = f(h, w)   # h @ w [M, N], its rows on "tp"
    np.testing.assert_allclose(z, h @ w, rtol=1e-4, atol=1e-4)
  """
  return _drive(OPS["matmul_rs"], x, w, bias, x_scale=x_scale, w_scale=w_scale, out_dtype=out_dtype,
                fast_accumulation=fast_accumulation, w_kmajor=w_kmajor, axis_name=axis_name, algorithm=algorithm,
                dim=scatter_axis, every_result=False, out_sharding=out_sharding)


matmul_rs.__doc__ = _with_fp8_args(matmul_rs.__doc__)


def _shared_x_scale(scales, axes, x):
  """scales, x_shared where every rank's x_scale is one value: global, or invariant over `axes` while x varies."""
  if scales is None or scales.scaling.follows_x:
    return scales
  shared = axes is None or (set(axes) <= _compat.varying_axes(x) and not set(axes) & _compat.varying_axes(scales.x))
  return dataclasses.replace(scales, scaling=scales.scaling.sharing_x(shared))


def _varying_operands(axes, x, w, bias, scales) -> tuple:
  if scales is None:
    return (*autodiff.varying(axes, x, w, bias), None)
  x, w, bias, x_scale, w_scale = autodiff.varying(axes, x, w, bias, scales.x, scales.w)
  return x, w, bias, dataclasses.replace(scales, x=x_scale, w=w_scale)


def all_gather(x, *, axis_name):
  """The runtime's all-gather of x's rows (axis -2, tiled) inside shard_map; lax.all_gather without a GPU build.

  Example (x's rows gathered over "tp"):

    import jax, numpy as np
    import jax_overlap
    from jax.sharding import AxisType, PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("tp",), axis_types=(AxisType.Auto,))
    f = jax.jit(jax.shard_map(lambda x: jax_overlap.all_gather(x, axis_name="tp"), mesh=mesh, in_specs=P("tp"),
                              out_specs=P("tp")))
    x = np.arange(64, dtype=np.float32).reshape(16, 4)
    copies = f(x).reshape(jax.device_count(), 16, 4)   # each rank's gathered x
    np.testing.assert_array_equal(copies, np.broadcast_to(x, copies.shape))
  """
  if not hasattr(x, "ndim") or x.ndim < 2:
    raise ValueError(f"jax_overlap.all_gather: x must have rank >= 2, got {getattr(x, 'shape', x)}")
  axes, size = axis_group("all_gather", axis_name)
  (x,) = autodiff.varying(axes, x)
  return all_gather_op.bind(x, axis_name=axes, axis_size=size)
