"""The public functions' docstrings name every algorithm the functions accept (issue 25: they left out
"pipelined"), each with what it does."""

import re

import pytest

import jax_overlap
from jax_overlap.api import ALGORITHMS


@pytest.mark.parametrize("op", ["ag_matmul", "matmul_rs"])
def test_op_docstring_says_what_each_algorithm_does(op):
  doc = getattr(jax_overlap, op).__doc__
  for algorithm in ALGORITHMS:
    assert re.search(rf'"{algorithm}"(?: \(default\))?: \S', doc), f"{op}'s docstring: {algorithm!r} and what it does"


@pytest.mark.parametrize("cls", ["AgDotGeneral", "RsDotGeneral"])
def test_layer_docstring_names_every_algorithm(cls):
  doc = getattr(jax_overlap, cls).__doc__
  assert all(f'"{algorithm}"' in doc for algorithm in ALGORITHMS), doc


def _functions_and_layers():
  """The public functions and layer classes (not modules, values or exception types)."""
  values = {n: getattr(jax_overlap, n) for n in jax_overlap.__all__}
  return [n for n, v in values.items()
          if callable(v) and not (isinstance(v, type) and issubclass(v, BaseException))]


@pytest.mark.parametrize("name", _functions_and_layers())
def test_every_public_function_and_layer_has_an_example(name):
  assert "Example" in (getattr(jax_overlap, name).__doc__ or ""), f"jax_overlap.{name}'s docstring has no example"
