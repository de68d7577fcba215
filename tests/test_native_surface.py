"""The native module holds what the package calls, and the CPU stand-in holds the same.

Three lists of one contract: the native module's functions the package's sources call, the names the compiled
module (jax_overlap._native) exports, and those of the stand-in the CPU tests run the package on
(fake_gpu.FakeNative), with the same parameters. What only the tests and benchmarks drive is the harness module's
(jax_overlap._native_testing), which the package never imports. CI builds the CUDA module and imports it without a
GPU, so the comparisons with the compiled modules run there.
"""

from __future__ import annotations

import ast
import inspect
import json
import pathlib
import subprocess
import sys

import pytest

import jax_overlap
import native_testing
from fake_gpu import FakeNative
from jax_overlap.runtime import native

PACKAGE = pathlib.Path(jax_overlap.__file__).resolve().parent
TESTS = pathlib.Path(__file__).resolve().parent

needs_native = pytest.mark.skipif(native.module() is None, reason="needs jax_overlap's native module (a pure-Python "
                                                                 "install has none)")


def _is_native_module(node: ast.expr) -> bool:
  """The native module as the package's sources name it: `nat` or `_native` (runtime/native.py's), `_native()`
  (the accessors of runtime/workspace.py and planning/figures.py), or `<...>.native` (a Backend's)."""
  if isinstance(node, ast.Name):
    return node.id in ("nat", "_native")
  if isinstance(node, ast.Call):
    return isinstance(node.func, ast.Name) and node.func.id == "_native"
  return isinstance(node, ast.Attribute) and node.attr == "native"


def package_calls() -> dict:
  """{name: "file:line" of its first use} of each native module attribute the package's sources use."""
  uses = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Attribute) and _is_native_module(node.value):
        uses.setdefault(node.attr, f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
  return uses


def _public(names) -> set:
  return {n for n in names if not n.startswith("_")}


def _parameters(doc: str) -> list:
  """(name, default as written or None) of each parameter of a pybind11 function, from its docstring's first line,
  `name(a: int, b: Optional[str] = None) -> T`."""
  head = doc.splitlines()[0]
  params, depth, current = [], 0, ""
  for ch in head[head.index("(") + 1:head.rindex(") ->")]:
    depth += (ch in "[(") - (ch in "])")
    if ch == "," and depth == 0:
      params.append(current)
      current = ""
    else:
      current += ch
  params += [current] if current.strip() else []
  out = []
  for p in params:
    name, _, rest = p.partition(":")
    out.append((name.strip(), rest.split(" = ", 1)[1].strip() if " = " in rest else None))
  return out


def _fake_parameters(name: str) -> list:
  params = list(inspect.signature(getattr(FakeNative, name)).parameters.values())[1:]  # after self
  return [(p.name, None if p.default is p.empty else repr(p.default)) for p in params]


def test_the_scan_finds_the_native_calls_of_each_layer():
  """The scan is not empty-handed: set-up (runtime/workspace.py), registration (runtime/backend.py), planning
  (planning/), lowering (integration/) and the build (runtime/native.py) each show up."""
  calls = package_calls()
  assert {"init_device", "registrations", "time_gemms", "pipelined_scratch_bytes", "build_info"} <= set(calls), calls
  assert all(not name.startswith("_") for name in calls), calls


def test_the_stand_in_defines_what_the_package_calls():
  calls, fake = package_calls(), _public(vars(FakeNative))
  assert not set(calls) - fake, {n: calls[n] for n in set(calls) - fake}  # called, not in FakeNative
  assert not fake - set(calls), fake - set(calls)  # in FakeNative, called nowhere in the package


@needs_native
def test_the_native_module_exports_what_the_package_calls():
  calls, exported = package_calls(), _public(dir(native.module()))
  assert not set(calls) - exported, {n: calls[n] for n in set(calls) - exported}
  assert not exported - set(calls), f"exported, called nowhere in the package (the harness's?): {exported - set(calls)}"


@needs_native
def test_the_stand_in_takes_the_native_modules_parameters_and_constants():
  nat = native.module()
  for name in sorted(_public(dir(nat))):
    real = getattr(nat, name)
    if callable(real):
      assert _fake_parameters(name) == _parameters(real.__doc__), (name, real.__doc__.splitlines()[0])
    else:
      assert getattr(FakeNative, name) == real, name


@needs_native
def test_the_harness_is_built_beside_the_native_module_and_shares_no_name():
  nat, harness = native.module(), native_testing.module()
  assert pathlib.Path(harness.__file__).parent == pathlib.Path(nat.__file__).parent
  assert {"SimGroup", "set_faults", "time_loopback"} <= _public(dir(harness))
  assert not _public(dir(nat)) & _public(dir(harness)), _public(dir(nat)) & _public(dir(harness))


# Imports every module of the package and runs its paths on CPU devices: an op on the XLA path, and the lowering
# for "cuda" with its set-up, planning and measured figures on the stand-in; prints the harness imports tried.
_RUN_THE_PACKAGE = """
import importlib, json, pkgutil, sys
tried = []
class Refuse:
  def find_spec(self, name, path=None, target=None):
    if name == "jax_overlap._native_testing":
      tried.append(name)
      raise ImportError("the package imported the harness module")
sys.meta_path.insert(0, Refuse())
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import jax_overlap
for info in pkgutil.walk_packages(jax_overlap.__path__, "jax_overlap."):
  # Not the harness itself (it is installed beside the package), nor MaxText's hook (it imports MaxText).
  if info.name != "jax_overlap._native_testing" and not info.name.startswith("jax_overlap.maxtext"):
    importlib.import_module(info.name)
import fake_gpu
jax_overlap.build_info()
mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
x, w = jnp.ones((64, 128), jnp.float32), jnp.ones((128, 32), jnp.float32)
f = jax.jit(jax.shard_map(lambda x, w: jax_overlap.ag_matmul(x, w, axis_name="tp"), mesh=mesh,
                          in_specs=(P("tp"), P()), out_specs=P("tp")))
assert f(x, w).shape == (128, 32)
fake_gpu.install(setattr, fake_gpu.FakeNative())
jax_overlap.initialize()
x16, w16 = jnp.ones((4096, 1024), jnp.bfloat16), jnp.ones((1024, 1024), jnp.bfloat16)
g = jax.jit(jax.shard_map(lambda x, w: jax_overlap.ag_matmul(x, w, axis_name="tp", algorithm="pipelined"),
                          mesh=mesh, in_specs=(P("tp"), P()), out_specs=P("tp")))
assert fake_gpu.custom_calls(fake_gpu.cuda_text(g, x16, w16))
print(json.dumps({"tried": tried, "loaded": "jax_overlap._native_testing" in sys.modules}))
"""


def test_the_package_never_imports_the_harness(tmp_path):
  out = subprocess.run([sys.executable, "-c", _RUN_THE_PACKAGE, str(TESTS)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert json.loads(out.stdout.splitlines()[-1]) == {"tried": [], "loaded": False}
