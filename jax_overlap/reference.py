"""The XLA reference decompositions: the fallback path and the test oracle.

Inside shard_map (axis_name given):
  ag_matmul:  all_gather(x, axis -2, tiled) @ w + bias          -> (y, gathered)
  matmul_rs:  psum_scatter(x @ w, axis -2, tiled) + bias         -> z
With axis_name None both are the local product. `w_kmajor` means w is given
transposed, as [n, k]: the backward passes use it to avoid materializing w.T.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def local_matmul(x, w, *, w_kmajor: bool = False):
  contract_w = 1 if w_kmajor else 0
  dims = (((x.ndim - 1,), (contract_w,)), ((), ()))
  return lax.dot_general(x, w, dims, preferred_element_type=jnp.float32).astype(x.dtype)


def _add_bias(y, bias):
  return y if bias is None else y + bias.astype(y.dtype)


def ag_matmul(x, w, bias=None, *, axis_name=None, w_kmajor: bool = False):
  gathered = x if axis_name is None else lax.all_gather(x, axis_name, axis=x.ndim - 2, tiled=True)
  return _add_bias(local_matmul(gathered, w, w_kmajor=w_kmajor), bias), gathered


def matmul_rs(x, w, bias=None, *, axis_name=None, w_kmajor: bool = False):
  partial = local_matmul(x, w, w_kmajor=w_kmajor)
  if axis_name is not None:
    partial = lax.psum_scatter(partial, axis_name, scatter_dimension=x.ndim - 2, tiled=True)
  return _add_bias(partial, bias)
