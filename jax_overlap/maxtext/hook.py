"""MaxText's quantization hook (0.2.5, layers/linears.py): a dense layer calls quant.dot_general_cls(mesh_axes=...)(),
wraps the module in ToNNX as type(module).__name__ + "_0", initializes it on dummy inputs, then calls it as
lax.dot_general, when the modules here pick their op (choice.py). The fp8 modules carry Flax's class names, which
MaxText names the state after: checkpoints stay stock MaxText's."""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import threading
from typing import ClassVar

import flax.linen as nn
import jax
from flax.linen import fp8_ops
from jax import lax

from jax_overlap import planning
from jax_overlap.layers.dot_general import AgDotGeneral, RsDotGeneral
from jax_overlap.layers.fp8 import Fp8AgDotGeneral, Fp8RsDotGeneral
from jax_overlap.layers.fp8_delayed import Fp8DelayedDotGeneralBase
from jax_overlap.maxtext import choice as choices
from jax_overlap.quantization import formats

log = logging.getLogger("jax_overlap.maxtext")

LOCAL = "local"  # a float8 dot on one device
SEQUENCE_PARALLEL_SETTING = "ici_tensor_sequence_parallelism"

# Not the layers' "auto" (the kernels): MaxText's operands come out of XLA's fusions, which take XLA's casts in, where
# the kernels would read them back from memory (docs/performance.md, "MaxText").
AUTO_FP8_CAST = "xla"

_sites = itertools.count(1)


def layer_cast_algorithm(fp8_cast: str) -> str:
  return AUTO_FP8_CAST if fp8_cast == "auto" else fp8_cast


class Census:
  """The op each dense layer took, logged once at INFO on the model's first trace under a mesh."""

  def __init__(self):
    self.lock = threading.Lock()
    self.sites = {}
    self.reported = False

  def record(self, site: int, op: str, picked: choices.Choice) -> None:
    with self.lock:
      self.sites[site] = (op, picked)

  def counts(self) -> dict:
    with self.lock:
      return dict(collections.Counter(op for op, _ in self.sites.values()))

  def report(self) -> None:
    with self.lock:
      if self.reported or not self.sites:
        return
      self.reported = True
      counts = collections.Counter(op for op, _ in self.sites.values())
      model_parallel = any(picked.model_parallel for _, picked in self.sites.values())
    text = ", ".join(f"{op} {counts.get(op, 0)}" for op in (choices.AG, choices.RS, LOCAL, choices.DOT))
    log.info("jax_overlap.maxtext: dense layers by op: %s (a scanned layer stack's layers count once; MoE experts "
             "and the logits keep MaxText's own dots)", text)
    if model_parallel and not counts.get(choices.AG):
      log.warning("jax_overlap.maxtext: no dense layer all-gathers: the kernels are sharded with the model but the "
                  "activation's rows are not (tensor parallelism without sequence parallelism), so every layer "
                  "keeps its own dot. Shard the model with %s in place of ici_tensor_parallelism.",
                  SEQUENCE_PARALLEL_SETTING)


CENSUS = Census()


def _mesh_shape() -> dict | None:
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh is None or mesh.empty else dict(mesh.shape)


def _pick(module, dimension_numbers) -> choices.Choice | None:
  """None while the model is built (no mesh, or initializing): the layer's own dot."""
  mesh_shape = _mesh_shape()
  if mesh_shape is None or module.is_initializing():
    return None
  (lhs_contract, _), _ = dimension_numbers
  rules = nn.get_logical_axis_rules() or module.rules
  picked = choices.choose(module.kernel_axes, len(lhs_contract), rules, mesh_shape)
  if picked.op != choices.DOT and module.algorithm in formats.GPU_ALGORITHMS and \
     picked.group_size > planning.MAX_WORLD:
    raise ValueError(f"jax_overlap.maxtext: algorithm={module.algorithm!r} takes groups of at most "
                     f"{planning.MAX_WORLD} ranks, and MaxText's mesh shards the activation's rows over "
                     f"{picked.group} ({picked.group_size} ranks); use jax_overlap_algorithm=auto (the XLA path "
                     f"for such groups) or a mesh with at most {planning.MAX_WORLD} ranks on those axes")
  log.debug("jax_overlap.maxtext: %s %s: %s (%s)", type(module).__name__, module.kernel_axes, picked.op, picked.why)
  return picked


class OverlapDotGeneral(nn.Module):
  """A 16-bit or float32 run's dense layer: ag_matmul, matmul_rs or the dot, per call; no variables, no rngs."""

  site: int = 0
  kernel_axes: tuple = ()
  rules: tuple = ()
  algorithm: str = "auto"
  fp8: str = ""
  fp8_cast: str = "auto"
  matmul_precision: str = "default"

  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    del precision
    picked = _pick(self, dimension_numbers)
    op = choices.DOT if picked is None else picked.op
    if picked is not None:
      CENSUS.record(self.site, op, picked)
    if op in (choices.AG, choices.RS):
      fp8_layer, layer = (Fp8AgDotGeneral, AgDotGeneral) if op == choices.AG else (Fp8RsDotGeneral, RsDotGeneral)
      dot = fp8_layer(algorithm=self.algorithm, scaling=self.fp8,
                      cast_algorithm=layer_cast_algorithm(self.fp8_cast)) if self.fp8 else \
          layer(algorithm=self.algorithm)
      return dot(lhs, rhs, dimension_numbers, preferred_element_type=preferred_element_type)
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=lax.Precision(self.matmul_precision),
                           preferred_element_type=preferred_element_type)


class _Fp8Delayed(Fp8DelayedDotGeneralBase):
  """The op per call on Flax's variables; `stock`: Flax's module, the layer's own dot."""

  stock: ClassVar[type]
  site: int = 0
  kernel_axes: tuple = ()
  rules: tuple = ()
  algorithm: str = "auto"

  def __call__(self, *args, **kwargs):
    lhs, rhs, dimension_numbers = args[:3]
    picked = _pick(self, dimension_numbers)
    if picked is None:
      return self.stock.__call__(self, *args, **kwargs)
    op = picked.op
    if op == choices.DOT and picked.one_device:
      op = LOCAL
    CENSUS.record(self.site, op, picked)
    if op == choices.DOT:
      return self.stock.__call__(self, *args, **kwargs)
    (lhs_contract, _), _ = dimension_numbers
    parallel = "ag" if op == choices.AG or (op == LOCAL and len(lhs_contract) == 1) else "rs"
    return self.overlapped(parallel, lhs, rhs, dimension_numbers, axis_name=None, algorithm=self.algorithm,
                           axis=-2 if parallel == "ag" else None)


class Fp8DirectDotGeneralOp(_Fp8Delayed):
  stock = fp8_ops.Fp8DirectDotGeneralOp


class NANOOFp8DotGeneralOp(_Fp8Delayed):
  stock = fp8_ops.NANOOFp8DotGeneralOp
  e4m3_dtype: object = fp8_ops.NANOOFp8DotGeneralOp.e4m3_dtype
  e5m2_dtype: object = fp8_ops.NANOOFp8DotGeneralOp.e5m2_dtype


FP8_MODULES = {"fp8": Fp8DirectDotGeneralOp, "nanoo_fp8": NANOOFp8DotGeneralOp}


@dataclasses.dataclass
class OverlapQuantization:
  """quantization="" (MaxText reads quant_mode and needs_apply_rngs)."""

  rules: tuple = ()
  algorithm: str = "auto"
  fp8: str = ""
  fp8_cast: str = "auto"
  matmul_precision: str = "default"
  quant_mode: str = "train"
  needs_apply_rngs: ClassVar[bool] = False

  def dot_general_cls(self, mesh_axes=()):
    return functools.partial(OverlapDotGeneral, site=next(_sites), kernel_axes=tuple(mesh_axes), rules=self.rules,
                             algorithm=self.algorithm, fp8=self.fp8, fp8_cast=self.fp8_cast,
                             matmul_precision=self.matmul_precision)

  def stock(self):
    return None


@functools.cache
def fp8_quantization(recipe: str) -> type:
  """A subclass of MaxText's own, so that MaxText's checks see the recipe."""
  from maxtext.layers import quantizations  # pylint: disable=import-outside-toplevel  (MaxText is optional)
  parent = {"fp8": quantizations.Fp8Quantization, "nanoo_fp8": quantizations.NANOOFp8Quantization}[recipe]
  module = FP8_MODULES[recipe]

  @dataclasses.dataclass
  class OverlapFp8Quantization(parent):
    rules: tuple = ()
    algorithm: str = "auto"
    fp8_cast: str = "auto"

    def dot_general_cls(self, mesh_axes=()):
      return functools.partial(module, site=next(_sites), kernel_axes=tuple(mesh_axes), rules=self.rules,
                               algorithm=self.algorithm, cast_algorithm=layer_cast_algorithm(self.fp8_cast))

    def stock(self):
      return parent()

  OverlapFp8Quantization.__name__ = OverlapFp8Quantization.__qualname__ = f"Overlap{parent.__name__}"
  return OverlapFp8Quantization


def fp8_formats(recipe: str) -> tuple:
  module = FP8_MODULES[recipe]
  return formats.name(module.e4m3_dtype), formats.name(module.e5m2_dtype)
