"""JAX primitives of the fused ops: abstract eval, batching and lowering per platform.

  ag_matmul_p(x, w[, bias]) -> (y, gathered)   y = all_gather(x, -2) @ w + bias
  matmul_rs_p(x, w[, bias]) -> z               z = psum_scatter(x @ w, -2) + bias
  all_gather_p(x) -> gathered                  the runtime's all-gather (tests)

Shapes: ag_matmul x [..., m, K], w [K, *n], bias [*n]; matmul_rs x [..., M, *k],
w [*k, N], bias [N] (see reference.py). Params: axis_name (tuple of mesh axes,
or None for the local product), axis_size (the group size), algorithm,
w_kmajor (w stored with the contraction last: [*n, K], [N, *k]) and out_specs
(the Explicit-mesh output types of a global-array call, else None).
Lowering: on "cuda"/"rocm" gpu_lowering.py picks the algorithm (pipelined,
fused, or the XLA reference decomposition) and emits its custom call (weights
of other ranks than 2 are reshaped to a matrix first); on every other
platform, the reference decomposition (reference.py). Autodiff lives in api.py
(custom VJPs built from these primitives).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from jax.sharding import AxisType, PartitionSpec as P

from jax_overlap import _compat, gpu_lowering, reference

log = logging.getLogger("jax_overlap")

ag_matmul_p = jex_core.Primitive("jax_overlap_ag_matmul")
ag_matmul_p.multiple_results = True
matmul_rs_p = jex_core.Primitive("jax_overlap_matmul_rs")
all_gather_p = jex_core.Primitive("jax_overlap_all_gather")


def _bias_args(bias):
  return () if bias is None else (bias,)


def ag_matmul(x, w, bias, *, axis_name, axis_size, algorithm, w_kmajor=False, out_specs=None):
  y, gathered = ag_matmul_p.bind(x, w, *_bias_args(bias), axis_name=axis_name, axis_size=axis_size,
                                 algorithm=algorithm, w_kmajor=w_kmajor, out_specs=out_specs)
  return y, gathered


def matmul_rs(x, w, bias, *, axis_name, axis_size, algorithm, w_kmajor=False, out_specs=None):
  return matmul_rs_p.bind(x, w, *_bias_args(bias), axis_name=axis_name, axis_size=axis_size,
                          algorithm=algorithm, w_kmajor=w_kmajor, out_specs=out_specs)


def all_gather(x, *, axis_name, axis_size):
  return all_gather_p.bind(x, axis_name=axis_name, axis_size=axis_size)


# --- abstract evaluation ----------------------------------------------------
# Outputs take x's type (and with it the manual-axis varying set) with a new
# shape. Global arrays on a mesh with Explicit axes carry their sharding in the
# type: `out_specs` (one PartitionSpec per result, from sharding_plan.py via
# partitioning.py) types the outputs the way the custom partitioning lays them
# out, so XLA adds no reshard after it. Elsewhere every output dim is unsharded.

def _n_of(w, w_kmajor):
  """Output columns of a canonical (2-D) w."""
  return w.shape[0] if w_kmajor else w.shape[1]


def _explicit_mesh(x):
  mesh = getattr(getattr(x, "sharding", None), "mesh", None)
  types = getattr(mesh, "axis_types", ())
  return mesh if any(t == AxisType.Explicit for t in types) else None


def _result(x, shape, spec):
  """An aval of x's type with `shape`, sharded by `spec` on an Explicit mesh, else unsharded."""
  sharding = getattr(x, "sharding", None)
  if sharding is None:
    return x.update(shape=shape)
  if spec is None or _explicit_mesh(x) is None:
    spec = P(*([None] * len(shape)))
  return x.update(shape=shape, sharding=sharding.update(spec=spec))


def _specs(out_specs, count):
  return tuple(out_specs) if out_specs is not None else (None,) * count


def _ag_abstract_eval(x, w, *bias, axis_name, axis_size, algorithm, w_kmajor, out_specs):
  del algorithm, bias, axis_name
  *lead, m, k = x.shape
  n = w.shape[:-1] if w_kmajor else w.shape[1:]
  y_spec, g_spec = _specs(out_specs, 2)
  return (_result(x, (*lead, axis_size * m, *n), y_spec), _result(x, (*lead, axis_size * m, k), g_spec))


def _rs_abstract_eval(x, w, *bias, axis_name, axis_size, algorithm, w_kmajor, out_specs):
  del algorithm, bias, axis_name
  contract = w.ndim - 1
  *lead, m = x.shape[:x.ndim - contract]
  n = w.shape[0] if w_kmajor else w.shape[-1]
  (z_spec,) = _specs(out_specs, 1)
  return _result(x, (*lead, m // axis_size, n), z_spec)


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


def _reference_call(reference_fn, x, w, *bias, axis_name, axis_size, algorithm, w_kmajor, out_specs=None):
  del axis_size, algorithm, out_specs
  return reference_fn(x, w, bias[0] if bias else None, axis_name=axis_name, w_kmajor=w_kmajor)


def _gather_batch_rule(args, dims, *, axis_name, axis_size):
  (x,), (dx,) = args, dims
  return all_gather_p.bind(jnp.moveaxis(x, dx, 0), axis_name=axis_name, axis_size=axis_size), 0


# --- differentiation ---------------------------------------------------------
# The custom VJPs (api.py) differentiate the ops once, in reverse mode, without
# differentiating these primitives. A rule is asked for only when something
# differentiates that VJP's own forward or backward pass (jax.hessian, grad of
# grad), which the fused algorithms do not support: it says so, and what does.

def unsupported(op: str, what: str, algorithm: str) -> str:
  """The message for a transformation a call with `algorithm` cannot take."""
  return (f"jax_overlap.{op}: {what} is not supported with algorithm={algorithm!r}, whose custom VJP serves "
          f"first-order reverse mode (jax.grad, jax.vjp, jax.linearize); pass algorithm='xla' (the XLA path as "
          f"plain JAX ops, which every JAX transformation takes)")


def _no_jvp(op, primals, tangents, *, algorithm, **params):
  del primals, tangents, params
  raise NotImplementedError(unsupported(op, "a second derivative (jax.hessian, jax.grad of jax.grad)", algorithm))


# --- lowering ---------------------------------------------------------------

# A lowering sees the operands' types. On a mesh with Explicit axes those carry
# shardings that the local computation below must not be typed by: a call of a
# one-device mesh is inlined by JAX with its global operand types (x's rows and w's
# columns on one axis make the local dot_general an illegal sharding), and a
# custom partitioning's body is lowered under the caller's mesh, where the
# reducer of a collective would be typed too (XLA's CPU collectives accept only a
# plain binary reducer). So every lowering rule below runs with those axes Auto:
# operand types without shardings, and the context mesh's Explicit axes Auto.

def _auto_axes(mesh):
  explicit = {name: AxisType.Auto for name, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}
  return mesh.update_axis_types(explicit) if explicit else mesh


def _untyped(aval):
  mesh = _explicit_mesh(aval)
  if mesh is None:
    return aval
  return aval.update(sharding=aval.sharding.update(mesh=_auto_axes(mesh), spec=P()))


@contextlib.contextmanager
def auto_axes():
  """The current abstract mesh with its Explicit axes Auto: ops traced inside carry no sharding in their types."""
  mesh = jax.sharding.get_abstract_mesh()
  with jax.sharding.use_abstract_mesh(_auto_axes(mesh)):
    yield


def _untyped_lowering(rule):
  """rule, run on operand and result types without Explicit shardings (see above)."""
  def lower(ctx, *args, **params):
    ctx = ctx.replace(avals_in=[_untyped(a) for a in ctx.avals_in], avals_out=[_untyped(a) for a in ctx.avals_out])
    with auto_axes():
      return rule(ctx, *args, **params)
  return lower


def _lower_reference(ctx, *args, op, **params):
  reference_fn = reference.ag_matmul if op == "ag_matmul" else reference.matmul_rs
  fn = functools.partial(_reference_call, reference_fn, **params)
  return mlir.lower_fun(fn, multiple_results=op == "ag_matmul")(ctx, *args)


def _default_lowering(ctx, *args, op, **params):
  platforms = ", ".join(ctx.module_context.platforms)
  if params["algorithm"] in ("fused", "pipelined"):
    raise ValueError(f"jax_overlap.{op}: algorithm={params['algorithm']!r} runs on GPU, but this computation is "
                     f"lowered for {platforms}; use algorithm='auto' or 'xla'")
  log.debug("jax_overlap.%s: XLA path (lowered for %s)", op, platforms)
  return _lower_reference(ctx, *args, op=op, **params)


def _matrix_lowering(ctx, *args, op, out_specs, **params):
  """The GPU lowering, which takes w as a matrix: other weights are reshaped around it (row-major views, free)."""
  del out_specs  # types only the global-array trace, never a lowered (local) call
  if ctx.avals_in[0].dtype == jnp.float64 and params["algorithm"] == "auto":
    # float64 serves checks on the XLA path; the GPU algorithms' planning has figures for 16-bit types only.
    log.debug("jax_overlap.%s: XLA path (float64; the GPU algorithms take bfloat16 and float16)", op)
    return _lower_reference(ctx, *args, op=op, **params)
  if ctx.avals_in[1].ndim == 2:
    return gpu_lowering.gpu_rule(ctx, *args, op=op, lower_reference=_lower_reference, **params)
  fn = functools.partial(_ag_as_matrix if op == "ag_matmul" else _rs_as_matrix, **params)
  return mlir.lower_fun(fn, multiple_results=op == "ag_matmul")(ctx, *args)


def _ag_as_matrix(x, w, *bias, w_kmajor, **params):
  n = w.shape[:-1] if w_kmajor else w.shape[1:]
  w2 = w.reshape(-1, w.shape[-1]) if w_kmajor else w.reshape(w.shape[0], -1)
  y, gathered = ag_matmul(x, w2, bias[0].reshape(-1) if bias else None, w_kmajor=w_kmajor, **params)
  return y.reshape(*y.shape[:-1], *n), gathered


def _rs_as_matrix(x, w, *bias, w_kmajor, **params):
  contract = w.ndim - 1
  k = math.prod(w.shape[1:] if w_kmajor else w.shape[:-1])
  w2 = w.reshape(w.shape[0], k) if w_kmajor else w.reshape(k, w.shape[-1])
  x2 = x.reshape(*x.shape[:x.ndim - contract], k)
  return matmul_rs(x2, w2, bias[0] if bias else None, w_kmajor=w_kmajor, **params)


def _gather_default_lowering(ctx, x, *, axis_name, axis_size):
  del axis_size
  fn = lambda v: jax.lax.all_gather(v, axis_name, axis=v.ndim - 2, tiled=True)
  return mlir.lower_fun(fn, multiple_results=False)(ctx, x)


def _register():
  for prim, abstract_eval, op, ref in ((ag_matmul_p, _ag_abstract_eval, "ag_matmul", reference.ag_matmul),
                                       (matmul_rs_p, _rs_abstract_eval, "matmul_rs", reference.matmul_rs)):
    prim.def_impl(_compat.apply_primitive(prim))
    prim.def_abstract_eval(abstract_eval)
    batching.primitive_batchers[prim] = functools.partial(_batch_rule, prim, ref)
    ad.primitive_jvps[prim] = functools.partial(_no_jvp, op)
    mlir.register_lowering(prim, _untyped_lowering(functools.partial(_default_lowering, op=op)))
    for platform in ("cuda", "rocm"):
      mlir.register_lowering(prim, _untyped_lowering(functools.partial(_matrix_lowering, op=op)), platform=platform)
  all_gather_p.def_impl(_compat.apply_primitive(all_gather_p))
  all_gather_p.def_abstract_eval(_gather_abstract_eval)
  batching.primitive_batchers[all_gather_p] = _gather_batch_rule
  mlir.register_lowering(all_gather_p, _gather_default_lowering)
  for platform in ("cuda", "rocm"):
    mlir.register_lowering(all_gather_p, functools.partial(gpu_lowering.gather_gpu_rule,
                                                           lower_default=_gather_default_lowering),
                           platform=platform)


_register()
