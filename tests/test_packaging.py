"""What `pip install ".[test]"` brings is what the CPU suite imports (the GPU and MaxText suites, tests/gpu and
tests/maxtext, have their own requirements)."""

import ast
import importlib.metadata
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Modules of this repository that the tests put on their path.
LOCAL = {p.stem for d in ("tests", "benchmarks", "examples") for p in ROOT.joinpath(d).glob("*.py")} | {"jax_overlap"}


def _module_level_imports(path: pathlib.Path) -> set:
  """The top-level names a module imports when it is imported (not those of functions: imported on use)."""
  names = set()
  for node in ast.parse(path.read_text()).body:
    if isinstance(node, ast.Import):
      names |= {a.name.split(".")[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      names.add(node.module.split(".")[0])
  return names


def _requirement_names(requirements) -> set:
  return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower().replace("_", "-") for r in requirements}


def test_the_test_extra_brings_what_the_suite_and_the_package_import():
  project = tomllib.loads(ROOT.joinpath("pyproject.toml").read_text())["project"]
  installed = _requirement_names(project["dependencies"]) | _requirement_names(
      project["optional-dependencies"]["test"])
  sources = [*ROOT.glob("tests/*.py"), *ROOT.glob("jax_overlap/**/*.py")]
  imported = set().union(*map(_module_level_imports, sources)) - LOCAL - set(sys.stdlib_module_names)
  distributions = importlib.metadata.packages_distributions()
  needed = {d.lower().replace("_", "-") for m in imported for d in distributions.get(m, [m])}
  assert needed <= installed, f"imported by the suite or the package but not in the test extra: {needed - installed}"
