"""Checkpoint names of the ops' results. A policy is asked about each both by name and as a dot without batch dims
(which the op is), and the more saving answer wins: the dot policies save the op, collective included.
  jax_overlap.ag_matmul                  ag_matmul's y
  jax_overlap.ag_matmul.gathered         its gathered x (the weight gradient reads it)
  jax_overlap.ag_matmul.gathered_scales  the gathered x's per-shard scales (float8)
  jax_overlap.ag_matmul.w_scale          Fp8AgDotGeneral's weight scale
  jax_overlap.matmul_rs                  matmul_rs's output
  jax_overlap.matmul_rs.x_fp8, .x_scale  Fp8RsDotGeneral's quantized x and its scale (the weight gradient reads them)
  jax_overlap.matmul_rs.w_scale          Fp8RsDotGeneral's weight scale
Save both ag_matmul names to keep its backward from recomputing the op; NAMES saves them all.
"""

from __future__ import annotations

from jax import lax
from jax.extend import core as jex_core
from jax.extend.core import primitives as jex_primitives
from jax.interpreters import ad, batching, mlir
from jax.interpreters import partial_eval as pe

from jax_overlap import _compat

AG_OUTPUT = "jax_overlap.ag_matmul"
AG_GATHERED = "jax_overlap.ag_matmul.gathered"
AG_GATHERED_SCALES = "jax_overlap.ag_matmul.gathered_scales"
AG_W_SCALE = "jax_overlap.ag_matmul.w_scale"
RS_OUTPUT = "jax_overlap.matmul_rs"
RS_X_FP8 = "jax_overlap.matmul_rs.x_fp8"
RS_X_SCALE = "jax_overlap.matmul_rs.x_scale"
RS_W_SCALE = "jax_overlap.matmul_rs.w_scale"
NAMES = (AG_OUTPUT, AG_GATHERED, AG_GATHERED_SCALES, AG_W_SCALE, RS_OUTPUT, RS_X_FP8, RS_X_SCALE, RS_W_SCALE)

tag_p = jex_core.Primitive("jax_overlap_tag")


def tag(value, name: str):
  return tag_p.bind(value, name=name)


def _as_name_or_dot(saveable):
  def policy(prim, *avals, **params):
    by_name = saveable(prim, *avals, **params)
    if prim is not jex_primitives.name_p:
      return by_name
    by_dot = saveable(lax.dot_general_p, *avals, dimension_numbers=(((), ()), ((), ())), precision=None,
                      preferred_element_type=None, out_sharding=None)
    return max((by_name, by_dot), key=_compat.remat_rank)
  return policy


def _partial_eval(saveable, unknowns, instantiated, eqn):
  # A call's rule, on the one-equation jaxpr checkpoint_name(x, name).
  aval = eqn.outvars[0].aval
  x, y = jex_core.Var(aval), jex_core.Var(aval)
  named = jex_core.new_jaxpr_eqn([x], [y], jex_primitives.name_p, {"name": eqn.params["name"]}, set())
  debug = jex_core.DebugInfo("checkpoint_name", "checkpoint_name", ("x",), ("y",))
  call = jex_core.ClosedJaxpr(jex_core.Jaxpr([], [x], [y], [named], debug_info=debug), [])
  call_eqn = eqn.replace(primitive=jex_primitives.closed_call_p, params={"call_jaxpr": call})
  rule = pe.partial_eval_jaxpr_custom_rules[jex_primitives.closed_call_p]
  return rule(_as_name_or_dot(saveable), unknowns, instantiated, call_eqn)


def _register():
  tag_p.def_impl(lambda x, *, name: x)
  tag_p.def_abstract_eval(lambda x, *, name: x)
  mlir.register_lowering(tag_p, lambda ctx, x, *, name: [x])
  batching.primitive_batchers[tag_p] = lambda args, dims, *, name: (tag(args[0], name), dims[0])
  ad.primitive_jvps[tag_p] = lambda primals, tangents, *, name: (tag(primals[0], name), tangents[0])
  ad.primitive_transposes[tag_p] = lambda ct, x, *, name: [ct]
  pe.partial_eval_jaxpr_custom_rules[tag_p] = _partial_eval


_register()
