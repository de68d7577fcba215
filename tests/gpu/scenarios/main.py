"""Scenario "main": the ops across processes (ops.py), then their failures (failures.py), in one job."""

from __future__ import annotations

from scenarios import failures, ops

ENV = {"JAX_OVERLAP_ON_TIMEOUT": "raise"}
WORLDS = None


def required(rank: int, world: int) -> tuple:
  return ops.CHECKS + failures.required(rank, world)


def returncode(rank: int, world: int) -> int:
  return 0


def run(ctx) -> None:
  ops.run(ctx)
  failures.run(ctx)
