"""The ops: each GEMM op one Op (ops/op.py) in a module of its own, and nothing else branches on them.

OPS maps names to the GEMM ops; importing this package checks that their duals name each other and registers every
primitive's rules. Three other primitives have rules of their own: all_gather.py, the runtime's all-gather (tests);
fp8_cast.py, the float8 cast of the fp8 layers, and fp8_scales.py, the delayed-scaling layers' step scales before
their casts. reference.py holds the numerics the ops' reference decompositions share.
"""

from __future__ import annotations

from jax_overlap.integration import primitives
from jax_overlap.ops import ag_matmul, all_gather, fp8_cast, fp8_scales, matmul_rs
from jax_overlap.ops.op import Op


def check_duals(ops: dict) -> None:
  """TypeError unless every op's dual is an op of `ops` whose dual it is (the backward passes call each other)."""
  for name, op in ops.items():
    dual = ops.get(op.dual)
    if dual is None or dual.dual != name:
      got = "no op of that name" if dual is None else f"one whose dual is {dual.dual!r}"
      raise TypeError(f"jax_overlap.ops: op {name!r} names {op.dual!r} as its dual, which must be an op of "
                      f"{sorted(ops)} naming {name!r} as its own; got {got}")


OPS: dict[str, Op] = {op.name: op for op in (ag_matmul.OP, matmul_rs.OP)}


def _register() -> None:
  check_duals(OPS)
  for op in OPS.values():
    primitives.register(op)
  all_gather.register()
  fp8_cast.register()
  fp8_scales.register()


_register()
