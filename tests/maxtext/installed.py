"""The installed MaxText these tests run against, and the mark that skips them without it."""

from __future__ import annotations

import importlib.metadata
import pathlib

import pytest


def maxtext_root() -> pathlib.Path | None:
  """The installed MaxText package's folder (the distribution's: tests/maxtext is on sys.path too), or None."""
  try:
    return pathlib.Path(importlib.metadata.distribution("maxtext").locate_file("maxtext"))
  except importlib.metadata.PackageNotFoundError:
    return None


requires_maxtext = pytest.mark.skipif(
    maxtext_root() is None,
    reason="MaxText is not installed: these tests run in an environment of their own (Python >= 3.12, "
           "pip install --no-deps -r tests/maxtext/requirements.txt; CI's step (h))")
