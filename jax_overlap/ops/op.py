"""The op as one typed object, checked when made: what differs between the GEMM ops, so nothing else branches."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jax.extend import core as jex_core

from jax_overlap.integration.results import Results
from jax_overlap.quantization import formats


def _takes(expected: str) -> tuple:
  """(a test of a field's value, its words) for a field's annotation (text: not evaluated)."""
  if expected == "Callable":
    return callable, "a callable"
  if expected == "tuple[str, ...]":
    return lambda v: isinstance(v, tuple) and all(isinstance(s, str) for s in v), "a tuple of str"
  kind = {"str": str, "bool": bool, "int": int, "type": type, "jex_core.Primitive": jex_core.Primitive,
          "Results": Results}.get(expected) or globals()[expected]
  return (lambda v: isinstance(v, kind)), f"a {kind.__name__}"


def _check_fields(group) -> None:
  for field in dataclasses.fields(group):
    value = getattr(group, field.name)
    test, words = _takes(field.type)
    if not test(value):
      raise TypeError(f"jax_overlap.ops.{type(group).__name__}: {field.name} must be {words}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Rules:
  primitive: jex_core.Primitive
  bind: Callable  # (x, w, bias, scales, *, axis_name, axis_size, algorithm, w_kmajor, out_dtype, out_specs=None)
  abstract_eval: Callable
  as_matrix: Callable  # the call with w as a matrix (free views), as the GPU lowering takes it

  __post_init__ = _check_fields


@dataclasses.dataclass(frozen=True)
class XlaPath:
  reference: Callable  # the fallback and the test oracle
  plain: Callable  # algorithm="xla"
  required: Callable  # (call) -> whether only the XLA path takes it

  __post_init__ = _check_fields


@dataclasses.dataclass(frozen=True)
class Sharding:
  Plan: type
  plan: Callable  # (mesh, x_spec, w_spec, x_shape, w_shape, w_kmajor, axis, request) -> Plan
  rule: Callable
  result_ndim: Callable
  partitioned: Callable
  global_results: Callable

  __post_init__ = _check_fields


@dataclasses.dataclass(frozen=True)
class PlanningFigures:
  algorithms: tuple[str, ...]  # auto's candidates
  eligible: Callable  # (rows, world) -> why not, beyond what every op needs
  chunk_rows: Callable
  chunk_bytes: Callable
  reduces: bool  # the pipelined call ends in a reduction kernel, measured for its model
  stage_candidates: Callable
  check_stages: Callable
  pipelined_us: Callable
  movers: str  # the fused kernel's data movers' name, for messages
  fused_traffic: Callable  # (rows, k, n, world, itemsize) -> (bytes the movers move, bytes over the link, flops)
  fused_chunk_k: Callable
  fused_units: Callable

  def __post_init__(self):
    _check_fields(self)
    unknown = set(self.algorithms) - set(formats.GPU_ALGORITHMS)
    if unknown or not self.algorithms:
      raise TypeError(f"jax_overlap.ops.PlanningFigures: algorithms must be some of {formats.GPU_ALGORITHMS}, got "
                      f"{self.algorithms!r}")


@dataclasses.dataclass(frozen=True)
class Backward:
  residual: Callable  # (x, results) -> what the backward keeps besides w and bias
  grads: Callable  # (call, residuals, cotangents, dual) -> (dx, dw, dbias)

  __post_init__ = _check_fields


@dataclasses.dataclass(frozen=True)
class Arguments:
  check_operands: Callable  # (x, w, bias, w_kmajor) -> the output's shape; ValueError naming what does not fit
  dim: str
  dim_of_x: bool  # whether that argument counts x's dims (else the output's)
  dim_last: int
  dim_optional: bool  # whether it may be None: the plan's or the group's
  grouped: Callable  # (dim, x, out_shape, size, axis_name) -> (dim, out_shape) inside shard_map; ValueError
  empty: Callable  # (x, w, bias, scales, call, out_shape) -> results: collectives of empty arrays do not lower

  __post_init__ = _check_fields


@dataclasses.dataclass(frozen=True)
class Op:
  name: str  # the public function's, its FFI targets' stem and its messages' prefix
  dual: str
  results: Results
  rules: Rules
  xla: XlaPath
  on_shards: Callable
  sharding: Sharding
  planning: PlanningFigures
  backward: Backward
  arguments: Arguments

  def __post_init__(self):
    _check_fields(self)
    if not self.name.isidentifier():
      raise TypeError(f"jax_overlap.ops.Op: name must be an identifier, got {self.name!r}")
    if self.rules.primitive.name != f"jax_overlap_{self.name}":
      raise TypeError(f"jax_overlap.ops.Op {self.name!r}: its primitive must be named 'jax_overlap_{self.name}', "
                      f"got {self.rules.primitive.name!r}")
    if self.rules.primitive.multiple_results != self.results.multiple:
      raise TypeError(f"jax_overlap.ops.Op {self.name!r}: its primitive's multiple_results must be "
                      f"{self.results.multiple} for {len(self.results.kinds)} results, got "
                      f"{self.rules.primitive.multiple_results}")

