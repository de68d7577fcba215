"""How a GEMM op's primitive is defined to JAX: impl, batching, differentiation's refusal and lowering per platform.

Each op (ops/op.py) holds its primitive and what is its own: the abstract
eval, the reference decomposition, the matrix view of its weights. register(op)
adds the rules every GEMM op shares:
  impl       JAX's own dispatch
  batching   a batched x alone folds into x's leading dims (the ops take any);
             batched weights or bias mean a different matrix per element: the
             reference decomposition, vmapped
  jvp        an error that says what to use (see "differentiation" below)
  lowering   on "cuda"/"rocm" lowering.py picks the algorithm (pipelined,
             fused, or the reference decomposition) and emits its custom call,
             weights of other ranks than 2 reshaped to a matrix first; on every
             other platform, the reference decomposition
Operands of every GEMM op: x, w, [bias], [x_scale, w_scale] (Operands names
them; the scales of float8 x and w, as their Scaling lays them out). Params:
axis_name (tuple of mesh axes, or None for the local product), axis_size (the
group size), algorithm, w_kmajor (w stored with the contraction last),
has_bias, scaling (the Scaling of float8 operands' scales, None for 16-bit
ones), out_dtype (the result's dtype name: x's for 16-bit operands) and
out_specs (the Explicit-mesh output types of a global-array call, else None).
Every rule runs on operand types without Explicit shardings (_sharding.py says
why).

A float8 format the GPU cannot run (quantization/formats.py) takes the XLA
path under "auto" and is an error for an explicit GPU algorithm (api.py says
so at trace time, naming the device; the lowering again, for a device it had
not seen).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad, batching, mlir
from jax.sharding import PartitionSpec as P

from jax_overlap import _compat, _sharding, planning
from jax_overlap.integration import lowering
from jax_overlap.integration.operands import split_operands
from jax_overlap.quantization import formats

log = logging.getLogger("jax_overlap")


# --- abstract evaluation ----------------------------------------------------
# Outputs take x's type (and with it the manual-axis varying set) with a new
# shape. Global arrays on a mesh with Explicit axes carry their sharding in the
# type: `out_specs` (one PartitionSpec per result, from the op's sharding plan
# via partitioning.py) types the outputs the way the custom partitioning lays
# them out, so XLA adds no reshard after it. Elsewhere every output dim is unsharded.

def result_aval(x, shape, spec, dtype=None):
  """An aval of x's type with `shape` (and `dtype`, else x's), sharded by `spec` on an Explicit mesh, else
  unsharded."""
  dtype = x.dtype if dtype is None else np.dtype(dtype)
  x_sharding = getattr(x, "sharding", None)
  if x_sharding is None:
    return x.update(shape=shape, dtype=dtype)
  if spec is None or _sharding.explicit_mesh(x) is None:
    spec = P(*([None] * len(shape)))
  return x.update(shape=shape, dtype=dtype, sharding=x_sharding.update(spec=spec))


def result_specs(out_specs, count: int) -> tuple:
  """One spec per result: out_specs' (a global call's partitioned results), None (unsharded) for the rest."""
  out_specs = tuple(out_specs or ())
  return out_specs + (None,) * (count - len(out_specs))


# --- batching ---------------------------------------------------------------

def along_x(has_bias: bool, scaling) -> tuple:
  """The operand indices that a batch can fold into x's leading dims: x, and x_scale where it follows x."""
  return (0, 2 + has_bias) if scaling is not None and scaling.follows_x else (0,)


def _batch_rule(op, args, dims, **params):
  # x's own leading dims take the batch: x batched (and scales that follow x batched alike), the weights not.
  along = along_x(params["has_bias"], params["scaling"])
  if any(dims[i] is not None for i in along) and all(d is None for i, d in enumerate(dims) if i not in along):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    args = [(jnp.broadcast_to(a, (size, *a.shape)) if dims[i] is None else jnp.moveaxis(a, dims[i], 0))
            if i in along else a for i, a in enumerate(args)]
    out = op.rules.primitive.bind(*args, **params)
    if not op.results.multiple:
      return out, 0
    return out, op.results.batch_dims(params["scaling"])
  out = jax.vmap(functools.partial(_reference_call, op, **params), in_axes=tuple(dims))(*args)
  return out, jax.tree.map(lambda _: 0, out)


def _reference_call(op, *args, axis_name, axis_size, algorithm, w_kmajor, has_bias, scaling, out_dtype,
                    out_specs=None):
  del axis_size, algorithm, out_specs
  x, w, bias, scales = split_operands(args, has_bias, scaling)
  return op.xla.reference(x, w, bias, scales, axis_name=axis_name, w_kmajor=w_kmajor, out_dtype=out_dtype)


# --- differentiation ---------------------------------------------------------
# The custom VJPs (api.py) differentiate the ops once, in reverse mode, without
# differentiating these primitives. A rule is asked for only when something
# differentiates that VJP's own forward or backward pass (jax.hessian, grad of
# grad), which the fused algorithms do not support: it says so, and what does.

def unsupported(op_name: str, what: str, algorithm: str) -> str:
  """The message for a transformation a call with `algorithm` cannot take."""
  return (f"jax_overlap.{op_name}: {what} is not supported with algorithm={algorithm!r}, whose custom VJP serves "
          f"first-order reverse mode (jax.grad, jax.vjp, jax.linearize); pass algorithm='xla' (the XLA path as "
          f"plain JAX ops, which every JAX transformation takes)")


def _no_jvp(op_name, primals, tangents, *, algorithm, **params):
  del primals, tangents, params
  raise NotImplementedError(unsupported(op_name, "a second derivative (jax.hessian, jax.grad of jax.grad)",
                                        algorithm))


# --- lowering ---------------------------------------------------------------

def untyped_lowering(rule):
  """rule, run on operand and result types without Explicit shardings (_sharding.py)."""
  def lower(ctx, *args, **params):
    ctx = ctx.replace(avals_in=[_sharding.untyped(a) for a in ctx.avals_in],
                      avals_out=[_sharding.untyped(a) for a in ctx.avals_out])
    with _sharding.auto_axes():
      return rule(ctx, *args, **params)
  return lower


def lower_reference(ctx, *args, op, **params):
  fn = functools.partial(_reference_call, op, **params)
  return mlir.lower_fun(fn, multiple_results=op.results.multiple)(ctx, *args)


def _default_lowering(ctx, *args, op, **params):
  platforms = ", ".join(ctx.module_context.platforms)
  if params["algorithm"] in formats.GPU_ALGORITHMS:
    raise ValueError(f"jax_overlap.{op.name}: algorithm={params['algorithm']!r} runs on GPU, but this computation "
                     f"is lowered for {platforms}; use algorithm='auto' or 'xla'")
  log.debug("jax_overlap.%s: XLA path (lowered for %s)", op.name, platforms)
  return lower_reference(ctx, *args, op=op, **params)


def _gpu_lowering(ctx, *args, op, out_specs, **params):
  """The GPU lowering, which takes w as a matrix: other weights are reshaped around it (row-major views, free)."""
  del out_specs  # types only the global-array trace, never a lowered (local) call
  dtype_name = formats.name(ctx.avals_in[0].dtype)
  if params["algorithm"] == "auto" and not formats.gpu_capable(dtype_name):
    # Such dtypes serve checks on the XLA path; the GPU algorithms' planning has no figures for them.
    log.debug("jax_overlap.%s: XLA path (%s; the GPU algorithms take %s)", op.name, dtype_name,
              ", ".join(formats.dtypes_for("pipelined")))
    return lower_reference(ctx, *args, op=op, **params)
  declined = planning.fp8_declined(ctx.avals_in[0].dtype, ctx.avals_in[1].dtype)
  if declined and params["algorithm"] != "xla":
    if params["algorithm"] != "auto":
      raise ValueError(f"jax_overlap.{op.name}: algorithm={params['algorithm']!r} cannot run {declined}; use "
                       f"algorithm='auto' or 'xla' (the XLA path serves every float8 format)")
    log.debug("jax_overlap.%s: XLA path (%s)", op.name, declined)
    return lower_reference(ctx, *args, op=op, **params)
  if ctx.avals_in[1].ndim == 2:
    out = lowering.gpu_rule(ctx, *args, op=op, **params)
    return lower_reference(ctx, *args, op=op, **params) if out is None else out
  return mlir.lower_fun(functools.partial(op.rules.as_matrix, **params),
                        multiple_results=op.results.multiple)(ctx, *args)


# --- registration ---------------------------------------------------------------

def register_rules(prim, abstract_eval, batch_rule, default_lowering, gpu_lowering) -> None:
  """Registers a primitive's eager implementation (JAX's dispatch), abstract evaluation, batching rule and
  lowerings: `gpu_lowering` on "cuda" and "rocm", `default_lowering` elsewhere."""
  prim.def_impl(_compat.apply_primitive(prim))
  prim.def_abstract_eval(abstract_eval)
  batching.primitive_batchers[prim] = batch_rule
  mlir.register_lowering(prim, default_lowering)
  for platform in ("cuda", "rocm"):
    mlir.register_lowering(prim, gpu_lowering, platform=platform)


def register(op) -> None:
  """Registers the rules above for the primitive of `op`, a GEMM Op (ops/op.py)."""
  register_rules(op.rules.primitive, op.rules.abstract_eval, functools.partial(_batch_rule, op),
                 untyped_lowering(functools.partial(_default_lowering, op=op)),
                 untyped_lowering(functools.partial(_gpu_lowering, op=op)))
  ad.primitive_jvps[op.rules.primitive] = functools.partial(_no_jvp, op.name)
