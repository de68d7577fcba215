"""The XLA reference decompositions: the fallback path and the test oracle.

Inside shard_map (axis_name given):
  ag_matmul:  all_gather(x, axis -2, tiled) @ w + bias          -> (y, gathered)
  matmul_rs:  psum_scatter(x @ w, axis -2, tiled) + bias         -> z
With axis_name None both are the local product.

Shapes: ag_matmul contracts x [..., m, K] with w [K, *n] (bias [*n]); matmul_rs
contracts x's trailing dims [..., M, *k] with w [*k, N] (bias [N]). `w_kmajor`
means w is stored with the contraction last ([*n, K], [N, *k]): the backward
passes use it so that w is never transposed in memory.

Numerics follow the fused kernels: products accumulate in float32, the bias is
added in float32 and the sum is rounded once to x's dtype. matmul_rs's partial
products are rounded to x's dtype before the reduce-scatter (the fused kernel
exchanges them in that dtype too).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def local_matmul(x, w, *, w_kmajor: bool = False, contract: int = 1):
  """x's last `contract` dims times w's first (or, w_kmajor, last) `contract` dims, in float32."""
  x_dims = tuple(range(x.ndim - contract, x.ndim))
  w_dims = tuple(range(w.ndim - contract, w.ndim)) if w_kmajor else tuple(range(contract))
  return lax.dot_general(x, w, ((x_dims, w_dims), ((), ())), preferred_element_type=jnp.float32)


def _finish(acc, bias, dtype):
  """acc (+ bias in float32), rounded once to dtype."""
  if bias is not None:
    acc = acc.astype(jnp.float32) + bias.astype(jnp.float32)
  return acc.astype(dtype)


def ag_matmul(x, w, bias=None, *, axis_name=None, w_kmajor: bool = False):
  gathered = x if axis_name is None else lax.all_gather(x, axis_name, axis=x.ndim - 2, tiled=True)
  return _finish(local_matmul(gathered, w, w_kmajor=w_kmajor), bias, x.dtype), gathered


def matmul_rs(x, w, bias=None, *, axis_name=None, w_kmajor: bool = False):
  contract = w.ndim - 1
  acc = local_matmul(x, w, w_kmajor=w_kmajor, contract=contract)
  if axis_name is not None:
    rows = x.ndim - contract - 1
    acc = lax.psum_scatter(acc.astype(x.dtype), axis_name, scatter_dimension=rows, tiled=True)
  return _finish(acc, bias, x.dtype)
