"""The op as one typed object: everything that differs between the GEMM ops, grouped by concern, so that api.py,
integration/ and planning/ take an Op and never branch on its name. Each group is checked when it is made
(TypeError naming the group, the field, what it takes and what it got)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jax.extend import core as jex_core

from jax_overlap.integration.results import Results
from jax_overlap.quantization import formats


def _takes(expected: str) -> tuple:
  """(a test of a field's value, its words) for a field's annotation (text: annotations are not evaluated)."""
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
  """The primitive and the rules that are the op's own (integration/primitives.py adds those every op shares)."""

  primitive: jex_core.Primitive
  bind: Callable  # (x, w, bias, scales, *, axis_name, axis_size, algorithm, w_kmajor, out_dtype, out_specs=None)
  abstract_eval: Callable
  as_matrix: Callable  # the call with w viewed as a matrix (the GPU lowering takes no other w)

  __post_init__ = _check_fields


@dataclasses.dataclass(frozen=True)
class XlaPath:
  reference: Callable  # the XLA decomposition: the fallback and the test oracle
  plain: Callable  # algorithm="xla" as JAX ops, which every JAX transformation takes
  required: Callable  # (call) -> whether only the XLA path takes the call, as plain JAX ops

  __post_init__ = _check_fields


@dataclasses.dataclass(frozen=True)
class Sharding:
  """Global arrays: how a call is partitioned from its operands' shardings (integration/partitioning.py)."""

  Plan: type
  plan: Callable  # (mesh, x_spec, w_spec, x_shape, w_shape, w_kmajor, axis, request) -> Plan
  rule: Callable  # the Shardy rule and its reduction factors
  result_ndim: Callable
  partitioned: Callable  # the partitioned body of a plan that gathers or reduces
  global_results: Callable  # the results a global call returns from those it partitions

  __post_init__ = _check_fields


@dataclasses.dataclass(frozen=True)
class PlanningFigures:
  """What planning/ models of the op: its eligibility, what a chunk holds, the pipelined and fused models."""

  algorithms: tuple[str, ...]  # auto's candidates
  eligible: Callable  # (rows, world) -> why not, beyond what every op needs
  chunk_rows: Callable
  chunk_bytes: Callable
  reduces: bool  # the pipelined call ends in a reduction kernel, measured for its model
  stage_candidates: Callable
  check_stages: Callable
  pipelined_us: Callable
  movers: str  # what the fused kernel's data movers are called, for messages
  fused_traffic: Callable
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
  """The custom VJP's (api.py) parts: what the forward keeps, and the gradients, through the dual op."""

  residual: Callable  # (x, results) -> what the backward pass keeps besides w and bias
  grads: Callable  # (call, residuals, cotangents, dual) -> (dx, dw, dbias)

  __post_init__ = _check_fields


@dataclasses.dataclass(frozen=True)
class Arguments:
  """The public function's parts (api.py): its shape checks and the op's own dim argument."""

  check_operands: Callable  # (x, w, bias, w_kmajor) -> the output's shape; ValueError naming what does not fit
  dim: str  # the name of the op's dim argument (the dim it gathers or scatters)
  dim_of_x: bool  # whether that argument counts x's dims (else the output's)
  dim_last: int  # the last dim it may name (negative)
  dim_optional: bool  # whether it may be None: the dim the plan or the group picks
  grouped: Callable  # (dim, x, out_shape, size, axis_name) -> (dim, out_shape) inside shard_map; ValueError
  empty: Callable  # (x, w, bias, scales, call, out_shape) -> the results of a call with an empty dim

  __post_init__ = _check_fields


@dataclasses.dataclass(frozen=True)
class Op:
  name: str  # the public function's, its FFI targets' stem and its messages' prefix
  dual: str  # the op of its gradient (ops.OPS checks that the two name each other)
  results: Results
  rules: Rules
  xla: XlaPath
  on_shards: Callable  # the call on one rank's shards for any gather / scatter dim (folded into the rows)
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

