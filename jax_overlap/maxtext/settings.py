"""The MaxText settings' defaults and checks; their names are runtime/settings.py's, with all the others."""

from __future__ import annotations

from jax_overlap import api
from jax_overlap.layers import fp8 as fp8_layers
from jax_overlap.runtime import settings
from jax_overlap.runtime.settings import MAXTEXT_ALGORITHM as ALGORITHM, MAXTEXT_FP8 as FP8
from jax_overlap.runtime.settings import MAXTEXT_FP8_CAST as FP8_CAST

ALGORITHM_CHOICES = api.ALGORITHMS
FP8_CHOICES = ("", "tensor", "block")
FP8_CAST_CHOICES = fp8_layers.CAST_ALGORITHMS


def algorithm() -> str:
  return settings.choice(ALGORITHM, "auto", ALGORITHM_CHOICES)


def fp8() -> str:
  return settings.choice(FP8, "", FP8_CHOICES[1:])


def fp8_cast() -> str:
  return settings.choice(FP8_CAST, "auto", FP8_CAST_CHOICES)


def check_all() -> None:
  algorithm()
  fp8()
  fp8_cast()
