"""Which op a MaxText dense layer takes, from the shardings its kernel and its activation resolve to.

MaxText names its tensors' dims logically (a kernel ("embed", "mlp"), the
decoder layer's activation ("activation_batch", "activation_norm_length",
"activation_embed")) and maps them to mesh axes with logical_axis_rules. The
choice reads what those names resolve to on the mesh at hand (flax's
logical_to_mesh_axes, MaxText's own resolution, with mesh axes of size 1
dropped), not the names: the activation's rows (its second dim) sharded on
mesh axes R, then

  ag_matmul  the kernel's one sharded output dim on exactly R, its contraction on none of R: the
             column-parallel layer (QKV, the MLP's up projections under tensor-sequence parallelism)
  matmul_rs  the kernel's contraction dims on exactly R together, no output dim on any of R: the
             row-parallel layer (the attention output, the MLP's down projection)
  dot        anything else (rows not sharded, as under tensor parallelism without sequence
             parallelism; a kernel sharded otherwise): the layer's own dot, as MaxText computes it

The dense layers' hook does not see the activation's names, so the choice takes
the decoder layer's (ACTIVATION_AXES, the same for MaxText's decoder blocks): the
tensor a column-parallel layer reads and a row-parallel layer writes.
"""

from __future__ import annotations

import dataclasses
import math

# The decoder layer's residual-stream activation in training (MaxText's decoder blocks, e.g. llama2.py).
ACTIVATION_AXES = ("activation_batch", "activation_norm_length", "activation_embed")

AG, RS, DOT = "ag_matmul", "matmul_rs", "dot"
OPS = (AG, RS, DOT)


@dataclasses.dataclass(frozen=True)
class Choice:
  op: str  # one of OPS
  why: str  # in words, for the log
  model_parallel: bool = False  # the kernel is sharded on axes the activation's batch is not (tensor parallelism)
  group: tuple = ()  # the mesh axes the op gathers or reduces over (the rows'), () for a dot
  group_size: int = 1
  one_device: bool = False  # the mesh has one device: nothing to gather or reduce


def resolve(logical: tuple, rules, mesh_shape: dict) -> list:
  """The mesh axes each dim of a tensor with these logical names is sharded on (MaxText's rules through flax's
  logical_to_mesh_axes), mesh axes of size 1 dropped: a tuple per dim, () for an unsharded one."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel  (the integration's own import, as MaxText's)
  spec = nn.logical_to_mesh_axes(tuple(logical), tuple(rules))
  dims = []
  for entry in spec:
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    dims.append(tuple(a for a in axes if mesh_shape.get(a, 1) > 1))
  return dims


def choose(kernel_axes, contract: int, rules, mesh_shape: dict, activation_axes=ACTIVATION_AXES) -> Choice:
  """The op for a dense layer whose kernel has logical names `kernel_axes`, its first `contract` dims contracted
  (DenseGeneral's layout: contraction first, outputs last), on a mesh of these axis sizes."""
  if not kernel_axes or not any(size > 1 for size in mesh_shape.values()):
    return Choice(DOT, "one device" if kernel_axes else "the kernel has no logical axes",
                  one_device=not any(size > 1 for size in mesh_shape.values()))
  batch, rows = resolve(activation_axes, rules, mesh_shape)[:2]
  kernel = resolve(kernel_axes, rules, mesh_shape)
  contracted = [a for dim in kernel[:contract] for a in dim]
  outputs = [dim for dim in kernel[contract:] if dim]
  model_parallel = any(a not in batch for dim in kernel for a in dim)
  size = math.prod(mesh_shape[a] for a in rows)
  described = f"kernel {tuple(kernel_axes)} on {kernel}, activation rows on {rows or 'no axis'}"
  if not rows:
    return Choice(DOT, f"{described}: the rows are not sharded", model_parallel=model_parallel)
  if len(outputs) == 1 and outputs[0] == rows and not set(contracted) & set(rows):
    return Choice(AG, described, model_parallel, rows, size)
  if sorted(contracted) == sorted(rows) and not any(set(dim) & set(rows) for dim in outputs):
    return Choice(RS, described, model_parallel, rows, size)
  return Choice(DOT, f"{described}: neither the column- nor the row-parallel layout", model_parallel=model_parallel)
