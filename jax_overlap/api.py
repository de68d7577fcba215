"""Public functions: argument checks at trace time, dispatch, and the custom VJPs.

The two ops are each other's gradient:
  ag_matmul  y = AG(x) @ W + b:  dx = RS(dy @ W^T)          (a matmul_rs)
                                 dW = AG(x)^T @ dy          (the forward's gathered x, no second gather)
  matmul_rs  z = RS(x @ W) + b:  dx = AG(dz) @ W^T          (an ag_matmul)
                                 dW = x^T @ AG(dz)          (that ag_matmul's gathered dz)
so the fused kernels serve the backward pass too; W^T is never materialized
(the kernels read w in either layout).

Inside shard_map every operand is first made varying over the group's axes,
so the gradient of a replicated operand (a shared bias, replicated weights)
is summed over the group by JAX's own transpose of that cast.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_overlap import _compat, config, native, partitioning, primitives


def _check_algorithm(op: str, algorithm) -> None:
  if algorithm not in config.ALGORITHMS:
    raise ValueError(f"jax_overlap.{op}: algorithm must be one of {config.ALGORITHMS}, got {algorithm!r}")
  if algorithm in ("fused", "pipelined") and native.platform() is None:
    raise ValueError(f"jax_overlap.{op}: algorithm={algorithm!r} needs the native GPU extension, and this "
                     f"installation has none ({native.build_info().get('note', '')}); use 'auto' or 'xla'")


def _check_operands(op: str, x, w, bias, k_name: str) -> int:
  """Validates dtypes and shapes; returns the output column count."""
  for name, v in (("x", x), ("w", w)) + ((("bias", bias),) if bias is not None else ()):
    if not hasattr(v, "shape") or not hasattr(v, "dtype"):
      raise TypeError(f"jax_overlap.{op}: {name} must be an array, got {type(v).__name__}")
    if np.dtype(v.dtype).name not in config.ACCEPTED_DTYPE_NAMES:
      raise TypeError(f"jax_overlap.{op}: {name} must have dtype bfloat16, float16 or float32, got {v.dtype}")
  if w.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
    got = f"x {x.dtype}, w {w.dtype}" + (f", bias {bias.dtype}" if bias is not None else "")
    raise TypeError(f"jax_overlap.{op}: x, w and bias must share one dtype, got {got}")
  if x.ndim < 2:
    raise ValueError(f"jax_overlap.{op}: x must have rank >= 2 ([..., rows, {k_name}]), got shape {x.shape}")
  if w.ndim != 2:
    raise ValueError(f"jax_overlap.{op}: w must have rank 2 ([{k_name}, n]), got shape {w.shape}")
  if w.shape[0] != x.shape[-1]:
    raise ValueError(f"jax_overlap.{op}: w's first dim must equal x's last dim ({k_name} = {x.shape[-1]}), "
                     f"got w of shape {w.shape}")
  n = w.shape[1]
  if bias is not None and tuple(bias.shape) != (n,):
    raise ValueError(f"jax_overlap.{op}: bias must have shape ({n},) to match w's columns, got {bias.shape}")
  return n


def _group(op: str, axis_name) -> tuple[tuple, int]:
  """(axes, size) of a shard_map axis name or tuple of names; ValueError if unbound."""
  axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  if not axes or not all(isinstance(a, str) for a in axes):
    raise TypeError(f"jax_overlap.{op}: axis_name must be a mesh axis name or a tuple of them, got {axis_name!r}")
  try:
    size = 1
    for a in axes:
      size *= _compat.axis_size(a)
  except NameError as e:
    raise ValueError(f"jax_overlap.{op}: axis_name {axis_name!r} is not bound here; call it inside "
                     f"jax.shard_map over a mesh with that axis, or pass axis_name=None for global arrays "
                     f"under jit") from e
  return axes, size


def _varying(axes, *values):
  """Casts every operand to vary over the group's axes and every axis any operand varies over.

  Then the custom VJPs' cotangents have their primal's type, and JAX's transpose
  of each cast sums a gradient over the axes its operand was replicated on
  (a bias replicated over the group, weights replicated over a data axis).
  """
  union = set(axes)
  for v in values:
    if v is not None:
      union |= _compat.varying_axes(v)
  ordered = tuple(axes) + tuple(sorted(union - set(axes)))
  return tuple(None if v is None else _compat.make_varying(v, ordered) for v in values)


def _empty_result(x, w, bias, rows: int, cols: int, axes):
  """The value of a call with an empty dimension: the bias (or zeros) in the output's shape."""
  out = jnp.zeros((*x.shape[:-2], rows, cols), x.dtype)
  if bias is not None:
    out = out + bias.astype(x.dtype)
  return out if axes is None else _compat.make_varying(out, axes)


# --- forward functions of either mode: axes None = global arrays (custom partitioning)

def _ag_forward(x, w, bias, axes, size, algorithm, w_kmajor):
  if axes is None:
    return partitioning.ag_matmul(x, w, bias, algorithm=algorithm, w_kmajor=w_kmajor)
  return primitives.ag_matmul(x, w, bias, axis_name=axes, axis_size=size, algorithm=algorithm, w_kmajor=w_kmajor)


def _rs_forward(x, w, bias, axes, size, algorithm, w_kmajor):
  if axes is None:
    return partitioning.matmul_rs(x, w, bias, algorithm=algorithm, w_kmajor=w_kmajor)
  return primitives.matmul_rs(x, w, bias, axis_name=axes, axis_size=size, algorithm=algorithm, w_kmajor=w_kmajor)


def _weight_grad(a, b, w_kmajor):
  """dW for y = a @ W: a^T @ b over all leading dims; transposed when w is stored [n, k]."""
  lead = tuple(range(a.ndim - 1))
  dw = lax.dot_general(a, b, ((lead, lead), ((), ())), preferred_element_type=jnp.float32)
  return (dw.T if w_kmajor else dw).astype(a.dtype)


def _bias_grad(dy, bias):
  return None if bias is None else dy.sum(axis=tuple(range(dy.ndim - 1))).astype(bias.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _ag(x, w, bias, axes, size, algorithm, w_kmajor):
  return _ag_forward(x, w, bias, axes, size, algorithm, w_kmajor)[0]


def _ag_fwd(x, w, bias, axes, size, algorithm, w_kmajor):
  y, gathered = _ag_forward(x, w, bias, axes, size, algorithm, w_kmajor)
  return y, (gathered, w, bias)


def _ag_bwd(axes, size, algorithm, w_kmajor, res, dy):
  gathered, w, bias = res
  dx = _rs(dy, w, None, axes, size, algorithm, not w_kmajor)
  return dx, _weight_grad(gathered, dy, w_kmajor), _bias_grad(dy, bias)


_ag.defvjp(_ag_fwd, _ag_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _ag_gathered(x, w, bias, axes, size, algorithm, w_kmajor):
  return _ag_forward(x, w, bias, axes, size, algorithm, w_kmajor)


def _ag_gathered_fwd(x, w, bias, axes, size, algorithm, w_kmajor):
  y, gathered = _ag_forward(x, w, bias, axes, size, algorithm, w_kmajor)
  return (y, gathered), (gathered, w, bias)


def _ag_gathered_bwd(axes, size, algorithm, w_kmajor, res, cts):
  gathered, w, bias = res
  dy, dgathered = cts
  dx = _rs(dy, w, None, axes, size, algorithm, not w_kmajor)
  # The gathered output's own cotangent: the transpose of the all-gather.
  if axes is None:
    dx = dx + dgathered
  else:
    dx = dx + lax.psum_scatter(dgathered, axes, scatter_dimension=dgathered.ndim - 2, tiled=True)
  return dx, _weight_grad(gathered, dy, w_kmajor), _bias_grad(dy, bias)


_ag_gathered.defvjp(_ag_gathered_fwd, _ag_gathered_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _rs(x, w, bias, axes, size, algorithm, w_kmajor):
  return _rs_forward(x, w, bias, axes, size, algorithm, w_kmajor)


def _rs_fwd(x, w, bias, axes, size, algorithm, w_kmajor):
  return _rs_forward(x, w, bias, axes, size, algorithm, w_kmajor), (x, w, bias)


def _rs_bwd(axes, size, algorithm, w_kmajor, res, dz):
  x, w, bias = res
  dx, dz_gathered = _ag_gathered(dz, w, None, axes, size, algorithm, not w_kmajor)
  return dx, _weight_grad(x, dz_gathered, w_kmajor), _bias_grad(dz, bias)


_rs.defvjp(_rs_fwd, _rs_bwd)


def ag_matmul(x, w, bias=None, *, axis_name=None, algorithm: str = "auto", return_gathered: bool = False):
  """All-gather x's rows over a mesh axis and multiply by w: the column-parallel linear layer.

  Inside jax.shard_map (axis_name names a bound mesh axis, or a tuple of axes, of size T):
    x:    [..., m, K] local row shard (any leading batch dims; gathered along axis -2)
    w:    [K, n] local column shard of the weight
    bias: [n] or None
    returns all_gather(x, axis=-2, tiled) @ w + bias, shape [..., T*m, n], in x's dtype;
    with return_gathered=True, (y, gathered_x).
  With axis_name=None: global arrays under jit; computes x @ w + bias, partitioned
  from the input shardings (x's rows and w's columns sharded on one axis -> the
  fused all-gather GEMM, y sharded by columns; see jax_overlap.partitioning).

  algorithm: "auto" (fused kernel where eligible and predicted faster, else XLA),
  "fused" (the fused kernel or an error), "xla" (all_gather + dot).
  Differentiable (reverse mode) and vmappable.
  """
  _check_algorithm("ag_matmul", algorithm)
  _check_operands("ag_matmul", x, w, bias, "K")
  if axis_name is None:
    axes, size = None, 1
  else:
    axes, size = _group("ag_matmul", axis_name)
    x, w, bias = _varying(axes, x, w, bias)
  if 0 in x.shape or 0 in w.shape:
    # Nothing to multiply; collectives of empty arrays do not lower.
    rows = size * x.shape[-2]
    y = _empty_result(x, w, bias, rows, w.shape[1], axes)
    if not return_gathered:
      return y
    if 0 in x.shape or axes is None:
      gathered = jnp.zeros((*x.shape[:-2], rows, x.shape[-1]), x.dtype) if 0 in x.shape else x
    else:
      gathered = lax.all_gather(x, axes, axis=x.ndim - 2, tiled=True)
    return y, gathered
  if return_gathered:
    return _ag_gathered(x, w, bias, axes, size, algorithm, False)
  return _ag(x, w, bias, axes, size, algorithm, False)


def matmul_rs(x, w, bias=None, *, axis_name=None, algorithm: str = "auto"):
  """Multiply by w and reduce-scatter the partial products' rows: the row-parallel linear layer.

  Inside jax.shard_map (axis_name bound, group size T):
    x:    [..., M, k] with the contraction dim sharded (k = K/T local)
    w:    [k, N] local row shard of the weight
    bias: [N] or None, added once after the reduction
    returns psum_scatter(x @ w, axis=-2, tiled) + bias, shape [..., M/T, N]; M must be divisible by T.
  With axis_name=None: global arrays under jit; computes x @ w + bias, partitioned
  from the input shardings (x's last dim and w's first dim sharded on one axis ->
  the fused GEMM reduce-scatter, output sharded by rows).

  algorithm: "auto", "fused" or "xla" (dot + psum_scatter). Differentiable and vmappable.
  """
  _check_algorithm("matmul_rs", algorithm)
  _check_operands("matmul_rs", x, w, bias, "k")
  if axis_name is None:
    if 0 in x.shape or 0 in w.shape:
      return _empty_result(x, w, bias, x.shape[-2], w.shape[1], None)
    return _rs(x, w, bias, None, 1, algorithm, False)
  axes, size = _group("matmul_rs", axis_name)
  if x.shape[-2] % size:
    raise ValueError(f"jax_overlap.matmul_rs: x's rows ({x.shape[-2]}) must be divisible by the size of axis "
                     f"{axis_name!r} ({size})")
  x, w, bias = _varying(axes, x, w, bias)
  if 0 in x.shape or 0 in w.shape:
    return _empty_result(x, w, bias, x.shape[-2] // size, w.shape[1], axes)
  return _rs(x, w, bias, axes, size, algorithm, False)


def all_gather(x, *, axis_name):
  """The runtime's all-gather of x's rows (axis -2, tiled) inside shard_map.

  On a GPU build it runs on the symmetric workspace (it is how the runtime is
  tested end to end); elsewhere it is lax.all_gather.
  """
  if not hasattr(x, "ndim") or x.ndim < 2:
    raise ValueError(f"jax_overlap.all_gather: x must have rank >= 2, got {getattr(x, 'shape', x)}")
  axes, size = _group("all_gather", axis_name)
  (x,) = _varying(axes, x)
  return primitives.all_gather(x, axis_name=axes, axis_size=size)
