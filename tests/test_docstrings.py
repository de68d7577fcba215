"""The public docstrings: they name every algorithm the functions accept, each with what it does, and every
"Example" in them runs as written (on 8 CPU devices, after the imports a user of the package has)."""

import inspect
import pathlib
import re
import shlex
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest

import jax_overlap
from jax_overlap.api import ALGORITHMS

# What the examples take for granted: the package and the names they use from jax, numpy and flax.
PREAMBLE = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jax_overlap
from jax_overlap import *
"""
FLAX_PREAMBLE = "from flax import linen as nn, nnx\n"
# An "Example" header, with an optional parenthesis (one level of nesting), its colon, and code on the same line or
# indented below it.
HEADER = re.compile(r"^(\s*)Example(?: \((?:[^()]|\([^()]*\))*\))?:(?:\s+(\S.*))?$")


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


def examples(doc: str) -> list[str]:
  """The code of each Example in a docstring: what follows its header's colon on the line, or the block indented
  under it."""
  lines, found = (doc or "").expandtabs().splitlines(), []
  for i, line in enumerate(lines):
    m = HEADER.match(line)
    if not m:
      continue
    if m.group(2):
      found.append(m.group(2))
      continue
    block = []
    for below in lines[i + 1:]:
      if below.strip() and len(below) - len(below.lstrip()) <= len(m.group(1)):
        break
      block.append(below)
    found.append(textwrap.dedent("\n".join(block)).strip())
  return found


def documented():
  """(where, code) of every Example in the docstrings of jax_overlap's public names and of their public members."""
  objects = []
  for name in jax_overlap.__all__:
    value = getattr(jax_overlap, name)
    if isinstance(value, types.ModuleType):
      objects += [(f"{name}.{n}", v) for n, v in vars(value).items()
                  if not n.startswith("_") and inspect.isfunction(v) and v.__module__ == value.__name__]
    elif not isinstance(value, str):
      objects.append((name, value))
  return [(f"jax_overlap.{where}[{i}]", code) for where, value in objects
          for i, code in enumerate(examples(inspect.getdoc(value)))]


EXAMPLES = documented()


def test_examples_are_found():
  """Both forms of header are read: an indented block (the ops) and code on the header's line (build_info)."""
  found = dict(EXAMPLES)
  assert "mesh = jax.make_mesh" in found["jax_overlap.ag_matmul[0]"], found["jax_overlap.ag_matmul[0]"]
  assert found["jax_overlap.build_info[0]"].startswith("python -c "), found["jax_overlap.build_info[0]"]
  assert len(EXAMPLES) >= len(_functions_and_layers()), EXAMPLES


def _apply(layer, rng):
  """Runs an example's layer on a batch: an nnx layer on its in_features, a linen one initialized and applied."""
  import jax
  import jax.numpy as jnp
  from flax import linen as nn
  if isinstance(layer, nn.Module):
    x = jnp.asarray(rng.standard_normal((2, 16, 256)), jnp.bfloat16)
    out = layer.apply(layer.init(jax.random.key(0), x), x)
  else:
    x = jnp.asarray(rng.standard_normal((2, 16, layer.in_features)), layer.dtype or jnp.float32)
    out = layer(x)
  assert np.all(np.isfinite(np.asarray(out, np.float32))), out


@pytest.mark.parametrize("where, code", EXAMPLES, ids=[where for where, _ in EXAMPLES])
def test_docstring_example_runs_as_written(where, code, tmp_path, rng, monkeypatch):
  monkeypatch.chdir(tmp_path)  # what an example writes (tracing.export's file) lands there
  if code.startswith("python "):  # a shell command, run where a user would: outside the repository root
    run = subprocess.run([sys.executable, *shlex.split(code)[1:]], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.strip(), f"{where}: {code}\n{run.stdout}{run.stderr}"
    return
  uses_flax = re.search(r"\bnnx\.|\bnn\.|Fp8Delayed", code)
  if uses_flax:
    pytest.importorskip("flax", reason="this example needs flax (pip install '.[examples]')")
  namespace = {}
  exec(PREAMBLE + (FLAX_PREAMBLE if uses_flax else ""), namespace)
  exec(compile(code, where, "exec"), namespace)
  if "layer" in namespace:
    _apply(namespace["layer"], rng)


API_DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "api.md"


def api_sections() -> dict[str, str]:
  """docs/api.md's sections by the name in their ### heading."""
  parts = re.split(r"^### `([^`]+)`.*$", API_DOC.read_text(), flags=re.M)
  return dict(zip(parts[1::2], parts[2::2]))


@pytest.mark.parametrize("name", jax_overlap.__all__)
def test_api_reference_has_every_public_name_and_its_parameters(name):
  section = api_sections().get(name)
  assert section is not None, f"docs/api.md has no section (### `{name}`) for jax_overlap.{name}"
  try:
    params = inspect.signature(getattr(jax_overlap, name)).parameters
  except (TypeError, ValueError):  # a module, a value, an exception of Exception's signature
    return
  signature = section.split("```")[1]
  missing = [p for p in params if p not in ("parent", "name") and not re.search(rf"\b{p}\b", signature)]
  assert not missing, f"docs/api.md's signature of jax_overlap.{name} lacks {missing}"
