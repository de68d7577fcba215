"""The package's layers (docs/architecture.md): a module imports only from its own layer or the layers below.

  runtime < quantization < planning < integration < ops < api < layers < maxtext
with _version, _compat (JAX's spellings) and _sharding (specs and Explicit meshes) below everything, remat (the
checkpoint names) with the integration and tracing (the trace export) beside the api. Read from the sources' import statements, so it needs no build.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jax_overlap"
LAYERS = ["_version", "_compat", "_sharding", "runtime", "quantization", "planning", "integration", "ops", "api",
          "layers", "maxtext"]
# Top-level modules that belong to a layer named otherwise.
PLACED = {"remat": "integration", "tracing": "api"}


def _layer(module: str) -> int:
  """The layer of jax_overlap.<module> (a dotted path below the package)."""
  head = module.split(".")[0]
  return LAYERS.index(PLACED.get(head, head))


def _imports(path: pathlib.Path) -> set:
  """The jax_overlap modules a file imports (dotted, below the package)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jax_overlap"):
      base = node.module[len("jax_overlap"):].lstrip(".")
      found |= {f"{base}.{a.name}".lstrip(".") if not base else base for a in node.names}
    elif isinstance(node, ast.Import):
      found |= {a.name[len("jax_overlap."):] for a in node.names if a.name.startswith("jax_overlap.")}
  return {m for m in found if m and m.split(".")[0] != "_native"}


FILES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_from_a_layer_above_its_own(path):
  module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
  own = _layer(module)
  above = sorted(m for m in _imports(path) if _layer(m) > own)
  assert not above, f"jax_overlap.{module} (layer {LAYERS[own]}) imports {above} from layers above it"


def test_every_module_has_a_layer():
  for path in FILES:
    _layer(".".join(path.relative_to(PACKAGE).with_suffix("").parts))


@pytest.mark.parametrize("package", ["planning", "integration", "quantization", "runtime"])
def test_a_package_init_is_a_face(package):
  """Issue 53.4: a package's __init__.py holds its docstring, imports and __all__; its logic is in named modules."""
  tree = ast.parse((PACKAGE / package / "__init__.py").read_text())
  logic = [f"{type(node).__name__} at line {node.lineno}" for node in tree.body
           if not isinstance(node, (ast.Import, ast.ImportFrom))
           and not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
           and not (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"])]
  assert not logic, f"jax_overlap/{package}/__init__.py holds logic: {logic}"


def test_no_op_decides_its_own_gpu_lowering():
  """Issue 53.4: what takes a call on the GPU (the native module, the devices, the workspace) is integration/'s to
  ask; an op module imports nothing of the runtime."""
  for path in sorted((PACKAGE / "ops").glob("*.py")):
    runtime = sorted(m for m in _imports(path) if m.split(".")[0] == "runtime")
    assert not runtime, f"jax_overlap/ops/{path.name} imports {runtime}"
