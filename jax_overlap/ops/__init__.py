"""The ops: each GEMM op one Op (ops/op.py) in a module of its own; importing this registers every primitive."""

from __future__ import annotations

from jax_overlap.integration import primitives
from jax_overlap.ops import ag_matmul, all_gather, fp8_cast, fp8_scales, matmul_rs
from jax_overlap.ops.op import Op


def check_duals(ops: dict) -> None:
  """TypeError unless every op's dual names it back (the backward passes call each other)."""
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
