"""Global-array mode (axis_name=None under jit): custom partitioning with Shardy rules.

The plans (sharding_plan.py) decide from the operands' shardings; the
partitioned bodies are the shard_map forms (local.py) when a plan gathers or
reduces, and a local product otherwise, so the answer is right either way.

ag_matmul  x [..., m, K] @ w [K, *n] (+ bias [*n]); the gather dim g (default -2)
  rule "b.. g k, k n.. -> b.. p n.., b.. p k": the gathered dim is its own factor
  in the results (p), so propagation does not copy x's gathered sharding onto y
  (the fused result is sharded on w's n dim instead).
matmul_rs  x [..., M, *k] @ w [*k, N] (+ bias [N])
  rule "b.. k.., k.. n -> b.. n" with the k factors reduced. The scatter dim is
  the scatter_axis argument, else the one the output sharding asks for (the
  out_sharding argument, or what propagation decided: a constraint or jit's
  out_shardings downstream), else the rows on Explicit meshes; with no request
  on an Auto mesh the reduction is an all-reduce, as XLA's own dot would be.
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding

from jax_overlap import local, primitives, reference
from jax_overlap.sharding_plan import ag_plan, rs_plan, spec_of

log = logging.getLogger("jax_overlap")


def _named(mesh, *specs):
  return tuple(NamedSharding(mesh, s) for s in specs)


def _explicit_mesh(x):
  return primitives._explicit_mesh(jax.typeof(x))


def _body(fn):
  """A partitioned body, traced with the mesh's Explicit axes Auto.

  JAX traces and lowers the body under the caller's mesh (jax.set_mesh, where
  the program is compiled); with Explicit axes every op in it would be typed
  with that mesh, a sharding annotation on each, which XLA's CPU backend cannot
  run where the partitioner leaves them ("Unsupported reduction computation" in
  a collective's reducer). The body is per-shard code: it has no global types.
  JAX lowers a collective's reducer later, when it lowers the body, so the body
  holds no reducer of JAX's: its reductions are all-to-alls and local sums
  (reference.py), and the primitives' lowerings set the axes Auto themselves.
  """
  @functools.wraps(fn)
  def traced(*args):
    with primitives.auto_axes():
      return fn(*args)
  return traced


def _factors(prefix: str, count: int) -> list:
  return [f"{prefix}{i}" for i in range(count)]


@functools.cache
def _ag_function(ndim: int, w_ndim: int, has_bias: bool, w_kmajor: bool, algorithm: str, gather: int):
  def plan(mesh, x, w):
    return ag_plan(mesh, spec_of(x.sharding, ndim), spec_of(w.sharding, w_ndim), x.shape, w.shape, w_kmajor,
                   gather)

  def product(x, w, *bias, out_specs=None):
    return primitives.ag_matmul(x, w, bias[0] if bias else None, axis_name=None, axis_size=1, algorithm=algorithm,
                                w_kmajor=w_kmajor, out_specs=out_specs)

  def traced(x, w, *bias):
    mesh = _explicit_mesh(x)
    specs = None
    if mesh is not None:
      p = plan(mesh, jax.typeof(x), jax.typeof(w))
      specs = (p.y, p.gathered)
    return product(x, w, *bias, out_specs=specs)

  fn = custom_partitioning(traced)

  def infer(mesh, arg_shapes, result_shape):
    p = plan(mesh, *arg_shapes[:2])
    return _named(mesh, p.y, p.gathered)

  def partition(mesh, arg_shapes, result_shape):
    p = plan(mesh, *arg_shapes[:2])
    log.debug("jax_overlap.ag_matmul: global arrays, %s", p.why if p.axes else f"plain partitioning ({p.why})")
    arg_sh = _named(mesh, p.x, p.w, p.bias)[: 3 if has_bias else 2]
    if p.axes is None:
      return mesh, _body(product), _named(mesh, p.y, p.gathered), arg_sh
    size = math.prod(mesh.shape[a] for a in p.axes)

    def gather_and_multiply(x, w, *bias):
      return local.ag_matmul(x, w, bias[0] if bias else None, axes=p.axes, size=size, algorithm=algorithm,
                             w_kmajor=w_kmajor, gather=gather)

    return mesh, _body(gather_and_multiply), _named(mesh, p.y, p.gathered), arg_sh

  batch = _factors("b", ndim - 1)
  x_f, out_f = list(batch), list(batch)
  x_f[ndim + gather], out_f[ndim + gather] = "g", "p"
  n = _factors("n", w_ndim - 1)
  w_f = [*n, "k"] if w_kmajor else ["k", *n]
  operands = [" ".join([*x_f, "k"]), " ".join(w_f)] + ([" ".join(n)] if has_bias else [])
  rule = f"{', '.join(operands)} -> {' '.join([*out_f, *n])}, {' '.join([*out_f, 'k'])}"
  fn.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule)
  return fn


@functools.cache
def _rs_function(ndim: int, w_ndim: int, has_bias: bool, w_kmajor: bool, algorithm: str, scatter, request):
  contract = w_ndim - 1
  out_ndim = ndim - contract + 1
  if request is not None:  # aligned to the end: vmap adds leading dims
    request = (None,) * (out_ndim - len(request)) + tuple(request)

  def plan(mesh, x, w, asked):
    return rs_plan(mesh, spec_of(x.sharding, ndim), spec_of(w.sharding, w_ndim), x.shape, w.shape, w_kmajor,
                   scatter, asked)

  def product(x, w, *bias, out_specs=None):
    return primitives.matmul_rs(x, w, bias[0] if bias else None, axis_name=None, axis_size=1, algorithm=algorithm,
                                w_kmajor=w_kmajor, out_specs=out_specs)

  def traced(x, w, *bias):
    mesh = _explicit_mesh(x)
    specs = None
    if mesh is not None:
      specs = (plan(mesh, jax.typeof(x), jax.typeof(w), request).out,)
    return product(x, w, *bias, out_specs=specs)

  fn = custom_partitioning(traced)

  def asked(result_shape):
    # Auto meshes: the output sharding propagation settled on (a downstream
    # constraint's); Explicit meshes: the type traced() gave, which asks for itself.
    return request if request is not None else spec_of(result_shape.sharding, out_ndim)

  def infer(mesh, arg_shapes, result_shape):
    return NamedSharding(mesh, plan(mesh, *arg_shapes[:2], request).out)

  def partition(mesh, arg_shapes, result_shape):
    p = plan(mesh, *arg_shapes[:2], asked(result_shape))
    log.debug("jax_overlap.matmul_rs: global arrays, %s", p.why if p.axes else f"plain partitioning ({p.why})")
    arg_sh = _named(mesh, p.x, p.w, p.bias)[: 3 if has_bias else 2]
    out_sh = NamedSharding(mesh, p.out)
    if p.axes is None:
      return mesh, _body(product), out_sh, arg_sh
    if p.scatter is None:
      def multiply_and_reduce(x, w, *bias):
        return local.matmul_psum(x, w, bias[0] if bias else None, axes=p.axes, w_kmajor=w_kmajor)
      return mesh, _body(multiply_and_reduce), out_sh, arg_sh
    size = math.prod(mesh.shape[a] for a in p.axes)

    def multiply_and_scatter(x, w, *bias):
      return local.matmul_rs(x, w, bias[0] if bias else None, axes=p.axes, size=size, algorithm=algorithm,
                             w_kmajor=w_kmajor, scatter=p.scatter)

    return mesh, _body(multiply_and_scatter), out_sh, arg_sh

  batch, k = _factors("b", out_ndim - 1), _factors("k", contract)
  w_f = ["n", *k] if w_kmajor else [*k, "n"]
  operands = [" ".join([*batch, *k]), " ".join(w_f)] + (["n"] if has_bias else [])
  rule = f"{', '.join(operands)} -> {' '.join([*batch, 'n'])}"
  fn.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                   reduction_factors=tuple(k))
  return fn


# vmap: custom_partitioning has no batching rule, so each global op is a
# custom_vmap whose rule folds a batched x into the leading dims (the ops take
# any; gather and scatter dims count from the end) and calls the op itself again,
# so that an enclosing vmap reaches this rule too; batched weights or bias go to
# the reference product.

def _batch_rule(op_fn, reference_fn, w_kmajor: bool):
  def rule(axis_size, in_batched, x, w, *bias):
    x_batched, w_batched, *bias_batched = in_batched
    if x_batched and not w_batched and not any(bias_batched):
      out = op_fn(x, w, *bias)
      return out, jax.tree.map(lambda _: True, out)
    args = [a if b else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, b in zip((x, w, *bias), in_batched)]
    product = lambda x, w, *b: reference_fn(x, w, b[0] if b else None, axis_name=None, w_kmajor=w_kmajor)
    out = jax.vmap(product)(*args)
    return out, jax.tree.map(lambda _: True, out)
  return rule


@functools.cache
def _ag_vmappable(has_bias: bool, w_kmajor: bool, algorithm: str, gather: int):
  @jax.custom_batching.custom_vmap
  def fn(x, w, *bias):
    return _ag_function(x.ndim, w.ndim, has_bias, w_kmajor, algorithm, gather)(x, w, *bias)

  fn.def_vmap(_batch_rule(fn, reference.ag_matmul, w_kmajor))
  return fn


@functools.cache
def _rs_vmappable(has_bias: bool, w_kmajor: bool, algorithm: str, scatter, request):
  @jax.custom_batching.custom_vmap
  def fn(x, w, *bias):
    return _rs_function(x.ndim, w.ndim, has_bias, w_kmajor, algorithm, scatter, request)(x, w, *bias)

  fn.def_vmap(_batch_rule(fn, reference.matmul_rs, w_kmajor))
  return fn


# Differentiating a call's custom VJP again (jax.hessian, grad of grad) differentiates custom_partitioning,
# which has no rule in JAX.
_NO_DERIVATIVE = "Differentiation rule for 'custom_partitioning' not implemented"


def _call(op: str, algorithm: str, fn, *args):
  try:
    outs = fn(*args)
  except NotImplementedError as e:
    if not str(e).startswith(_NO_DERIVATIVE):
      raise
    raise NotImplementedError(primitives.unsupported(op, "a second derivative (jax.hessian, jax.grad of jax.grad) "
                                                         "on global arrays", algorithm)) from e
  return jax.tree.map(functools.partial(export_guard_p.bind, op=op, algorithm=algorithm), outs)


def ag_matmul(x, w, bias, *, algorithm: str, w_kmajor: bool = False, gather: int = -2):
  """(x @ w + bias, x) on global arrays, partitioned from their shardings."""
  fn = _ag_vmappable(bias is not None, w_kmajor, algorithm, gather)
  y, gathered = _call("ag_matmul", algorithm, fn, x, w, *(() if bias is None else (bias,)))
  return y, gathered


def matmul_rs(x, w, bias, *, algorithm: str, w_kmajor: bool = False, scatter: int | None = None, request=None):
  """x @ w + bias on global arrays; `request`: the asked output spec (a tuple per dim) or None."""
  fn = _rs_vmappable(bias is not None, w_kmajor, algorithm, scatter, request)
  return _call("matmul_rs", algorithm, fn, x, w, *(() if bias is None else (bias,)))


# --- jax.export -----------------------------------------------------------------
# A custom partitioning over several devices is a Python callback at compile
# time, which jax.export cannot serialize ("serialization of host_callbacks is
# not yet implemented", raised after lowering, with no jax_overlap frame on the
# stack). Every global call's results pass through this identity, whose lowering
# says so in jax_overlap's words when the lowering is for export over several
# devices (one device inlines the partitioning and exports).

export_guard_p = jex_core.Primitive("jax_overlap_export_guard")


def _export_guard_lowering(ctx, x, *, op, algorithm):
  devices = getattr(ctx.module_context.axis_context, "device_assignment", None) or ()
  if ctx.module_context.lowering_parameters.for_export and len(devices) > 1:
    raise NotImplementedError(f"jax_overlap.{op}: jax.export cannot serialize a call on global arrays over several "
                              f"devices with algorithm={algorithm!r} (its custom partitioning runs Python at "
                              f"compile time); pass algorithm='xla' (plain JAX ops), or call it inside "
                              f"jax.shard_map with axis_name")
  return [x]


def _register():
  export_guard_p.def_impl(lambda x, **_: x)
  export_guard_p.def_abstract_eval(lambda x, **_: x)
  mlir.register_lowering(export_guard_p, _export_guard_lowering)
  batching.primitive_batchers[export_guard_p] = lambda args, dims, **p: (export_guard_p.bind(args[0], **p), dims[0])
  ad.primitive_jvps[export_guard_p] = lambda primals, tangents, **p: (export_guard_p.bind(primals[0], **p),
                                                                       tangents[0])
  ad.primitive_transposes[export_guard_p] = lambda ct, x, **p: [ct]


_register()
