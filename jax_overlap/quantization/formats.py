"""The dtypes the ops take and the paths that run each: one table, a new dtype an entry. Every dtype runs on the XLA
path; float8 comes in two families no GPU mixes, OCP and fnuz."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

GPU_ALGORITHMS = ("fused", "pipelined")
VECTOR_BYTES = 16  # the kernels' loads: rows and columns move in 16-byte vectors
OUT_DTYPES = ("bfloat16", "float16", "float32")
FP8_DEFAULT_OUT = "bfloat16"
# Per family: the first sm_XY that runs it, and the gfx archs that do.
_FP8_DEVICES = {"ocp": (89, ("gfx950",)), "fnuz": (None, ("gfx942",))}


@dataclasses.dataclass(frozen=True)
class DType:
  name: str
  itemsize: int
  algorithms: tuple  # () for the XLA path only
  fp8: str | None = None


TABLE = {d.name: d for d in (
    DType("bfloat16", 2, GPU_ALGORITHMS),
    DType("float16", 2, GPU_ALGORITHMS),
    DType("float8_e4m3fn", 1, ("pipelined",), "ocp"),
    DType("float8_e5m2", 1, ("pipelined",), "ocp"),
    DType("float8_e4m3fnuz", 1, ("pipelined",), "fnuz"),
    DType("float8_e5m2fnuz", 1, ("pipelined",), "fnuz"),
    DType("float32", 4, ()),
    DType("float64", 8, ()),
)}


def accumulator(dtype):
  return jnp.promote_types(dtype, jnp.float32)


def partial(dtype):
  """A reduction's partials' dtype (csrc/core/dtype.h partial_dtype): float32 for float16, which a partial overflows."""
  return jnp.dtype(jnp.float32) if jnp.dtype(dtype) == jnp.float16 else jnp.dtype(dtype)


def name(dtype) -> str:
  return np.dtype(dtype).name


def accepted(dtype) -> bool:
  return name(dtype) in TABLE


def itemsize(dtype_name: str) -> int:
  return TABLE[dtype_name].itemsize


def vector_elems(dtype_name: str) -> int:
  return VECTOR_BYTES // itemsize(dtype_name)


def takes(algorithm: str, dtype_name: str) -> bool:
  return algorithm in algorithms_for(dtype_name)


def algorithms_for(dtype_name: str) -> tuple:
  entry = TABLE.get(dtype_name)
  return () if entry is None else entry.algorithms


def dtypes_for(algorithm: str) -> tuple:
  return tuple(d.name for d in TABLE.values() if algorithm in d.algorithms)


def gpu_capable(dtype_name: str) -> bool:
  return bool(algorithms_for(dtype_name))


def described() -> str:
  gpu = [d.name for d in TABLE.values() if d.algorithms]
  xla_only = [d.name for d in TABLE.values() if not d.algorithms]
  return f"{', '.join(gpu + xla_only[:-1])} or {xla_only[-1]} (the XLA path only)"


def fp8_family(dtype) -> str | None:
  entry = TABLE.get(name(dtype))
  return None if entry is None else entry.fp8


def is_fp8(dtype) -> bool:
  return fp8_family(dtype) is not None


def is_e5m2(dtype) -> bool:
  return name(dtype).startswith("float8_e5m2")


def fp8_formats(family: str) -> tuple:
  """(e4m3: activations and weights, e5m2: gradients)."""
  return {"ocp": ("float8_e4m3fn", "float8_e5m2"), "fnuz": ("float8_e4m3fnuz", "float8_e5m2fnuz")}[family]


def fp8_family_of(arch: str) -> str | None:
  for family, (first_sm, gfx) in _FP8_DEVICES.items():
    if arch in gfx:
      return family
    if first_sm is not None and arch.startswith("sm_") and arch[3:].isdigit() and int(arch[3:]) >= first_sm:
      return family
  return None


def fp8_devices(family: str) -> str:
  first_sm, gfx = _FP8_DEVICES[family]
  return " or ".join(([f"sm_{first_sm}+"] if first_sm else []) + list(gfx))
