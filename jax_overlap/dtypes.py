"""The dtypes the ops take, and which paths run each: one table, so a new dtype is an entry here.

Every accepted dtype runs on the XLA path. The GPU algorithms ("pipelined",
"fused") take the dtypes whose entry names them; their element size sets the
bytes a chunk, a row or a region holds (planning.py, lowering.py) and the
16-byte vectors rows and columns move in. float64 is accepted for checks in
float64, as JAX's own tests run them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

GPU_ALGORITHMS = ("fused", "pipelined")
# Rows and columns move in 16-byte vectors (the copy engines' and the kernels' loads).
VECTOR_BYTES = 16


@dataclasses.dataclass(frozen=True)
class DType:
  name: str
  itemsize: int
  algorithms: tuple  # the GPU algorithms that take it; () for the XLA path only


TABLE = {d.name: d for d in (
    DType("bfloat16", 2, GPU_ALGORITHMS),
    DType("float16", 2, GPU_ALGORITHMS),
    DType("float8_e4m3fn", 1, ("pipelined",)),
    DType("float8_e5m2", 1, ("pipelined",)),
    DType("float8_e4m3fnuz", 1, ("pipelined",)),
    DType("float8_e5m2fnuz", 1, ("pipelined",)),
    DType("float32", 4, ()),
    DType("float64", 8, ()),
)}


def name(dtype) -> str:
  return np.dtype(dtype).name


def accepted(dtype) -> bool:
  return name(dtype) in TABLE


def itemsize(dtype_name: str) -> int:
  return TABLE[dtype_name].itemsize


def vector_elems(dtype_name: str) -> int:
  """Elements in one 16-byte vector: what k and n must be multiples of on a GPU path."""
  return VECTOR_BYTES // itemsize(dtype_name)


def takes(algorithm: str, dtype_name: str) -> bool:
  """Whether the GPU algorithm `algorithm` takes operands of `dtype_name`."""
  return algorithm in algorithms_for(dtype_name)


def algorithms_for(dtype_name: str) -> tuple:
  """The GPU algorithms that take operands of `dtype_name` (none for a dtype not in the table)."""
  entry = TABLE.get(dtype_name)
  return () if entry is None else entry.algorithms


def dtypes_for(algorithm: str) -> tuple:
  return tuple(d.name for d in TABLE.values() if algorithm in d.algorithms)


def gpu_capable(dtype_name: str) -> bool:
  """Whether any GPU algorithm takes the dtype (else every call of it takes the XLA path)."""
  return bool(algorithms_for(dtype_name))


def described() -> str:
  """The accepted dtypes in words, those of the XLA path only last: for the ops' TypeError."""
  gpu = [d.name for d in TABLE.values() if d.algorithms]
  xla_only = [d.name for d in TABLE.values() if not d.algorithms]
  return f"{', '.join(gpu + xla_only[:-1])} or {xla_only[-1]} (the XLA path only)"
