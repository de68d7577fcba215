"""The MaxText integration's settings: each one's default and check (their names are runtime/settings.py's, with
every other name of jax_overlap's, so that the warning about misspelled ones knows them all).

Checked when jax_overlap.maxtext is imported, and read by enable(); its key=value arguments name them too.
"""

from __future__ import annotations

from jax_overlap import api
from jax_overlap.layers import fp8 as fp8_layers
from jax_overlap.runtime import settings
from jax_overlap.runtime.settings import MAXTEXT_ALGORITHM as ALGORITHM, MAXTEXT_FP8 as FP8
from jax_overlap.runtime.settings import MAXTEXT_FP8_CAST as FP8_CAST

ALGORITHM_CHOICES = api.ALGORITHMS
# jax_overlap's own fp8 layers for a 16-bit MaxText run ("": none; else the scaling of Fp8AgDotGeneral /
# Fp8RsDotGeneral).
FP8_CHOICES = ("", "tensor", "block")
# The float8 layers' cast_algorithm, where "auto" is the integration's own choice (hook.py AUTO_FP8_CAST).
FP8_CAST_CHOICES = fp8_layers.CAST_ALGORITHMS


def algorithm() -> str:
  return settings.choice(ALGORITHM, "auto", ALGORITHM_CHOICES)


def fp8() -> str:
  return settings.choice(FP8, "", FP8_CHOICES[1:])


def fp8_cast() -> str:
  return settings.choice(FP8_CAST, "auto", FP8_CAST_CHOICES)


def check_all() -> None:
  """Checks the MaxText settings the environment has: a ValueError names the first bad one."""
  algorithm()
  fp8()
  fp8_cast()
