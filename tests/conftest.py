"""Shared test setup: the installed package, 8 CPU host devices, the `gpu` marker's skip, and the helpers every test
file uses.

The environment is set before anything imports jax. JAX_PLATFORMS defaults to
cpu so the CPU suite never touches an accelerator; on a GPU machine run the
GPU tests with JAX_PLATFORMS=cuda (or rocm), which this file leaves alone.
"""

import importlib.util
import math
import os
import pathlib
import re
import sys
import zlib

# The suite tests the package pip installed. `python -m pytest` puts the current directory first on sys.path, and
# from the repository root that would import ./jax_overlap, the sources, which hold no native module: a CUDA build
# would go untested and its tests would skip. So the root comes off sys.path before anything imports jax_overlap,
# unless PYTHONPATH names it (testing the sources without installing them, on purpose). An editable install
# (pip install -e .) still imports these sources, through the import hook it installs.
_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _is_root(entry: str) -> bool:
  return pathlib.Path(entry or os.curdir).resolve() == _ROOT


if not any(_is_root(entry) for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry):
  sys.path[:] = [entry for entry in sys.path if not _is_root(entry)]

_HOST_DEVICES = "--xla_force_host_platform_device_count=8"
if _HOST_DEVICES not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_HOST_DEVICES}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Simulated ranks (SimGroup) share one CUDA context, so one rank's spinning wait kernel can stand in
# front of the release it waits for, issued by another rank: in a hardware queue that two of the
# context's streams share (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default, at most 32), or in the first
# launch of a lazily loaded kernel (which waits for the context's running kernels). The most queues
# and every module loaded up front make that rarer, not impossible (tests/gpu/test_pipelined.py says
# which tests it left to processes of their own).
# The GPU tests start JAX processes of their own on the same GPU (tests/gpu/multiprocess.py under MPS):
# this process must not hold the 75% of GPU memory JAX takes up front by default (seen on the H200:
# the workers' pipelined calls then failed for memory).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import jax  # noqa: E402  (after the environment above)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import tolerance  # noqa: E402


def pytest_configure(config):
  if importlib.util.find_spec("jax_overlap") is None:
    raise pytest.UsageError(
        f"jax_overlap is not installed in this Python ({sys.executable}); the tests run against the installed "
        f"package, not the sources in {_ROOT}. Install it first: pip install '{_ROOT}[test,examples]' "
        f"(JAX_OVERLAP_PLATFORM=none skips the native build), or pip install -e '{_ROOT}[test,examples]' to "
        f"test the sources as you edit them (PYTHONPATH={_ROOT} also does, without the native module).")


def _gpu_backend() -> str | None:
  for name in ("cuda", "rocm", "gpu"):
    try:
      if jax.devices(name):
        return name
    except RuntimeError:
      pass
  return None


def pytest_collection_modifyitems(config, items):
  gpu_items = [item for item in items if "gpu" in item.keywords]
  if not gpu_items or _gpu_backend() is not None:
    return
  skip = pytest.mark.skip(reason=f"needs an NVIDIA or AMD GPU (jax's backend here: {jax.default_backend()}; "
                                 f"JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')!r})")
  for item in gpu_items:
    item.add_marker(skip)


# --- tolerances ---------------------------------------------------------------
# One scheme for every test (tolerance.py, which the GPU tests and the multi-process scenarios import too).

@pytest.fixture
def assert_close():
  return tolerance.assert_close


# --- inputs -------------------------------------------------------------------

@pytest.fixture
def rng(request):
  """A generator seeded from the test's id: every parametrized case draws its own inputs."""
  return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def normal(rng):
  """normal(shape, dtype): unit-normal values rounded to `dtype`, as a NumPy array of that dtype."""
  def draw(shape, dtype):
    return rng.standard_normal(shape).astype(np.dtype(dtype))
  return draw


@pytest.fixture
def fp8(rng):
  """fp8(shape, format): unit-normal values rounded to the float8 format, as a NumPy array of it."""
  def draw(shape, fmt):
    return rng.standard_normal(shape).astype(jax.numpy.dtype(fmt))
  return draw


# --- meshes and compiled HLO ----------------------------------------------------

def mesh_of(shape: tuple, names: tuple, axis_type=jax.sharding.AxisType.Auto) -> jax.sharding.Mesh:
  """A mesh over the first prod(shape) CPU devices (Auto axes unless told otherwise)."""
  n = math.prod(shape)
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names), devices=jax.devices()[:n])


@pytest.fixture
def make_mesh():
  return mesh_of


@pytest.fixture
def fake(monkeypatch):
  """A fresh runtime on a FakeNative (every CPU device as a GPU of this process), not set up; jax's caches cleared
  before and after, so no executable lowered for another runtime is reused."""
  import jax
  from fake_gpu import FakeNative, install
  native = FakeNative()
  install(monkeypatch.setattr, native)
  jax.clear_caches()
  yield native
  jax.clear_caches()


@pytest.fixture
def fake_gpu_runtime(monkeypatch):
  """A runtime that believes it has every CPU device as a reachable GPU (tests/fake_gpu.py: an H200's sm_90, a
  300 GB/s link), set up with a 1 GiB workspace; the FakeNative it runs on."""
  import jax_overlap
  from fake_gpu import FakeNative, install
  fake = FakeNative()
  install(monkeypatch.setattr, fake)
  jax_overlap.initialize(workspace_bytes=1 << 30)
  return fake


_COLLECTIVE = re.compile(r"^\s*(?:ROOT\s+)?\S+\s*=\s*(.*?)\s+(all-gather|all-reduce|reduce-scatter|all-to-all|"
                         r"collective-permute)(?:-start)?\(")


def collectives(hlo_text: str) -> list[tuple[str, tuple[int, ...]]]:
  """(kind, result dims) of every collective in compiled HLO text, e.g. ("all-gather", (16, 32)).

  A tuple-shaped collective (XLA combines some) shows the dims of its first
  element. The element type is left out: XLA's CPU backend widens bf16/f16
  collectives to f32.
  """
  found = []
  for line in hlo_text.splitlines():
    m = _COLLECTIVE.search(line)
    if m:
      dims = re.search(r"\[([\d,]*)\]", m.group(1)).group(1)
      found.append((m.group(2), tuple(int(d) for d in dims.split(",") if d)))
  return found


@pytest.fixture
def compiled_collectives():
  def run(jitted, *args):
    return collectives(jitted.lower(*args).compile().as_text())
  return run
