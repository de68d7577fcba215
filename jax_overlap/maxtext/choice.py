"""Which op a MaxText dense layer takes, from the mesh axes its kernel's and activation's logical names resolve to.
With the activation's rows (its second dim) on mesh axes R (axes of size 1 dropped):
  ag_matmul  the kernel's one sharded output dim on exactly R, its contraction on none of R (column-parallel)
  matmul_rs  the kernel's contraction dims on exactly R together, no output dim on any of R (row-parallel)
  dot        anything else, e.g. rows not sharded (tensor parallelism without sequence parallelism)
The hook does not see the activation's names: ACTIVATION_AXES are the decoder layer's.
"""

from __future__ import annotations

import dataclasses
import math

ACTIVATION_AXES = ("activation_batch", "activation_norm_length", "activation_embed")

AG, RS, DOT = "ag_matmul", "matmul_rs", "dot"
OPS = (AG, RS, DOT)


@dataclasses.dataclass(frozen=True)
class Choice:
  op: str
  why: str
  model_parallel: bool = False  # the kernel is sharded on axes the activation's batch is not
  group: tuple = ()
  group_size: int = 1
  one_device: bool = False


def resolve(logical: tuple, rules, mesh_shape: dict) -> list:
  """Per dim, the mesh axes (of size > 1) these logical names resolve to through `rules`."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  spec = nn.logical_to_mesh_axes(tuple(logical), tuple(rules))
  dims = []
  for entry in spec:
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    dims.append(tuple(a for a in axes if mesh_shape.get(a, 1) > 1))
  return dims


def choose(kernel_axes, contract: int, rules, mesh_shape: dict, activation_axes=ACTIVATION_AXES) -> Choice:
  """The op for a kernel named `kernel_axes`, its first `contract` dims contracted (DenseGeneral's layout)."""
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
