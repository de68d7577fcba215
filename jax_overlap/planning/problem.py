"""What the planner is asked (Problem) and what it answers (Choice, or Declined)."""


from __future__ import annotations

import dataclasses


class Declined(Exception):
  """No algorithm takes the call; the message says why."""


@dataclasses.dataclass(frozen=True)
class Problem:
  """One call as the planner sees it. `m`: x's rows per batch element (ag_matmul: a shard's)."""

  op: str
  dtype_name: str  # x's
  batch: int
  m: int
  k: int
  n: int
  world: int
  groups: tuple  # every group's global device ids in rank order; () for a group of one
  w_kmajor: bool  # as the GPU gets w (float8: always, csrc/blas/cublaslt_api.h)
  out_dtype_name: str | None = None
  w_dtype_name: str | None = None
  scaling: object = None  # a float8 call's Scaling, else None
  gemm_bias: bool = False  # the vendor GEMMs add the call's bias (it has one, and XLA does not add it after)

  @property
  def scaled(self) -> bool:
    return self.scaling is not None

  @property
  def fast_accumulation(self) -> bool:
    return self.scaled and self.scaling.fast_accumulation

  @property
  def x_scale_shared(self) -> bool:
    """ag_matmul's gathered shards share one x scale, so its GEMMs take several at once."""
    return self.scaled and self.scaling.x_shared

  @property
  def rows(self) -> int:
    return self.batch * self.m

  @property
  def out_dtype(self) -> str:
    return self.out_dtype_name or self.dtype_name

  @property
  def w_dtype(self) -> str:
    return self.w_dtype_name or self.dtype_name


@dataclasses.dataclass(frozen=True)
class Choice:
  algorithm: str  # "pipelined", "fused" or "all_gather"
  plan: object  # fused.FusedPlan, pipelined.PipelinedPlan, or None (a group of one's vendor GEMM, all_gather)
  region: tuple | None = None  # (key, bytes) of its workspace region; None for a group of one
  offset: int = 0  # the region's offset, once placed

  def estimates(self) -> tuple:

    return self.plan.est_us, self.plan.est_xla_us

  def fingerprint(self) -> list:
    """What every rank of a group must share to run the call together (JSON)."""
    return [self.algorithm, None if self.plan is None else self.plan.fingerprint(), repr(self.region), self.offset]

