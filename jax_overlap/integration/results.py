"""A GEMM op's results by kind, so that nothing below ops/ knows which op it serves."""

from __future__ import annotations

import dataclasses
import enum


class Kind(enum.Enum):
  PRODUCT = "product"
  GATHERED = "gathered"
  # Float8 only: each shard's x scale, travelled with it; batched with x where the scales follow x's rows.
  GATHERED_SCALES = "gathered_scales"


@dataclasses.dataclass(frozen=True)
class Results:
  """An op's results in its primitive's order, and their checkpoint names (remat.py)."""

  kinds: tuple
  tags: tuple

  def __post_init__(self):
    kinds, tags = self.kinds, self.tags
    if not isinstance(kinds, tuple) or not kinds or not all(isinstance(k, Kind) for k in kinds):
      raise TypeError(f"jax_overlap Results: kinds must be a non-empty tuple of Kind, got {kinds!r}")
    if kinds[0] is not Kind.PRODUCT or len(set(kinds)) != len(kinds):
      raise TypeError(f"jax_overlap Results: kinds must start with Kind.PRODUCT and name each kind once, got "
                      f"{kinds!r}")
    if Kind.GATHERED_SCALES in kinds and kinds[-1] is not Kind.GATHERED_SCALES:
      raise TypeError(f"jax_overlap Results: Kind.GATHERED_SCALES (float8 calls only) must come last, got {kinds!r}")
    if not isinstance(tags, tuple) or len(tags) != len(kinds) or not all(isinstance(t, str) for t in tags):
      raise TypeError(f"jax_overlap Results: tags must be one checkpoint name (str) per kind ({len(kinds)}), got "
                      f"{tags!r}")

  @property
  def multiple(self) -> bool:
    return len(self.kinds) > 1

  @property
  def gathers(self) -> bool:
    return Kind.GATHERED in self.kinds

  def of_call(self, scaled: bool) -> tuple:
    return self.kinds if scaled else tuple(k for k in self.kinds if k is not Kind.GATHERED_SCALES)

  def batch_dims(self, scaling) -> tuple:
    """Each result's batch dim when x's leading dims take a batch (None: the result belongs to the shards)."""
    follows = scaling is not None and scaling.follows_x
    return tuple(None if k is Kind.GATHERED_SCALES and not follows else 0 for k in self.of_call(scaling is not None))

  def of_one(self, product, x, own_scales, scaled: bool) -> list:
    """A group of one's results, its custom call giving the product alone; own_scales(i) gives result i."""
    mine = {Kind.PRODUCT: lambda i: product, Kind.GATHERED: lambda i: x, Kind.GATHERED_SCALES: own_scales}
    return [mine[k](i) for i, k in enumerate(self.of_call(scaled))]
