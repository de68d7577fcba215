"""The float8 scaling modes as one type the primitives carry. In every mode an operand's value is x8.astype(float32)
times its block's scale; what differs is a Scaling method. The block layouts mirror csrc/core/block_scales.h."""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

# cuBLASLt's block-scaled GEMM takes rows in multiples of BLOCK_ROW_MULTIPLE and reads w's scales in rows padded to
# W_SCALE_ROW_ALIGN (docs/performance.md, "Where the code's constants come from").
BLOCK_SIZE = 128
BLOCK_ROW_MULTIPLE = 4
W_SCALE_ROW_ALIGN = 4


class Scaling:
  """A mode or its variant (x_shared: one x_scale on every rank, so gathered shards share a GEMM); hashable."""

  name: str = ""
  code: int = 0  # csrc/core/scale_mode.h ScaleMode
  xla_gemm: bool = True  # XLA rewrites the dot of operands dequantized this way into its fp8 GEMM
  bias_epilogue: bool = True
  follows_x: bool = False  # x_scale has x's leading dims: batch dims fold and vmap batches it with x
  blocks: bool = False  # csrc/core/gemm_problem.h GemmTypes::blocks
  fast_accumulation: bool = False
  x_shared: bool = False

  def __repr__(self) -> str:
    return (self.name + ("+fast_accumulation" if self.fast_accumulation else "")
            + ("+x_shared" if self.x_shared else ""))

  def __eq__(self, other) -> bool:
    return (type(other) is type(self) and other.fast_accumulation == self.fast_accumulation
            and other.x_shared == self.x_shared)

  def __hash__(self) -> int:
    return hash((self.name, self.fast_accumulation, self.x_shared))

  def accumulating(self, fast: bool) -> Scaling:
    if bool(fast) == self.fast_accumulation:
      return self
    if fast and self.blocks:
      raise ValueError("fast accumulation takes tensor scales: block scales apply per 128 elements of K, where the "
                       "GEMM promotes its sums to float32 anyway")
    variant = copy.copy(self)
    variant.fast_accumulation = bool(fast)
    return variant

  def sharing_x(self, shared: bool) -> Scaling:
    if bool(shared) == self.x_shared:
      return self
    if shared and self.follows_x:
      raise ValueError(f"{self.name} scales follow x's rows: no rank's x_scale stands for another's")
    variant = copy.copy(self)
    variant.x_shared = bool(shared)
    return variant

  @property
  def precision(self):
    """XLA's fp8 GEMM accumulates fast at DEFAULT, not at HIGHEST."""
    return lax.Precision.DEFAULT if self.fast_accumulation else lax.Precision.HIGHEST

  def check(self, op: str, x, w, x_scale, w_scale, w_kmajor: bool) -> Scales:
    raise NotImplementedError

  def gathered_shape(self, x_scale_shape: tuple, gathered_x_shape: tuple, size: int) -> tuple:
    raise NotImplementedError

  def gather(self, x_scale, axis_name, gather: int):
    raise NotImplementedError

  def of_whole_x(self, x_scale):
    raise NotImplementedError

  def shardy_factors(self, x_factors: list, w_kmajor: bool) -> tuple:
    """(x_scale's, w_scale's, the contraction blocks') factors in a Shardy rule; x's contraction last, w 2-D."""
    raise NotImplementedError

  def partition_specs(self, x_spec: P, w_spec: P) -> tuple:
    raise NotImplementedError

  def plan_shapes(self, scales_shapes: tuple, x_shape: tuple, w_shape: tuple) -> tuple:
    return x_shape, w_shape

  def gpu_refused(self, archs: tuple, gemm_rows: int, batch: int, world: int) -> str | None:
    return None

  def gemm_forms(self, x_groups: int, w_kmajor: bool) -> tuple:
    """(x_scale, w_scale) -> the flat forms the vendor GEMMs read; x's rows in `x_groups` groups, one GEMM each."""
    raise NotImplementedError

  def gathered_from_gemm(self, flat, world: int, shape: tuple):
    return flat


class TensorScaling(Scaling):
  name = "tensor"
  code = 1

  def check(self, op, x, w, x_scale, w_scale, w_kmajor):
    del w_kmajor
    return Scales(_scalar(op, "x_scale", x_scale, "x", x.dtype), _scalar(op, "w_scale", w_scale, "w", w.dtype), self)

  def gathered_shape(self, x_scale_shape, gathered_x_shape, size):
    del x_scale_shape, gathered_x_shape
    return (size,)

  def gather(self, x_scale, axis_name, gather):
    del gather
    return lax.all_gather(x_scale.reshape(1), axis_name, tiled=True)

  def of_whole_x(self, x_scale):
    return x_scale.reshape(1)

  def shardy_factors(self, x_factors, w_kmajor):
    del x_factors, w_kmajor
    return "", "", ()

  def partition_specs(self, x_spec, w_spec):
    del x_spec, w_spec
    return P(), P()

  def gemm_forms(self, x_groups, w_kmajor):
    del x_groups, w_kmajor
    return (lambda s: s.reshape(1),) * 2


class BlockScaling(Scaling):
  """DeepSeek-V3's: a float32 per 1 x BLOCK_SIZE block of x and per BLOCK_SIZE x BLOCK_SIZE tile of a 2-D w."""

  name = "block"
  code = 2
  xla_gemm = False
  bias_epilogue = False  # cuBLASLt has no algorithm for one
  follows_x = True
  blocks = True

  def shapes(self, x_shape: tuple, w_shape: tuple, w_kmajor: bool) -> tuple:
    b, k = BLOCK_SIZE, x_shape[-1]
    n = w_shape[0] if w_kmajor else w_shape[1]
    return (*x_shape[:-1], k // b), ((n // b, k // b) if w_kmajor else (k // b, n // b))

  def check_dims(self, where: str, k: int, n: int) -> None:
    if k % BLOCK_SIZE or n % BLOCK_SIZE:
      raise ValueError(f"jax_overlap.{where}: block scales need K and N multiples of {BLOCK_SIZE} (blocks of "
                       f"{BLOCK_SIZE} along the contraction K, tiles of {BLOCK_SIZE}x{BLOCK_SIZE} of w), got "
                       f"K = {k}, N = {n}")

  def check(self, op, x, w, x_scale, w_scale, w_kmajor):
    b = BLOCK_SIZE
    if w.ndim != 2:
      raise ValueError(f"jax_overlap.{op}: block scales take a 2-D w ([K, N], or [N, K] with w_kmajor), got w "
                       f"of shape {w.shape}")
    want_x, want_w = self.shapes(x.shape, w.shape, w_kmajor)
    shapes = [getattr(s, "shape", None) for s in (x_scale, w_scale)]
    if any(shape is None or len(shape) == 0 for shape in shapes):
      raise ValueError(f"jax_overlap.{op}: x_scale and w_scale must both be float32 scalars (shape (), or any "
                       f"shape of size 1), or both block scales (x_scale {want_x}, w_scale {want_w}); got x_scale of "
                       f"shape {shapes[0]}, w_scale of shape {shapes[1]}")
    for name, scale in (("x_scale", x_scale), ("w_scale", w_scale)):
      if scale.dtype != jnp.float32:
        raise TypeError(f"jax_overlap.{op}: with block scales {name} must be a float32 array, got dtype "
                        f"{scale.dtype}")
    self.check_dims(op, x.shape[-1], w.shape[0] if w_kmajor else w.shape[1])
    for name, scale, want, what in (("x_scale", x_scale, want_x, f"one per row of x and {b} of K"),
                                    ("w_scale", w_scale, want_w, f"one per {b}x{b} tile of w")):
      if tuple(scale.shape) != want:
        raise ValueError(f"jax_overlap.{op}: block scales: {name} must have shape {want} ({what}), got "
                         f"{tuple(scale.shape)}")
    return Scales(x_scale, w_scale, self)

  def gathered_shape(self, x_scale_shape, gathered_x_shape, size):
    del size
    return (*gathered_x_shape[:-1], x_scale_shape[-1])

  def gather(self, x_scale, axis_name, gather):
    return lax.all_gather(x_scale, axis_name, axis=x_scale.ndim + gather, tiled=True)

  def of_whole_x(self, x_scale):
    return x_scale

  def shardy_factors(self, x_factors, w_kmajor):
    return " ".join([*x_factors[:-1], "kb"]), "nb kb" if w_kmajor else "kb nb", ("kb",)

  def partition_specs(self, x_spec, w_spec):
    return x_spec, w_spec

  def plan_shapes(self, scales_shapes, x_shape, w_shape):
    # A plan even for the scales' shapes (a 128th of the operands') is even for the operands'.
    del x_shape, w_shape
    return scales_shapes

  def gpu_refused(self, archs, gemm_rows, batch, world):
    for arch in archs:
      if not arch.startswith("sm_90"):
        return (f"block scales on {arch}: the vendor GEMM path runs them on cuBLASLt on Hopper (sm_90) only "
                f"(hipBLASLt's and Blackwell's block-scaled GEMMs are not built)")
    if world > 1 and batch > 1:
      return f"block scales with leading batch dims of x ({batch} elements) in a group of {world}"
    if gemm_rows % BLOCK_ROW_MULTIPLE:
      return f"block scales with {gemm_rows} rows per GEMM (cuBLASLt takes multiples of {BLOCK_ROW_MULTIPLE})"
    return None

  def gemm_forms(self, x_groups, w_kmajor):
    def x_form(x_scale):  # [..., rows, k/128] -> [groups][k/128][rows / groups]
      kb = x_scale.shape[-1]
      return x_scale.reshape(x_groups, -1, kb).transpose(0, 2, 1).reshape(-1)

    def w_form(w_scale):  # [n/128][k/128 padded] of w's K-major form
      s = w_scale if w_kmajor else w_scale.T
      return jnp.pad(s, ((0, 0), (0, -s.shape[1] % W_SCALE_ROW_ALIGN))).reshape(-1)
    return x_form, w_form

  def gathered_from_gemm(self, flat, world, shape):
    kb = shape[-1]
    return flat.reshape(world, kb, -1).transpose(0, 2, 1).reshape(shape)


TENSOR = TensorScaling()
BLOCK = BlockScaling()
MODES = {s.name: s for s in (TENSOR, BLOCK)}


@functools.partial(jax.tree_util.register_dataclass, data_fields=["x", "w"], meta_fields=["scaling"])
@dataclasses.dataclass(frozen=True)
class Scales:
  x: Any
  w: Any
  scaling: Scaling

  def arrays(self) -> tuple:
    return self.x, self.w


def of(op: str, x, w, x_scale, w_scale, w_kmajor: bool) -> Scales:
  """A caller's scales, checked: size-1 scales are tensor scales ((1,) is Flax's) unless of exactly the block shapes."""
  sizes = [getattr(s, "size", 1) for s in (x_scale, w_scale)]
  blocks = any(size != 1 for size in sizes)
  if not blocks and w.ndim == 2 and all(hasattr(s, "shape") for s in (x_scale, w_scale)):
    blocks = (tuple(x_scale.shape), tuple(w_scale.shape)) == BLOCK.shapes(x.shape, w.shape, w_kmajor)
  return (BLOCK if blocks else TENSOR).check(op, x, w, x_scale, w_scale, w_kmajor)


def mode(scales: Scales | None) -> Scaling | None:
  return None if scales is None else scales.scaling


NO_SCALES_CODE = 0


def code(scaling: Scaling | None) -> int:
  return NO_SCALES_CODE if scaling is None else scaling.code


def _scalar(op: str, name: str, scale, operand: str, dtype):
  if scale is None:
    raise TypeError(f"jax_overlap.{op}: {name} is required with float8 operands ({operand} is {dtype}): a "
                    f"float32 scalar, {operand}'s value being {operand}.astype(float32) * {name}; got None")
  if isinstance(scale, float):
    return jnp.float32(scale)
  if not hasattr(scale, "shape") or not hasattr(scale, "dtype"):
    raise TypeError(f"jax_overlap.{op}: {name} must be a float32 scalar, got {type(scale).__name__}")
  if scale.dtype != jnp.float32:
    raise TypeError(f"jax_overlap.{op}: {name} must be a float32 scalar, got dtype {scale.dtype}")
  return scale.reshape(()) if scale.ndim else scale
