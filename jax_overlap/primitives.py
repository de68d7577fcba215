"""How a GEMM op's primitive is defined to JAX: impl, batching, differentiation's refusal and lowering per platform.

Each op module (ops/) holds its primitive and what is its own: the abstract
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
Params of every GEMM op: axis_name (tuple of mesh axes, or None for the local
product), axis_size (the group size), algorithm, w_kmajor (w stored with the
contraction last) and out_specs (the Explicit-mesh output types of a
global-array call, else None). Every rule runs on operand types without
Explicit shardings (sharding.py says why).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from jax.interpreters import ad, batching, mlir
from jax.sharding import PartitionSpec as P

from jax_overlap import _compat, dtypes, lowering, sharding

log = logging.getLogger("jax_overlap")


# --- abstract evaluation ----------------------------------------------------
# Outputs take x's type (and with it the manual-axis varying set) with a new
# shape. Global arrays on a mesh with Explicit axes carry their sharding in the
# type: `out_specs` (one PartitionSpec per result, from the op's sharding plan
# via partitioning.py) types the outputs the way the custom partitioning lays
# them out, so XLA adds no reshard after it. Elsewhere every output dim is unsharded.

def result_aval(x, shape, spec):
  """An aval of x's type with `shape`, sharded by `spec` on an Explicit mesh, else unsharded."""
  x_sharding = getattr(x, "sharding", None)
  if x_sharding is None:
    return x.update(shape=shape)
  if spec is None or sharding.explicit_mesh(x) is None:
    spec = P(*([None] * len(shape)))
  return x.update(shape=shape, sharding=x_sharding.update(spec=spec))


def result_specs(out_specs, count: int) -> tuple:
  return tuple(out_specs) if out_specs is not None else (None,) * count


# --- batching ---------------------------------------------------------------

def _batch_rule(op, args, dims, **params):
  x, *rest = args
  dx, *drest = dims
  out_dims = (0, 0) if op.primitive.multiple_results else 0
  if all(d is None for d in drest):
    return op.primitive.bind(jnp.moveaxis(x, dx, 0), *rest, **params), out_dims
  return jax.vmap(functools.partial(_reference_call, op, **params), in_axes=tuple(dims))(*args), out_dims


def _reference_call(op, x, w, *bias, axis_name, axis_size, algorithm, w_kmajor, out_specs=None):
  del axis_size, algorithm, out_specs
  return op.reference(x, w, bias[0] if bias else None, axis_name=axis_name, w_kmajor=w_kmajor)


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

def _untyped_lowering(rule):
  """rule, run on operand and result types without Explicit shardings (sharding.py)."""
  def lower(ctx, *args, **params):
    ctx = ctx.replace(avals_in=[sharding.untyped(a) for a in ctx.avals_in],
                      avals_out=[sharding.untyped(a) for a in ctx.avals_out])
    with sharding.auto_axes():
      return rule(ctx, *args, **params)
  return lower


def lower_reference(ctx, *args, op, **params):
  fn = functools.partial(_reference_call, op, **params)
  return mlir.lower_fun(fn, multiple_results=op.primitive.multiple_results)(ctx, *args)


def _default_lowering(ctx, *args, op, **params):
  platforms = ", ".join(ctx.module_context.platforms)
  if params["algorithm"] in dtypes.GPU_ALGORITHMS:
    raise ValueError(f"jax_overlap.{op.NAME}: algorithm={params['algorithm']!r} runs on GPU, but this computation "
                     f"is lowered for {platforms}; use algorithm='auto' or 'xla'")
  log.debug("jax_overlap.%s: XLA path (lowered for %s)", op.NAME, platforms)
  return lower_reference(ctx, *args, op=op, **params)


def _gpu_lowering(ctx, *args, op, out_specs, **params):
  """The GPU lowering, which takes w as a matrix: other weights are reshaped around it (row-major views, free)."""
  del out_specs  # types only the global-array trace, never a lowered (local) call
  dtype_name = dtypes.name(ctx.avals_in[0].dtype)
  if params["algorithm"] == "auto" and not dtypes.gpu_capable(dtype_name):
    # Such dtypes serve checks on the XLA path; the GPU algorithms' planning has no figures for them.
    log.debug("jax_overlap.%s: XLA path (%s; the GPU algorithms take %s)", op.NAME, dtype_name,
              " and ".join(dtypes.dtypes_for("pipelined")))
    return lower_reference(ctx, *args, op=op, **params)
  if ctx.avals_in[1].ndim == 2:
    out = lowering.gpu_rule(ctx, *args, op=op, **params)
    return lower_reference(ctx, *args, op=op, **params) if out is None else out
  return mlir.lower_fun(functools.partial(op.as_matrix, **params),
                        multiple_results=op.primitive.multiple_results)(ctx, *args)


def register(op) -> None:
  """Registers the rules above for the primitive of `op`, a GEMM op module (ops/)."""
  prim = op.primitive
  prim.def_impl(_compat.apply_primitive(prim))
  prim.def_abstract_eval(op.abstract_eval)
  batching.primitive_batchers[prim] = functools.partial(_batch_rule, op)
  ad.primitive_jvps[prim] = functools.partial(_no_jvp, op.NAME)
  mlir.register_lowering(prim, _untyped_lowering(functools.partial(_default_lowering, op=op)))
  for platform in ("cuda", "rocm"):
    mlir.register_lowering(prim, _untyped_lowering(functools.partial(_gpu_lowering, op=op)), platform=platform)
