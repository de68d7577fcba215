"""The number formats (dtypes) the ops take, and which paths run each: one table, so a new dtype is an entry here.

Every accepted dtype runs on the XLA path. The GPU algorithms ("pipelined",
"fused") take the dtypes whose entry names them; their element size sets the
bytes a chunk, a row or a region holds (planning/, integration/lowering.py) and the
16-byte vectors rows and columns move in. float64 is accepted for checks in
float64, as JAX's own tests run them.

The float8 formats come in two families that no GPU mixes: OCP (e4m3fn, e5m2:
NVIDIA sm_89 and later, AMD gfx950) and fnuz (e4m3fnuz, e5m2fnuz: AMD gfx942,
MI300X/MI325X). A float8 call takes a float32 scale per operand and returns
one of OUT_DTYPES; the fused kernels are 16-bit only, so float8 entries name
the pipelined algorithm alone (the vendor fp8 GEMM per stage).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

GPU_ALGORITHMS = ("fused", "pipelined")
# Rows and columns move in 16-byte vectors (the copy engines' and the kernels' loads).
VECTOR_BYTES = 16
# What a float8 call may return (bfloat16 by default): the vendor fp8 GEMMs' output types.
OUT_DTYPES = ("bfloat16", "float16", "float32")
FP8_DEFAULT_OUT = "bfloat16"
# The devices each float8 family runs on, as arch names (backend.LocalDevice.arch): sm_XY at or above the
# first, or one of the gfx names.
_FP8_DEVICES = {"ocp": (89, ("gfx950",)), "fnuz": (None, ("gfx942",))}


@dataclasses.dataclass(frozen=True)
class DType:
  name: str
  itemsize: int
  algorithms: tuple  # the GPU algorithms that take it; () for the XLA path only
  fp8: str | None = None  # a float8 format's family: "ocp" or "fnuz"


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
  """The type products and sums of `dtype` accumulate in: float32, or float64 for float64 operands."""
  return jnp.promote_types(dtype, jnp.float32)


def partial(dtype):
  """The type each rank's partial product of a reduction (matmul_rs) is staged and summed from, for a result of
  `dtype`: float32 for float16 (a partial past 65504 would be inf where the sum is in range), else `dtype`
  (bfloat16 has float32's range; its partials are rounded, as documented). csrc/core/dtype.h partial_dtype."""
  return jnp.dtype(jnp.float32) if jnp.dtype(dtype) == jnp.float16 else jnp.dtype(dtype)


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


# --- float8 -------------------------------------------------------------------------

def fp8_family(dtype) -> str | None:
  """"ocp" or "fnuz" for a float8 format, None for any other dtype."""
  entry = TABLE.get(name(dtype))
  return None if entry is None else entry.fp8


def is_fp8(dtype) -> bool:
  return fp8_family(dtype) is not None


def is_e5m2(dtype) -> bool:
  return name(dtype).startswith("float8_e5m2")


def fp8_formats(family: str) -> tuple:
  """(the e4m3 format, the e5m2 format) of a family: activations and weights, gradients."""
  return {"ocp": ("float8_e4m3fn", "float8_e5m2"), "fnuz": ("float8_e4m3fnuz", "float8_e5m2fnuz")}[family]


def fp8_family_of(arch: str) -> str | None:
  """The float8 family a device of `arch` ("sm_90", "gfx942") runs, or None where it runs none."""
  for family, (first_sm, gfx) in _FP8_DEVICES.items():
    if arch in gfx:
      return family
    if first_sm is not None and arch.startswith("sm_") and arch[3:].isdigit() and int(arch[3:]) >= first_sm:
      return family
  return None


def fp8_devices(family: str) -> str:
  """The devices of a float8 family, in words."""
  first_sm, gfx = _FP8_DEVICES[family]
  return " or ".join(([f"sm_{first_sm}+"] if first_sm else []) + list(gfx))
