"""JAX primitives of the fused ops: abstract eval, batching and lowering per platform.

  ag_matmul_p(x, w[, bias]) -> (y, gathered)   y = all_gather(x, -2) @ w + bias
  matmul_rs_p(x, w[, bias]) -> z               z = psum_scatter(x @ w, -2) + bias
  all_gather_p(x) -> gathered                  the runtime's all-gather (tests)

Params: axis_name (tuple of mesh axes, or None for the local product),
axis_size (the group size), algorithm, and w_kmajor (w given as [n, k]).
Lowering: on "cuda"/"rocm" gpu_lowering.py picks the algorithm (fused,
pipelined, or the XLA reference decomposition) and emits its custom call; on
every other platform, the reference decomposition (reference.py). Autodiff
lives in api.py (custom VJPs built from these primitives).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.interpreters import batching, mlir

from jax.sharding import AxisType, NamedSharding

from jax_overlap import gpu_lowering, reference, sharding_plan

ag_matmul_p = jex_core.Primitive("jax_overlap_ag_matmul")
ag_matmul_p.multiple_results = True
matmul_rs_p = jex_core.Primitive("jax_overlap_matmul_rs")
all_gather_p = jex_core.Primitive("jax_overlap_all_gather")


def _bias_args(bias):
  return () if bias is None else (bias,)


def ag_matmul(x, w, bias, *, axis_name, axis_size, algorithm, w_kmajor=False):
  y, gathered = ag_matmul_p.bind(x, w, *_bias_args(bias), axis_name=axis_name, axis_size=axis_size,
                                 algorithm=algorithm, w_kmajor=w_kmajor)
  return y, gathered


def matmul_rs(x, w, bias, *, axis_name, axis_size, algorithm, w_kmajor=False):
  return matmul_rs_p.bind(x, w, *_bias_args(bias), axis_name=axis_name, axis_size=axis_size,
                          algorithm=algorithm, w_kmajor=w_kmajor)


def all_gather(x, *, axis_name, axis_size):
  return all_gather_p.bind(x, axis_name=axis_name, axis_size=axis_size)


# --- abstract evaluation ----------------------------------------------------
# Outputs keep x's rank, so they take x's type (and with it the manual-axis
# varying set) with a new shape. Global arrays on a mesh with Explicit axes
# carry their sharding in the type: the outputs get the sharding the custom
# partitioning produces (sharding_plan.py), so XLA adds no reshard after it.

def _n_of(w, w_kmajor):
  return w.shape[0] if w_kmajor else w.shape[1]


def _explicit_mesh(x):
  mesh = getattr(getattr(x, "sharding", None), "mesh", None)
  types = getattr(mesh, "axis_types", ())
  return mesh if any(t == AxisType.Explicit for t in types) else None


def _ag_abstract_eval(x, w, *bias, axis_name, axis_size, algorithm, w_kmajor):
  del algorithm, bias
  *lead, m, k = x.shape
  rows = axis_size * m
  y, g = x.update(shape=(*lead, rows, _n_of(w, w_kmajor))), x.update(shape=(*lead, rows, k))
  mesh = _explicit_mesh(x) if axis_name is None else None
  if mesh is not None:
    plan = sharding_plan.ag_plan(mesh, sharding_plan.spec_of(x.sharding, x.ndim),
                                 sharding_plan.spec_of(w.sharding, 2), w_kmajor)
    y, g = y.update(sharding=NamedSharding(mesh, plan[4])), g.update(sharding=NamedSharding(mesh, plan[5]))
  return y, g


def _rs_abstract_eval(x, w, *bias, axis_name, axis_size, algorithm, w_kmajor):
  del algorithm, bias
  *lead, m, _ = x.shape
  z = x.update(shape=(*lead, m // axis_size, _n_of(w, w_kmajor)))
  mesh = _explicit_mesh(x) if axis_name is None else None
  if mesh is not None:
    plan = sharding_plan.rs_plan(mesh, sharding_plan.spec_of(x.sharding, x.ndim),
                                 sharding_plan.spec_of(w.sharding, 2), w_kmajor, m)
    z = z.update(sharding=NamedSharding(mesh, plan[4]))
  return z


def _gather_abstract_eval(x, *, axis_name, axis_size):
  del axis_name
  *lead, m, c = x.shape
  return x.update(shape=(*lead, axis_size * m, c))


# --- batching ---------------------------------------------------------------
# x may carry any leading batch dims, so a batched x alone folds into them.
# Batched weights or bias mean a different matrix per element: the reference
# decomposition, vmapped.

def _batch_rule(prim, reference_fn, args, dims, **params):
  x, *rest = args
  dx, *drest = dims
  if all(d is None for d in drest):
    return prim.bind(jnp.moveaxis(x, dx, 0), *rest, **params), (0, 0) if prim.multiple_results else 0
  fn = functools.partial(_reference_call, reference_fn, **params)
  out = jax.vmap(fn, in_axes=tuple(dims))(*args)
  return out, (0, 0) if prim.multiple_results else 0


def _reference_call(reference_fn, x, w, *bias, axis_name, axis_size, algorithm, w_kmajor):
  del axis_size, algorithm
  return reference_fn(x, w, bias[0] if bias else None, axis_name=axis_name, w_kmajor=w_kmajor)


def _gather_batch_rule(args, dims, *, axis_name, axis_size):
  (x,), (dx,) = args, dims
  return all_gather_p.bind(jnp.moveaxis(x, dx, 0), axis_name=axis_name, axis_size=axis_size), 0


# --- lowering ---------------------------------------------------------------

def _lower_reference(ctx, *args, op, **params):
  reference_fn = reference.ag_matmul if op == "ag_matmul" else reference.matmul_rs
  fn = functools.partial(_reference_call, reference_fn, **params)
  return mlir.lower_fun(fn, multiple_results=op == "ag_matmul")(ctx, *args)


def _default_lowering(ctx, *args, op, **params):
  if params["algorithm"] in ("fused", "pipelined"):
    raise ValueError(f"jax_overlap.{op}: algorithm={params['algorithm']!r} runs on GPU, but this computation is "
                     f"lowered for {', '.join(ctx.module_context.platforms)}; use algorithm='auto' or 'xla'")
  return _lower_reference(ctx, *args, op=op, **params)


def _gather_default_lowering(ctx, x, *, axis_name, axis_size):
  del axis_size
  fn = lambda v: jax.lax.all_gather(v, axis_name, axis=v.ndim - 2, tiled=True)
  return mlir.lower_fun(fn, multiple_results=False)(ctx, x)


def _register():
  from jax._src import dispatch  # eager application and device assignment at lowering
  for prim, abstract_eval, op, ref in ((ag_matmul_p, _ag_abstract_eval, "ag_matmul", reference.ag_matmul),
                                       (matmul_rs_p, _rs_abstract_eval, "matmul_rs", reference.matmul_rs)):
    prim.def_impl(functools.partial(dispatch.apply_primitive, prim))
    prim.def_abstract_eval(abstract_eval)
    batching.primitive_batchers[prim] = functools.partial(_batch_rule, prim, ref)
    mlir.register_lowering(prim, functools.partial(_default_lowering, op=op))
    for platform in ("cuda", "rocm"):
      mlir.register_lowering(prim, functools.partial(gpu_lowering.gpu_rule, op=op, lower_reference=_lower_reference),
                             platform=platform)
  all_gather_p.def_impl(functools.partial(dispatch.apply_primitive, all_gather_p))
  all_gather_p.def_abstract_eval(_gather_abstract_eval)
  batching.primitive_batchers[all_gather_p] = _gather_batch_rule
  mlir.register_lowering(all_gather_p, _gather_default_lowering)
  for platform in ("cuda", "rocm"):
    mlir.register_lowering(all_gather_p, functools.partial(gpu_lowering.gather_gpu_rule,
                                                           lower_default=_gather_default_lowering),
                           platform=platform)


_register()
