"""Global arrays (axis_name=None under jit): custom partitioning with Shardy rules, by the op's sharding plan."""

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

from jax_overlap.integration import primitives

from jax_overlap import _sharding
from jax_overlap.integration.operands import Operands, operands, split_operands

log = logging.getLogger("jax_overlap")


def _named(mesh, *specs):
  return tuple(NamedSharding(mesh, s) for s in specs)


def _body(fn):
  """A partitioned body, traced with the axes Auto (_sharding.py says why)."""
  @functools.wraps(fn)
  def traced(*args):
    with _sharding.auto_axes():
      return fn(*args)
  return traced


@functools.cache
def custom_partitioned(op, ndim: int, w_ndim: int, has_bias: bool, scaling, w_kmajor: bool, algorithm: str,
                       axis, request, out_dtype: str):
  """`request`, the output spec asked for, aligns to the end: vmap adds dims."""
  out_ndim = op.sharding.result_ndim(ndim, w_ndim)
  multiple = op.results.multiple
  if request is not None:
    request = (None,) * (out_ndim - len(request)) + tuple(request)

  def plan(mesh, args, asked):
    return _plan(op, mesh, args, has_bias, scaling, w_kmajor, axis, asked)

  def product(*args, out_specs=None):
    x, w, bias, scales = split_operands(args, has_bias, scaling)
    return op.sharding.global_results(op.rules.bind(x, w, bias, scales, axis_name=None, axis_size=1,
                                                    algorithm=algorithm, w_kmajor=w_kmajor, out_dtype=out_dtype,
                                                    out_specs=out_specs), None)

  def traced(*args):
    mesh = _sharding.explicit_mesh(jax.typeof(args[0]))
    specs = None
    if mesh is not None:
      specs = plan(mesh, [jax.typeof(a) for a in args], request).results
    return product(*args, out_specs=specs)

  fn = custom_partitioning(traced)

  def result_shardings(mesh, p):
    named = _named(mesh, *p.results)
    return named if multiple else named[0]

  def asked(mesh, result_shape):
    # Auto meshes: what propagation settled on downstream; Explicit meshes: the type traced() gave.
    if request is not None:
      return request
    first = result_shape[0] if multiple else result_shape
    return _spec(mesh, first, out_ndim, "the result")

  def infer(mesh, arg_shapes, result_shape):
    return result_shardings(mesh, plan(mesh, arg_shapes, request))

  def partition(mesh, arg_shapes, result_shape):
    p = plan(mesh, arg_shapes, asked(mesh, result_shape))
    log.debug("jax_overlap.%s: global arrays, %s", op.name, p.why if p.axes else f"plain partitioning ({p.why})")
    if p.axes is None and mesh.size > 1:
      _nothing_to_overlap(op.name, p.why)
    scale_sh = () if scaling is None else scaling.partition_specs(p.x, p.w)
    arg_sh = _named(mesh, p.x, p.w, *((p.bias,) if has_bias else ()), *scale_sh)
    if p.axes is None:
      return mesh, _body(product), result_shardings(mesh, p), arg_sh
    size = math.prod(mesh.shape[a] for a in p.axes)
    body = op.sharding.partitioned(p, size=size, algorithm=algorithm, w_kmajor=w_kmajor, axis=axis, has_bias=has_bias,
                          scaling=scaling, out_dtype=out_dtype)
    return mesh, _body(body), result_shardings(mesh, p), arg_sh

  rule, reductions = op.sharding.rule(ndim, w_ndim, has_bias, scaling, w_kmajor, axis)
  # decode_shardings=False: JAX's decoding raises on a sub-axis before partition runs; _spec decodes what the plan
  # reads.
  fn.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                   reduction_factors=reductions, decode_shardings=False)
  return fn


@functools.cache
def _nothing_to_overlap(name: str, why: str) -> None:
  log.info("jax_overlap.%s: these shardings give it nothing to gather or scatter (%s), so XLA partitions a plain "
           "dot; a kernel sharded on an output dim takes ag_matmul (AgDotGeneral), one sharded on its contraction "
           "matmul_rs (RsDotGeneral). Said once per reason.", name, why)


def _plan(op, mesh, avals, has_bias: bool, scaling, w_kmajor: bool, axis, asked):
  o = Operands.of(avals, has_bias, scaling)
  x_shape, w_shape = o.x.shape, o.w.shape
  if scaling is not None:
    x_shape, w_shape = scaling.plan_shapes((o.x_scale.shape, o.w_scale.shape), x_shape, w_shape)
  return op.sharding.plan(mesh, _spec(mesh, o.x, o.x.ndim, "x"), _spec(mesh, o.w, o.w.ndim, "w"), x_shape, w_shape,
                          w_kmajor, axis, asked)


def _spec(mesh, aval, ndim: int, what: str) -> list:
  """A sub-axis (from an upstream reshape) reads as unsharded: the plan reshards."""
  spec = _sharding.spec_on(mesh, aval.sharding, ndim)
  if spec is None:
    log.debug("jax_overlap: %s's sharding %s has no PartitionSpec on the mesh %s: planned as unsharded", what,
              aval.sharding, dict(mesh.shape))
    return [None] * ndim
  return spec


# custom_partitioning has no batching rule: a custom_vmap folds a batched x into the leading dims and calls the op
# again; batched weights or bias go to the reference.

def _vmap_rule(op, fn, has_bias: bool, scaling, w_kmajor: bool, axis, request, out_dtype: str):
  def rule(axis_size, in_batched, *args):
    def batched(i, a):
      return a if in_batched[i] else jnp.broadcast_to(a, (axis_size, *a.shape))
    along_x = primitives.along_x(has_bias, scaling)
    if any(in_batched[i] for i in along_x) and not any(b for i, b in enumerate(in_batched) if i not in along_x):
      out = fn(*(batched(i, a) if i in along_x else a for i, a in enumerate(args)))
      return out, jax.tree.map(lambda _: True, out)
    args = [batched(i, a) for i, a in enumerate(args)]

    def reference(*args):
      x, w, bias, scales = split_operands(args, has_bias, scaling)
      return op.sharding.global_results(op.xla.reference(x, w, bias, scales, axis_name=None, w_kmajor=w_kmajor,
                                                         out_dtype=out_dtype), None)

    def product(*args):
      mesh = _sharding.explicit_mesh(jax.typeof(args[0]))
      if mesh is None:
        return reference(*args)
      # Operands laid out for the op give the reference's plain dot no legal Explicit result type: run it Auto.
      out_ndim = op.sharding.result_ndim(jax.typeof(args[0]).ndim, jax.typeof(args[1]).ndim)
      asked = None if request is None else (None,) * (out_ndim - len(request)) + tuple(request)
      specs = _plan(op, mesh, [jax.typeof(a) for a in args], has_bias, scaling, w_kmajor, axis, asked).results
      named = _named(mesh, *specs)
      return jax.sharding.auto_axes(reference, out_sharding=named if op.rules.primitive.multiple_results else named[0])(
          *args)
    out = jax.vmap(product)(*args)
    return out, jax.tree.map(lambda _: True, out)
  return rule


@functools.cache
def _vmappable(op, has_bias: bool, scaling, w_kmajor: bool, algorithm: str, axis, request, out_dtype: str):
  @jax.custom_batching.custom_vmap
  def fn(x, w, *rest):
    return custom_partitioned(op, x.ndim, w.ndim, has_bias, scaling, w_kmajor, algorithm, axis, request,
                              out_dtype)(x, w, *rest)

  fn.def_vmap(_vmap_rule(op, fn, has_bias, scaling, w_kmajor, axis, request, out_dtype))
  return fn


# A second derivative differentiates custom_partitioning, which has no rule in JAX.
_NO_DERIVATIVE = "Differentiation rule for 'custom_partitioning' not implemented"


def call(op, x, w, bias, scales, *, algorithm: str, w_kmajor: bool, axis, out_dtype: str, request=None):
  fn = _vmappable(op, bias is not None, None if scales is None else scales.scaling, w_kmajor, algorithm, axis,
                  request, out_dtype)
  try:
    outs = fn(*operands(x, w, bias, scales))
  except NotImplementedError as e:
    if not str(e).startswith(_NO_DERIVATIVE):
      raise
    raise NotImplementedError(primitives.unsupported(op.name, "a second derivative (jax.hessian, jax.grad of "
                                                              "jax.grad) on global arrays", algorithm)) from e
  outs = jax.tree.map(functools.partial(export_guard_p.bind, op=op.name, algorithm=algorithm), outs)
  return op.sharding.global_results(outs, scales)


# jax.export cannot serialize a multi-device custom partitioning (a compile-time Python callback) and says so
# without a jax_overlap frame: every global call's results pass through this identity, whose lowering says why.



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
