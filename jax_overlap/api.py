"""Public functions: argument checks at trace time, dispatch, and the custom VJPs.

The two ops are each other's gradient:
  ag_matmul  y = AG(x) @ W + b:  dx = RS(dy @ W^T)          (a matmul_rs)
                                 dW = AG(x)^T @ dy          (the forward's gathered x, no second gather)
  matmul_rs  z = RS(x @ W) + b:  dx = AG(dz) @ W^T          (an ag_matmul)
                                 dW = x^T @ AG(dz)          (that ag_matmul's gathered dz)
so the fused kernels serve the backward pass too; W^T is never materialized
(the kernels read w in either layout). The gather axis of one is the scatter
axis of its dual.

Inside shard_map every operand is first made varying over the group's axes,
so the gradient of a replicated operand (a shared bias, replicated weights)
is summed over the group by JAX's own transpose of that cast. On global arrays
the gradients come back in their primal's layout: resharded to its type on an
Explicit mesh, tied to it with shard_alike on an Auto mesh.

The results the backward pass reads carry checkpoint names (remat.py).

The custom VJPs serve first-order reverse mode (jax.grad, jax.vjp,
jax.linearize). Forward mode, second derivatives and (on global arrays over
several devices) jax.export raise errors that say so; algorithm="xla" is the
XLA decomposition as plain JAX ops, which takes every transformation.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jax_overlap import _compat, config, local, native, partitioning, primitives, reference, remat
from jax_overlap.sharding_plan import ag_plan, rs_plan, spec_of

log = logging.getLogger("jax_overlap")


@dataclasses.dataclass(frozen=True)
class _Call:
  """How one call runs, besides its operands (static under jit)."""

  axes: tuple | None  # the shard_map group's mesh axes; None for global arrays
  size: int  # the group's size (1 for global arrays)
  algorithm: str
  axis: int | None  # ag_matmul: x's gather dim; matmul_rs: the output's scatter dim (negative; None: the plan's)
  request: tuple | None = None  # global matmul_rs: the output spec asked for (sharding_plan.spec_of form)

  def dual(self, axis, request=None):
    return dataclasses.replace(self, axis=axis, request=request)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Layout:
  """A primal's sharding on an Explicit mesh, kept as a residual (static: no array)."""

  sharding: NamedSharding


# --- argument checks -------------------------------------------------------------

def _check_algorithm(op: str, algorithm) -> None:
  if algorithm not in config.ALGORITHMS:
    raise ValueError(f"jax_overlap.{op}: algorithm must be one of {config.ALGORITHMS}, got {algorithm!r}")
  if algorithm in ("fused", "pipelined") and native.platform() is None:
    raise ValueError(f"jax_overlap.{op}: algorithm={algorithm!r} needs the native GPU extension, and this "
                     f"installation has none ({native.build_info().get('note', '')}); use 'auto' or 'xla'")


def _check_arrays(op: str, x, w, bias) -> None:
  for name, v in (("x", x), ("w", w)) + ((("bias", bias),) if bias is not None else ()):
    if not hasattr(v, "shape") or not hasattr(v, "dtype"):
      raise TypeError(f"jax_overlap.{op}: {name} must be an array, got {type(v).__name__}")
    if np.dtype(v.dtype).name not in config.ACCEPTED_DTYPE_NAMES:
      raise TypeError(f"jax_overlap.{op}: {name} must have dtype bfloat16, float16, float32 or float64 (the XLA path "
                      f"only), got {v.dtype}")
  if w.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
    got = f"x {x.dtype}, w {w.dtype}" + (f", bias {bias.dtype}" if bias is not None else "")
    raise TypeError(f"jax_overlap.{op}: x, w and bias must share one dtype, got {got}")
  if x.ndim < 2:
    raise ValueError(f"jax_overlap.{op}: x must have rank >= 2 ([..., rows, K]), got shape {x.shape}")
  if w.ndim < 2:
    raise ValueError(f"jax_overlap.{op}: w must have rank >= 2, got shape {w.shape}")


def _check_ag_operands(x, w, bias) -> tuple:
  """w [K, *n]: returns n."""
  _check_arrays("ag_matmul", x, w, bias)
  if w.shape[0] != x.shape[-1]:
    raise ValueError(f"jax_overlap.ag_matmul: w's first dim must equal x's last dim (K = {x.shape[-1]}), "
                     f"got w of shape {w.shape}")
  n = tuple(w.shape[1:])
  if bias is not None and tuple(bias.shape) != n:
    raise ValueError(f"jax_overlap.ag_matmul: bias must have shape {n} to match w's columns, got {bias.shape}")
  return n


def _check_rs_operands(x, w, bias) -> int:
  """w [*k, N], contracted with x's trailing dims: returns N."""
  _check_arrays("matmul_rs", x, w, bias)
  k = tuple(w.shape[:-1])
  if x.ndim < len(k) + 1:
    raise ValueError(f"jax_overlap.matmul_rs: x must have rank >= {len(k) + 1} (rows and w's {len(k)} contracted "
                     f"dims {k}), got shape {x.shape}")
  if tuple(x.shape[x.ndim - len(k):]) != k:
    if len(k) == 1:
      raise ValueError(f"jax_overlap.matmul_rs: w's first dim must equal x's last dim (k = {x.shape[-1]}), "
                       f"got w of shape {w.shape}")
    raise ValueError(f"jax_overlap.matmul_rs: w's leading dims {k} must equal x's trailing dims, got x of shape "
                     f"{x.shape}")
  n = w.shape[-1]
  if bias is not None and tuple(bias.shape) != (n,):
    raise ValueError(f"jax_overlap.matmul_rs: bias must have shape ({n},) to match w's columns, got {bias.shape}")
  return n


def _check_axis(op: str, name: str, value, ndim: int, last: int) -> int:
  """A dim index in [-ndim, last] (negative) or its non-negative equivalent, as a negative index."""
  valid = f"an int in [{-ndim}, {last}] or [0, {ndim + last}]"
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"jax_overlap.{op}: {name} must be {valid}, got {value!r}")
  index = int(value) - ndim if value >= 0 else int(value)
  if not -ndim <= index <= last:
    raise ValueError(f"jax_overlap.{op}: {name} must be {valid} for this call's {ndim}-dim "
                     f"{'x' if name == 'gather_axis' else 'output'}, got {value}")
  return index


def _check_out_sharding(op: str, out_sharding, out_shape: tuple, axis_name) -> None:
  if out_sharding is None:
    return
  if axis_name is not None:
    raise ValueError(f"jax_overlap.{op}: out_sharding applies to global arrays (axis_name=None); inside "
                     f"shard_map the output is this rank's block, got axis_name={axis_name!r}")
  if not isinstance(out_sharding, (NamedSharding, PartitionSpec)):
    raise TypeError(f"jax_overlap.{op}: out_sharding must be a NamedSharding or a PartitionSpec, "
                    f"got {type(out_sharding).__name__}")
  spec = out_sharding.spec if isinstance(out_sharding, NamedSharding) else out_sharding
  if len(spec) > len(out_shape):
    raise ValueError(f"jax_overlap.{op}: out_sharding has {len(spec)} entries for a {len(out_shape)}-dim output, "
                     f"got {spec}")
  mesh = out_sharding.mesh if isinstance(out_sharding, NamedSharding) else jax.sharding.get_abstract_mesh()
  if isinstance(out_sharding, PartitionSpec) and mesh.empty:
    raise ValueError(f"jax_overlap.{op}: out_sharding={out_sharding} is a PartitionSpec, which needs a mesh: "
                     f"pass a NamedSharding, or set one with jax.set_mesh")
  # The plans never make uneven shards (XLA pads them, and the padding must not reach a product), so a layout
  # that splits a dim unevenly could only be made after the call, and JAX refuses it on Explicit meshes.
  for dim, (axes, size) in enumerate(zip(spec_of(spec, len(out_shape)), out_shape)):
    missing = [a for a in axes or () if a not in mesh.shape]
    if missing:
      raise ValueError(f"jax_overlap.{op}: out_sharding={spec} names {missing}, which the mesh "
                       f"{tuple(mesh.axis_names)} does not have")
    parts = math.prod(mesh.shape[a] for a in axes or ())
    if size % parts:
      raise ValueError(f"jax_overlap.{op}: out_sharding={spec} splits the output's dim {dim} ({size}) over "
                       f"{axes} ({parts} parts), which does not divide it; shard that dim on axes whose size "
                       f"divides {size}, or leave it unsharded")


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
    bound = _compat.bound_axis_names()
    where = f"the axes bound here are {bound}" if bound else "no axis is bound here"
    raise ValueError(f"jax_overlap.{op}: axis_name {axis_name!r} is not bound here ({where}); call it inside "
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


# --- layouts of global arrays ------------------------------------------------------

def _explicit_sharding(v):
  sharding = jax.typeof(v).sharding
  return sharding if primitives._explicit_mesh(jax.typeof(v)) is not None else None


def _layout(v, call: _Call):
  """What v's cotangent must be laid out like: its type on an Explicit mesh, v itself on an Auto mesh."""
  if call.axes is not None or v is None:
    return None
  sharding = _explicit_sharding(v)
  return v if sharding is None else _Layout(sharding)


def _like(ct, layout):
  if ct is None or layout is None:
    return ct
  if isinstance(layout, _Layout):
    return ct if jax.typeof(ct).sharding == layout.sharding else jax.sharding.reshard(ct, layout.sharding)
  return _compat.shard_alike(ct, layout)[0]


def _request(layout, ndim: int):
  return tuple(spec_of(layout.sharding, ndim)) if isinstance(layout, _Layout) else None


def _constrain(out, out_sharding):
  """out in the layout out_sharding asks for: a constraint on an Auto mesh, a reshard on an Explicit one."""
  if out_sharding is None:
    return out
  if _explicit_sharding(out) is None:
    return lax.with_sharding_constraint(out, out_sharding)
  if spec_of(jax.typeof(out).sharding, out.ndim) == spec_of(out_sharding, out.ndim):
    return out
  return jax.sharding.reshard(out, out_sharding)


# --- forward functions of either mode ----------------------------------------------

def _ag_forward(x, w, bias, call: _Call, w_kmajor: bool):
  if call.axes is None:
    return partitioning.ag_matmul(x, w, bias, algorithm=call.algorithm, w_kmajor=w_kmajor, gather=call.axis)
  return local.ag_matmul(x, w, bias, axes=call.axes, size=call.size, algorithm=call.algorithm, w_kmajor=w_kmajor,
                         gather=call.axis)


def _rs_forward(x, w, bias, call: _Call, w_kmajor: bool):
  if call.axes is None:
    return partitioning.matmul_rs(x, w, bias, algorithm=call.algorithm, w_kmajor=w_kmajor, scatter=call.axis,
                                  request=call.request)
  return local.matmul_rs(x, w, bias, axes=call.axes, size=call.size, algorithm=call.algorithm, w_kmajor=w_kmajor,
                         scatter=call.axis)


def _weight_grad(a, b, a_free: int, w_layout, w_kmajor: bool):
  """dW for out = a @ W: a^T @ b over every dim but a's last a_free and b's own, laid out like w.

  w_kmajor stores W with the contraction last, so the product runs b^T @ a.
  """
  lead = tuple(range(a.ndim - a_free))
  first, second = (b, a) if w_kmajor else (a, b)
  sharding = w_layout.sharding if isinstance(w_layout, _Layout) else None
  dw = lax.dot_general(first, second, ((lead, lead), ((), ())),
                       preferred_element_type=reference.accumulator(a.dtype), out_sharding=sharding)
  return _like(dw.astype(a.dtype), w_layout)


def _bias_grad(dy, bias, bias_layout):
  if bias is None:
    return None
  db = dy.astype(reference.accumulator(dy.dtype)).sum(axis=tuple(range(dy.ndim - bias.ndim))).astype(bias.dtype)
  return _like(db, bias_layout)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _ag(x, w, bias, call, w_kmajor):
  return _ag_forward(x, w, bias, call, w_kmajor)[0]


def _ag_fwd(x, w, bias, call, w_kmajor):
  y, gathered = _ag_forward(x, w, bias, call, w_kmajor)
  layouts = tuple(_layout(v, call) for v in (x, w, bias))
  return y, (remat.tag(gathered, remat.AG_GATHERED), w, bias, layouts)


def _ag_grads(call, w_kmajor, res, dy, dgathered=None):
  gathered, w, bias, (x_layout, w_layout, bias_layout) = res
  dx = _rs(dy, w, None, call.dual(call.axis if call.axes else None, _request(x_layout, gathered.ndim)),
           not w_kmajor)
  if dgathered is not None:  # the gathered output's own cotangent: the transpose of the all-gather
    if call.axes is None:
      dx = dx + dgathered
    else:
      dx = dx + reference.reduce_scatter(dgathered, call.axes, call.axis)
  return _like(dx, x_layout), _weight_grad(gathered, dy, 1, w_layout, w_kmajor), _bias_grad(dy, bias, bias_layout)


_ag.defvjp(_ag_fwd, lambda call, w_kmajor, res, dy: _ag_grads(call, w_kmajor, res, dy))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _ag_gathered(x, w, bias, call, w_kmajor):
  return _ag_forward(x, w, bias, call, w_kmajor)


def _ag_gathered_fwd(x, w, bias, call, w_kmajor):
  y, res = _ag_fwd(x, w, bias, call, w_kmajor)
  return (y, res[0]), res


_ag_gathered.defvjp(_ag_gathered_fwd, lambda call, w_kmajor, res, cts: _ag_grads(call, w_kmajor, res, *cts))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _rs(x, w, bias, call, w_kmajor):
  return _rs_forward(x, w, bias, call, w_kmajor)


def _rs_fwd(x, w, bias, call, w_kmajor):
  layouts = tuple(_layout(v, call) for v in (x, w, bias))
  return _rs_forward(x, w, bias, call, w_kmajor), (x, w, bias, layouts)


def _rs_bwd(call, w_kmajor, res, dz):
  x, w, bias, (x_layout, w_layout, bias_layout) = res
  # On global arrays the gather dim points the plan at the dim dz is sharded on; after a scatter of the columns
  # (-1) no dim of dz matches w's output axes, and the plan's plain partitioning gathers dz through XLA.
  gather = -2 if call.axis in (None, -1) else call.axis
  dx, dz_gathered = _ag_gathered(dz, w, None, call.dual(gather), not w_kmajor)
  k_ndim = w.ndim - 1
  return (_like(dx, x_layout), _weight_grad(x, dz_gathered, k_ndim, w_layout, w_kmajor),
          _bias_grad(dz, bias, bias_layout))


_rs.defvjp(_rs_fwd, _rs_bwd)


def _empty_result(shape, dtype, bias, axes):
  """The value of a call with an empty dimension: the bias (or zeros) in the output's shape."""
  out = jnp.zeros(shape, dtype)
  if bias is not None:
    out = out + bias.astype(dtype)
  return out if axes is None else _compat.make_varying(out, axes)


# --- algorithm="xla": plain JAX ops --------------------------------------------------
# The XLA decomposition written with JAX's own operations: no custom VJP, no
# primitive, no custom partitioning, so every JAX transformation takes it
# (forward mode, higher derivatives, any depth of vmap, jax.export). Inside
# shard_map it is reference.py's all-gather + dot and dot + reduce-scatter,
# the computation the other algorithms fall back to, differentiated by JAX. On
# global arrays it is the dot itself, partitioned by XLA (which reduces the
# float32 products); on a mesh with Explicit axes it is typed with the layouts the
# other algorithms' plans give (sharding_plan.py).

def _resharded(v, mesh, spec):
  if v is None or spec_of(jax.typeof(v).sharding, v.ndim) == spec_of(spec, v.ndim):
    return v
  return jax.sharding.reshard(v, NamedSharding(mesh, spec))


def _ag_plain(x, w, bias, call: _Call):
  log.debug("jax_overlap.ag_matmul: XLA path (algorithm='xla', as JAX ops)")
  if call.axes is not None:
    gathered = remat.tag(lax.all_gather(x, call.axes, axis=x.ndim + call.axis, tiled=True), remat.AG_GATHERED)
    return reference.ag_matmul(gathered, w, bias)[0], gathered
  mesh = primitives._explicit_mesh(jax.typeof(x))
  if mesh is None:
    return reference.ag_matmul(x, w, bias)[0], x
  p = ag_plan(mesh, spec_of(jax.typeof(x).sharding, x.ndim), spec_of(jax.typeof(w).sharding, w.ndim), x.shape,
              w.shape, False, call.axis)
  y = reference.local_matmul(x, w, out_sharding=NamedSharding(mesh, p.y))
  return reference.finish(y, _resharded(bias, mesh, p.bias), x.dtype), x


def _rs_plain(x, w, bias, call: _Call):
  log.debug("jax_overlap.matmul_rs: XLA path (%s, as JAX ops)", "algorithm='xla'" if call.algorithm == "xla" else
            "a scatter over the output columns; the GPU algorithms scatter rows")
  if call.axes is not None:
    return reference.matmul_rs(x, w, bias, axis_name=call.axes, scatter=call.axis)
  mesh = primitives._explicit_mesh(jax.typeof(x))
  if mesh is None:
    return reference.matmul_rs(x, w, bias)
  p = rs_plan(mesh, spec_of(jax.typeof(x).sharding, x.ndim), spec_of(jax.typeof(w).sharding, w.ndim), x.shape,
              w.shape, False, call.axis, call.request)
  z = reference.local_matmul(x, w, contract=w.ndim - 1, out_sharding=NamedSharding(mesh, p.out))
  return reference.finish(z, _resharded(bias, mesh, p.bias), x.dtype)


# JAX's refusal of forward mode through a custom VJP, raised inside a call (the second: jvp of a custom_vjp in an
# eager shard_map). The operands' tracers say it first, unless jax_use_direct_linearize is off: then reverse mode
# traces with JVP tracers too, and only these words tell the two apart.
_FORWARD_MODE = ("can't apply forward-mode autodiff (jvp) to a custom_vjp function", "unhashable type: 'Unhashable'")


def _reverse_mode(op: str, algorithm: str, fn, *args):
  """fn(*args), a custom VJP's call, with JAX's refusal of forward mode said in jax_overlap's words.

  Under jit JAX refuses only when it lowers the staged tangent, after the call
  returned: forward mode is recognised from the operands' tracers first.
  """
  message = primitives.unsupported(op, "forward-mode differentiation (jax.jvp, jax.jacfwd)", algorithm)
  if _compat.forward_mode(*args):
    raise TypeError(message)
  try:
    return fn(*args)
  except TypeError as e:
    if not str(e).startswith(_FORWARD_MODE):
      raise
    raise TypeError(message) from e


# --- the public functions ------------------------------------------------------------

def ag_matmul(x, w, bias=None, *, axis_name=None, algorithm: str = "auto", return_gathered: bool = False,
              gather_axis: int = -2, out_sharding=None):
  """All-gather x's rows over a mesh axis and multiply by w: the column-parallel linear layer.

  Inside jax.shard_map (axis_name names a bound mesh axis, or a tuple of axes, of size T):
    x:    [..., m, K] local row shard (any leading batch dims; gathered along gather_axis, default -2)
    w:    [K, *n] local shard of the weight (one or more output dims, e.g. [E, heads, head_dim])
    bias: [*n] or None
    returns all_gather(x, gather_axis, tiled) @ w + bias, shape [..., T*m, *n], in x's dtype;
    with return_gathered=True, (y, gathered_x).
  With axis_name=None: global arrays under jit; computes x @ w + bias, partitioned
  from the input shardings (x's gather dim and one of w's output dims sharded on
  the same axes -> the fused all-gather GEMM over them; see jax_overlap.partitioning),
  and out_sharding (a NamedSharding or PartitionSpec) lays out the result.

  gather_axis: any dim of x but the last; the GPU algorithms serve every one.
  algorithm: "auto" (default): "pipelined" or "fused" where the cost model predicts a gain over
             XLA, else the XLA path (a group of one, other platforms, ineligible calls);
             "pipelined": the vendor GEMM per chunk of rows while copy engines move the chunks
             between GPUs (an error where it cannot run);
             "fused": one persistent kernel of data movers and GEMM tiles (an error where it
             cannot run);
             "xla": the XLA decomposition (all_gather + dot; on global arrays the dot,
             partitioned by XLA) as plain JAX ops: no overlap, and every JAX transformation
             (forward mode, higher derivatives, jax.export).
  Differentiable in reverse mode (any algorithm) and vmappable. Results carry the checkpoint
  names "jax_overlap.ag_matmul" and "jax_overlap.ag_matmul.gathered" (jax_overlap.remat).
  """
  _check_algorithm("ag_matmul", algorithm)
  n = _check_ag_operands(x, w, bias)
  gather = _check_axis("ag_matmul", "gather_axis", gather_axis, x.ndim, -2)
  _check_out_sharding("ag_matmul", out_sharding, (*x.shape[:-1], *n), axis_name)
  if axis_name is None:
    call = _Call(None, 1, algorithm, gather)
  else:
    axes, size = _group("ag_matmul", axis_name)
    x, w, bias = _varying(axes, x, w, bias)
    call = _Call(axes, size, algorithm, gather)
  if 0 in x.shape or 0 in w.shape:
    y, gathered = _ag_empty(x, w, bias, call, n)
  elif algorithm == "xla":
    y, gathered = _ag_plain(x, w, bias, call)
  elif return_gathered:
    y, gathered = _reverse_mode("ag_matmul", algorithm, _ag_gathered, x, w, bias, call, False)
  else:
    y, gathered = _reverse_mode("ag_matmul", algorithm, _ag, x, w, bias, call, False), None
  y = remat.tag(_constrain(y, out_sharding), remat.AG_OUTPUT)
  return (y, remat.tag(gathered, remat.AG_GATHERED)) if return_gathered else y


def _ag_empty(x, w, bias, call: _Call, n: tuple):
  """Nothing to multiply (collectives of empty arrays do not lower): the bias, and x gathered."""
  gathered_shape = list(x.shape)
  gathered_shape[call.axis] *= call.size
  y = _empty_result((*gathered_shape[:-1], *n), x.dtype, bias, call.axes)
  if 0 in x.shape:
    return y, jnp.zeros(gathered_shape, x.dtype)
  if call.axes is None:
    return y, x
  return y, lax.all_gather(x, call.axes, axis=x.ndim + call.axis, tiled=True)


def matmul_rs(x, w, bias=None, *, axis_name=None, algorithm: str = "auto", scatter_axis: int | None = None,
              out_sharding=None):
  """Multiply by w and reduce-scatter the partial products: the row-parallel linear layer.

  Inside jax.shard_map (axis_name bound, group size T):
    x:    [..., M, *k] with the contraction sharded (k local; one or more dims, e.g. [heads, head_dim])
    w:    [*k, N] local shard of the weight
    bias: [N] or None, added once after the reduction
    returns psum_scatter(x @ w, scatter_axis, tiled) + bias, shape [..., M/T, N] for the
    default scatter_axis -2 (the rows); that dim must be divisible by T.
  With axis_name=None: global arrays under jit; computes x @ w + bias, partitioned
  from the input shardings (x's and w's contraction dims sharded alike -> a reduction
  over those axes, scattered onto scatter_axis, else onto the dim out_sharding shards
  over them, else the rows; see jax_overlap.partitioning).

  scatter_axis: any output dim. The GPU algorithms serve every one but the last; -1
  (the output columns) takes the XLA path (dot + psum_scatter), and the bias is then
  this rank's block of it.
  algorithm: "auto" (default): "pipelined" or "fused" where the cost model predicts a gain over
             XLA, else the XLA path (a group of one, other platforms, ineligible calls);
             "pipelined": the vendor GEMM per chunk of rows while copy engines move the chunks
             between GPUs (an error where it cannot run);
             "fused": one persistent kernel of data movers and GEMM tiles (an error where it
             cannot run);
             "xla": the XLA decomposition (dot + psum_scatter; on global arrays the dot,
             partitioned by XLA) as plain JAX ops: no overlap, and every JAX transformation
             (forward mode, higher derivatives, jax.export).
  The XLA path reduces as the GPU algorithms do: each rank's partial product rounded to x's
  dtype, the partials summed in float32 in rank order, the bias added once, one rounding.
  Differentiable in reverse mode (any algorithm) and vmappable. The result carries the
  checkpoint name "jax_overlap.matmul_rs" (jax_overlap.remat).
  """
  _check_algorithm("matmul_rs", algorithm)
  n = _check_rs_operands(x, w, bias)
  out_shape = [*x.shape[:x.ndim - (w.ndim - 1)], n]
  scatter = None if scatter_axis is None else _check_axis("matmul_rs", "scatter_axis", scatter_axis,
                                                          len(out_shape), -1)
  _check_out_sharding("matmul_rs", out_sharding, tuple(out_shape), axis_name)
  if axis_name is None:
    request = None if out_sharding is None else tuple(spec_of(out_sharding, len(out_shape)))
    call = _Call(None, 1, algorithm, scatter, request)
  else:
    axes, size = _group("matmul_rs", axis_name)
    scatter = -2 if scatter is None else scatter
    if out_shape[scatter] % size:
      what = "x's rows" if scatter == -2 else f"the output's dim {scatter}"
      raise ValueError(f"jax_overlap.matmul_rs: {what} ({out_shape[scatter]}) must be divisible by the size of "
                       f"axis {axis_name!r} ({size})")
    out_shape[scatter] //= size
    x, w, bias = _varying(axes, x, w, bias)
    call = _Call(axes, size, algorithm, scatter)
  if 0 in x.shape or 0 in w.shape:
    if call.axes is not None and scatter == -1 and bias is not None:
      bias = lax.dynamic_slice_in_dim(bias, lax.axis_index(call.axes) * out_shape[-1], out_shape[-1])
    z = _empty_result(out_shape, x.dtype, bias, call.axes)
  elif algorithm == "xla" or (call.axes is not None and scatter == -1):  # the columns: the XLA path, as JAX ops
    z = _rs_plain(x, w, bias, call)
  else:
    z = _reverse_mode("matmul_rs", algorithm, _rs, x, w, bias, call, False)
  return remat.tag(_constrain(z, out_sharding), remat.RS_OUTPUT)


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
