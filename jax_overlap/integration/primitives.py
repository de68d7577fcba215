"""The rules every GEMM op's primitive shares. axis_name None: the local product; scaling None: 16-bit; out_specs: a
global call's Explicit output types. Rules run untyped (_sharding.py says why)."""

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


def result_aval(x, shape, spec, dtype=None):
  """x's aval (its varying axes) with `shape`, `dtype` and, on an Explicit mesh, `spec`: XLA adds no reshard after."""
  dtype = x.dtype if dtype is None else np.dtype(dtype)
  x_sharding = getattr(x, "sharding", None)
  if x_sharding is None:
    return x.update(shape=shape, dtype=dtype)
  if spec is None or _sharding.explicit_mesh(x) is None:
    spec = P(*([None] * len(shape)))
  return x.update(shape=shape, dtype=dtype, sharding=x_sharding.update(spec=spec))


def result_specs(out_specs, count: int) -> tuple:
  out_specs = tuple(out_specs or ())
  return out_specs + (None,) * (count - len(out_specs))


def along_x(has_bias: bool, scaling) -> tuple:
  """The operands a batch folds into x's leading dims with: x, and x_scale where it follows x."""
  return (0, 2 + has_bias) if scaling is not None and scaling.follows_x else (0,)


def _batch_rule(op, args, dims, **params):
  # Batched weights or bias are a matrix per element: only the reference, vmapped, computes that.
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


# The custom VJPs (api.py) never differentiate these primitives: only a second derivative asks for a jvp.

def unsupported(op_name: str, what: str, algorithm: str) -> str:
  return (f"jax_overlap.{op_name}: {what} is not supported with algorithm={algorithm!r}, whose custom VJP serves "
          f"first-order reverse mode (jax.grad, jax.vjp, jax.linearize); pass algorithm='xla' (the XLA path as "
          f"plain JAX ops, which every JAX transformation takes)")


def _no_jvp(op_name, primals, tangents, *, algorithm, **params):
  del primals, tangents, params
  raise NotImplementedError(unsupported(op_name, "a second derivative (jax.hessian, jax.grad of jax.grad)",
                                        algorithm))


def untyped_lowering(rule):
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
  """The GPU lowering takes w as a matrix: other ranks are reshaped around it (free views)."""
  del out_specs
  dtype_name = formats.name(ctx.avals_in[0].dtype)
  if params["algorithm"] == "auto" and not formats.gpu_capable(dtype_name):
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


def register_rules(prim, abstract_eval, batch_rule, default_lowering, gpu_lowering) -> None:
  prim.def_impl(_compat.apply_primitive(prim))
  prim.def_abstract_eval(abstract_eval)
  batching.primitive_batchers[prim] = batch_rule
  mlir.register_lowering(prim, default_lowering)
  for platform in ("cuda", "rocm"):
    mlir.register_lowering(prim, gpu_lowering, platform=platform)


def register(op) -> None:
  register_rules(op.rules.primitive, op.rules.abstract_eval, functools.partial(_batch_rule, op),
                 untyped_lowering(functools.partial(_default_lowering, op=op)),
                 untyped_lowering(functools.partial(_gpu_lowering, op=op)))
  ad.primitive_jvps[op.rules.primitive] = functools.partial(_no_jvp, op.name)
