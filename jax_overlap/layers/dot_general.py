"""lax.dot_general-compatible layers on the ops: pass an instance as a layer's dot_general, or the class as
dot_general_cls (the layer adds its bias after the call). Frozen dataclasses, since layers hold and hash them."""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_overlap import api


class Layer:
  """Fields checked when made, and clear errors for a class passed where an instance belongs and the reverse."""

  ALGORITHMS: tuple = api.ALGORITHMS

  def __new__(cls, *args, **kwargs):
    if any(hasattr(a, "shape") for a in args) or {"precision", "preferred_element_type",
                                                   "dimension_numbers"} & set(kwargs):
      raise TypeError(f"jax_overlap.{cls.__name__} is a class and was called as a dot_general: pass an instance, "
                      f"dot_general=jax_overlap.{cls.__name__}() (or the class as dot_general_cls=, which the layer "
                      f"instantiates)")
    return super().__new__(cls)

  def __post_init__(self):
    check_fields(type(self).__name__, self.axis_name, self.algorithm, self.ALGORITHMS)

  def __call__(self, lhs=None, rhs=None, dimension_numbers=None, precision=None, preferred_element_type=None,
               out_sharding=None):
    del precision  # the products accumulate in float32 anyway
    check_operands(self, lhs, rhs, dimension_numbers)
    return self._dot(lhs, rhs, dimension_numbers, preferred_element_type, out_sharding)


def check_operands(layer, lhs, rhs, dimension_numbers) -> None:
  if lhs is None and rhs is None and dimension_numbers is None:
    name = type(layer).__name__
    raise TypeError(f"jax_overlap.{name}: an instance was called with no operands, as a layer calls "
                    f"dot_general_cls() to make its dot: pass the class, dot_general_cls=jax_overlap.{name} "
                    f"(functools.partial(jax_overlap.{name}, ...) to set its fields), or an instance as dot_general=")


def check_fields(layer: str, axis_name, algorithm, algorithms: tuple) -> None:
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  if axis_name is not None and not (names and all(isinstance(a, str) for a in names)):
    raise TypeError(f"jax_overlap.{layer}: axis_name must be None (global arrays under jit), a mesh axis name or a "
                    f"tuple of them, got {axis_name!r}")
  if algorithm not in algorithms:
    raise ValueError(f"jax_overlap.{layer}: algorithm must be one of {algorithms}, got {algorithm!r}")


def check_bound(layer: str, axis_name) -> None:
  """Before any cast to vary over axis_name: JAX's error for an unbound axis is a bare AssertionError."""
  if axis_name is not None:
    api.axis_group(layer, axis_name)


def check_dim(layer: str, name: str, value, optional: bool) -> None:
  if (value is None and optional) or (isinstance(value, (int, np.integer)) and not isinstance(value, bool)):
    return
  raise TypeError(f"jax_overlap.{layer}: {name} must be an int{' or None' if optional else ''}, got {value!r}")


def _dims(dimension_numbers):
  (lhs_c, rhs_c), (lhs_b, rhs_b) = dimension_numbers
  return tuple(lhs_c), tuple(rhs_c), tuple(lhs_b), tuple(rhs_b)


def check_dot(op: str, lhs, rhs, dimension_numbers, preferred_element_type, contract: int, expected: str) -> None:
  if not hasattr(lhs, "ndim") or not hasattr(rhs, "ndim"):
    return
  lhs_c, rhs_c, lhs_b, rhs_b = _dims(dimension_numbers)
  lhs_c = tuple(d % lhs.ndim for d in lhs_c)
  rhs_c = tuple(d % rhs.ndim for d in rhs_c)
  want_lhs = tuple(range(lhs.ndim - contract, lhs.ndim))
  if lhs_b or rhs_b or lhs_c != want_lhs or rhs_c != tuple(range(contract)):
    want = ((want_lhs, tuple(range(contract))), ((), ()))
    raise ValueError(f"jax_overlap.{op}: dimension_numbers must contract {expected} with no batch dims, i.e. "
                     f"{want} for x of shape {lhs.shape} and kernel of shape {rhs.shape}, got {dimension_numbers}")
  if preferred_element_type is not None and np.dtype(preferred_element_type) != np.dtype(lhs.dtype):
    raise ValueError(f"jax_overlap.{op}: preferred_element_type must be None or the inputs' dtype "
                     f"{np.dtype(lhs.dtype).name}, got {np.dtype(preferred_element_type).name}")


def check_column_parallel(layer: str, lhs, rhs, dimension_numbers, preferred_element_type) -> None:
  check_dot(layer, lhs, rhs, dimension_numbers, preferred_element_type, 1, "x's last dim with the kernel's first")


def check_row_parallel(layer: str, lhs, rhs, dimension_numbers, preferred_element_type) -> int:
  """How many dims the kernel [*k, N] contracts."""
  if getattr(rhs, "ndim", 0) < 2:
    raise ValueError(f"jax_overlap.{layer}: the kernel must have rank >= 2 ([*k, N]), got shape "
                     f"{getattr(rhs, 'shape', rhs)}")
  contract = rhs.ndim - 1
  check_dot(layer, lhs, rhs, dimension_numbers, preferred_element_type, contract,
            f"x's last {contract} dims with the kernel's first {contract}")
  return contract


@dataclasses.dataclass(frozen=True)
class AgDotGeneral(Layer):
  """ag_matmul as a dot_general: the column-parallel layer, kernel [K, *n], x [..., K].

  axis_name: None on global arrays under jit, or the mesh axis (or axes) rows are gathered over inside shard_map.
  algorithm: "auto", "pipelined", "fused" or "xla" (ag_matmul's). gather_axis: x's gathered dim (default -2).

  Example (flax.nnx; with x's rows and the kernel's columns sharded on one axis):

    layer = nnx.Linear(512, 2048, dot_general=jax_overlap.AgDotGeneral(), rngs=nnx.Rngs(0))
  """

  axis_name: str | tuple | None = None
  algorithm: str = "auto"
  gather_axis: int = -2

  def __post_init__(self):
    super().__post_init__()
    check_dim("AgDotGeneral", "gather_axis", self.gather_axis, optional=False)

  def _dot(self, lhs, rhs, dimension_numbers, preferred_element_type, out_sharding):
    check_column_parallel("AgDotGeneral", lhs, rhs, dimension_numbers, preferred_element_type)
    check_bound("AgDotGeneral", self.axis_name)
    return api.ag_matmul(lhs, rhs, axis_name=self.axis_name, algorithm=self.algorithm,
                         gather_axis=self.gather_axis, out_sharding=out_sharding)


@dataclasses.dataclass(frozen=True)
class RsDotGeneral(Layer):
  """matmul_rs as a dot_general: the row-parallel layer, kernel [*k, N], x [..., *k]. axis_name: as AgDotGeneral's.
  algorithm: "auto", "pipelined", "fused" or "xla" (matmul_rs's). scatter_axis: the output dim scattered onto
  (None: the rows inside shard_map, the plan's on global arrays).

  Example (flax.nnx; with x's and the kernel's contraction sharded on one axis):

    layer = nnx.Linear(2048, 512, dot_general=jax_overlap.RsDotGeneral(), rngs=nnx.Rngs(0))
  """

  axis_name: str | tuple | None = None
  algorithm: str = "auto"
  scatter_axis: int | None = None

  def __post_init__(self):
    super().__post_init__()
    check_dim("RsDotGeneral", "scatter_axis", self.scatter_axis, optional=True)

  def _dot(self, lhs, rhs, dimension_numbers, preferred_element_type, out_sharding):
    check_row_parallel("RsDotGeneral", lhs, rhs, dimension_numbers, preferred_element_type)
    check_bound("RsDotGeneral", self.axis_name)
    return api.matmul_rs(lhs, rhs, axis_name=self.axis_name, algorithm=self.algorithm,
                         scatter_axis=self.scatter_axis, out_sharding=out_sharding)
