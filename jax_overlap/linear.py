"""dot_general-compatible callables, so layer libraries run their linear layers on jax_overlap.

Pass one as a layer's dot_general (or the class as dot_general_cls):

  flax.linen   Dense / DenseGeneral(dot_general=...), MultiHeadDotProductAttention(qkv_dot_general=AgDotGeneral(),
               out_dot_general=RsDotGeneral())
  flax.nnx     Linear / LinearGeneral(dot_general=...), MultiHeadAttention(qkv_dot_general=..., out_dot_general=...)

AgDotGeneral is the column-parallel layer (ag_matmul): it contracts x's last dim
with the kernel's first, kernels [K, *n] ([embed, heads, head_dim] for QKV,
[embed, 2, ffn] for a gated MLP). RsDotGeneral is the row-parallel layer
(matmul_rs): it contracts x's trailing dims with the kernel's leading ones,
kernels [*k, N] ([heads, head_dim, embed] for the attention output, [ffn, embed]).
The layer adds its bias after the call (not fused). Inputs take any leading dims.

With axis_name=None (global arrays under jit) the result is x @ kernel, and the
shardings decide the collectives; inside shard_map (axis_name given) the result
is the op's: rows gathered (AgDotGeneral) or reduce-scattered (RsDotGeneral).
`precision` is accepted and not used (the products accumulate in float32);
preferred_element_type may be None or the inputs' dtype; out_sharding is passed on.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_overlap import api


def _dims(dimension_numbers):
  (lhs_c, rhs_c), (lhs_b, rhs_b) = dimension_numbers
  return tuple(lhs_c), tuple(rhs_c), tuple(lhs_b), tuple(rhs_b)


def _check(op: str, lhs, rhs, dimension_numbers, preferred_element_type, contract: int, expected: str) -> None:
  if not hasattr(lhs, "ndim") or not hasattr(rhs, "ndim"):
    return  # the op names the argument that is not an array
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


@dataclasses.dataclass(frozen=True)
class AgDotGeneral:
  """lax.dot_general's signature on ag_matmul: kernel [K, *n], x [..., K].

  algorithm: "auto", "pipelined", "fused" or "xla", as jax_overlap.ag_matmul takes it.
  """

  axis_name: str | tuple | None = None
  algorithm: str = "auto"
  gather_axis: int = -2

  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
    del precision
    _check("AgDotGeneral", lhs, rhs, dimension_numbers, preferred_element_type, 1,
           "x's last dim with the kernel's first")
    return api.ag_matmul(lhs, rhs, axis_name=self.axis_name, algorithm=self.algorithm,
                         gather_axis=self.gather_axis, out_sharding=out_sharding)


@dataclasses.dataclass(frozen=True)
class RsDotGeneral:
  """lax.dot_general's signature on matmul_rs: kernel [*k, N], x [..., *k].

  algorithm: "auto", "pipelined", "fused" or "xla", as jax_overlap.matmul_rs takes it.
  """

  axis_name: str | tuple | None = None
  algorithm: str = "auto"
  scatter_axis: int | None = None

  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
    del precision
    if getattr(rhs, "ndim", 0) < 2:
      raise ValueError(f"jax_overlap.RsDotGeneral: the kernel must have rank >= 2 ([*k, N]), got shape "
                       f"{getattr(rhs, 'shape', rhs)}")
    contract = rhs.ndim - 1
    _check("RsDotGeneral", lhs, rhs, dimension_numbers, preferred_element_type, contract,
           f"x's last {contract} dims with the kernel's first {contract}")
    return api.matmul_rs(lhs, rhs, axis_name=self.axis_name, algorithm=self.algorithm,
                         scatter_axis=self.scatter_axis, out_sharding=out_sharding)
