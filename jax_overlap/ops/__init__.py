"""The ops, one module each: everything that differs between ops is its module's, and nothing else branches on them.

A GEMM op module (ag_matmul.py, matmul_rs.py) defines, and api.py,
integration/ and planning/ look up (none of them names an op):

  the op           NAME (its FFI targets' stem and its messages' prefix); DUAL (the op of its gradient)
                   primitive; bind(x, w, bias, scales, *, axis_name, axis_size, algorithm, w_kmajor, out_dtype,
                   out_specs) (scales: the Scales of float8 operands, or None); abstract_eval(*operands,
                   **params); as_matrix(*operands, w_kmajor, has_bias, scaling, **params) (w as a matrix);
                   results_of_one(y, x) (the results of a group of one's custom call, which computes y)
  the XLA path     reference(x, w, bias, scales, *, axis_name, w_kmajor, <its axis>, out_dtype): the
                   decomposition, the fallback and the test oracle; plain(x, w, bias, scales, call):
                   algorithm="xla" as JAX ops
  shards           on_shards(x, w, bias, scales, *, axes, size, algorithm, w_kmajor, out_dtype, axis): the call
                   on one rank's shards for any gather / scatter axis (folded into the rows)
  global arrays    Plan (a NamedTuple with axes, x, w, bias, results, why); sharding_plan(mesh, x_spec, w_spec,
                   x_shape, w_shape, w_kmajor, axis, request); sharding_rule(ndim, w_ndim, has_bias, scaling,
                   w_kmajor, axis) -> (rule, reduction factors); result_ndim(ndim, w_ndim); partitioned(plan, *,
                   size, algorithm, w_kmajor, axis, has_bias, scaling, out_dtype) (the body of a plan that
                   gathers or reduces); global_results(results, scales) (the results a global call partitions,
                   scales None, or returns)
  api.py           check_operands(x, w, bias, w_kmajor): the shape checks, returning the output's trailing dims
  the custom VJP   residual(x, results); backward(call, residuals, cotangents, dual) -> (dx, dw, dbias), with
                   dual the differentiable call of DUAL
  planning         ALGORITHMS (auto's candidates); eligible(rows, world) (the op's own conditions);
                   chunk_rows, chunk_bytes (what a rank receives per chunk); REDUCES (a reduction to measure);
                   stage_candidates(world), check_stages(stages, text), pipelined_us(stages, figures) (the
                   pipelined model); MOVERS, fused_traffic, fused_chunk_k, fused_units (the fused planner's)

OPS maps names to GEMM op modules; importing this package checks that each
defines every name above and registers every primitive's rules. Three other
primitives have rules of their own: all_gather.py, the runtime's all-gather
(tests); fp8_cast.py, the float8 cast of the fp8 layers, and fp8_scales.py, the
delayed-scaling layers' step scales before their casts. reference.py holds
the numerics the ops' reference decompositions share.
"""

from __future__ import annotations

from jax_overlap.integration import primitives
from jax_overlap.ops import ag_matmul, all_gather, fp8_cast, fp8_scales, matmul_rs

OPS = {op.NAME: op for op in (ag_matmul, matmul_rs)}

PROTOCOL = ("NAME", "DUAL", "primitive", "bind", "abstract_eval", "as_matrix", "results_of_one", "reference",
            "plain", "on_shards", "Plan", "sharding_plan", "sharding_rule", "result_ndim", "partitioned",
            "global_results", "check_operands", "residual", "backward", "ALGORITHMS", "eligible", "chunk_rows",
            "chunk_bytes", "REDUCES", "stage_candidates", "check_stages", "pipelined_us", "MOVERS", "fused_traffic",
            "fused_chunk_k", "fused_units")


def check(op) -> None:
  """TypeError naming what an op module lacks of the protocol."""
  missing = [name for name in PROTOCOL if not hasattr(op, name)]
  if missing:
    raise TypeError(f"{op.__name__} does not define {missing} (the op protocol: jax_overlap/ops/__init__.py)")


def _register() -> None:
  for op in OPS.values():
    check(op)
    primitives.register(op)
  all_gather.register()
  fp8_cast.register()
  fp8_scales.register()


_register()
