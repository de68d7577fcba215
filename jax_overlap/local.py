"""The ops on one rank's shards (inside shard_map, or a custom partitioning's body), for any gather/scatter axis.

The primitives gather and scatter x's rows (axis -2). Another axis is served
by a layout change, free on row-major arrays: the dims from that axis up to
the rows fold into one row dim, since a tiled gather (or scatter) along an
axis moves whole blocks of everything after it. So the fused kernels take any
axis but the last. Scattering matmul_rs's last axis (the output columns) is not
a row layout: it takes the XLA path (dot, then psum_scatter of the columns).
"""

from __future__ import annotations

import logging
import math

from jax_overlap import primitives, reference

log = logging.getLogger("jax_overlap")


def _fold(a, axis: int, end: int):
  """a with dims axis..end-1 (negative, end exclusive) merged into one."""
  shape = a.shape
  start, stop = a.ndim + axis, a.ndim + end
  return a.reshape(*shape[:start], math.prod(shape[start:stop]), *shape[stop:])


def ag_matmul(x, w, bias, *, axes, size, algorithm, w_kmajor, gather=-2):
  """(all_gather(x, gather) @ w + bias, all_gather(x, gather)); axes None: the local product."""
  if gather == -2:
    return primitives.ag_matmul(x, w, bias, axis_name=axes, axis_size=size, algorithm=algorithm,
                                w_kmajor=w_kmajor)
  y, gathered = primitives.ag_matmul(_fold(x, gather, -1), w, bias, axis_name=axes, axis_size=size,
                                     algorithm=algorithm, w_kmajor=w_kmajor)
  mid = x.shape[x.ndim + gather + 1:-1]
  gathered_shape = (*x.shape[:x.ndim + gather], size * x.shape[gather], *mid)
  n_ndim = w.ndim - 1
  return (y.reshape(*gathered_shape, *y.shape[y.ndim - n_ndim:]),
          gathered.reshape(*gathered_shape, x.shape[-1]))


def matmul_rs(x, w, bias, *, axes, size, algorithm, w_kmajor, scatter=-2):
  """psum_scatter(x @ w, scatter) + bias, scatter a dim of the output; axes None: the local product."""
  contract = w.ndim - 1
  if scatter == -1:
    return _matmul_rs_columns(x, w, bias, axes=axes, size=size, w_kmajor=w_kmajor)
  if scatter == -2:
    return primitives.matmul_rs(x, w, bias, axis_name=axes, axis_size=size, algorithm=algorithm,
                                w_kmajor=w_kmajor)
  out_lead = x.shape[:x.ndim - contract]
  z = primitives.matmul_rs(_fold(x, scatter + 1 - contract, -contract), w, bias, axis_name=axes, axis_size=size,
                           algorithm=algorithm, w_kmajor=w_kmajor)
  start = len(out_lead) + scatter + 1
  return z.reshape(*out_lead[:start], out_lead[start] // size, *out_lead[start + 1:], z.shape[-1])


def _matmul_rs_columns(x, w, bias, *, axes, size, w_kmajor):
  """The XLA path of a scatter over the output columns: this rank keeps its block of them, and of the bias."""
  del size
  log.debug("jax_overlap.matmul_rs: XLA path (scatter over the output columns; the fused kernels scatter rows)")
  return reference.matmul_rs(x, w, bias, axis_name=axes, w_kmajor=w_kmajor, scatter=-1)


def matmul_psum(x, w, bias, *, axes, w_kmajor):
  """psum(x @ w) + bias: the reduction of a global-array matmul_rs whose output is not scattered (XLA)."""
  return reference.matmul_psum(x, w, bias, axis_name=axes, w_kmajor=w_kmajor)
