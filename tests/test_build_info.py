"""What a newcomer reads first: build_info() on this machine, and the DEBUG log of the path each call took."""

import json
import logging
import pathlib
import subprocess
import sys
import types

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap
from jax_overlap.runtime import native

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_build_info_says_what_runs_here():
  """No GPU in this process: whatever was built, the calls take the XLA path, and build_info says so."""
  info = jax_overlap.build_info()
  assert info["runs"].startswith("the XLA path")
  if info["platform"] is None:  # a pure-Python install, or sources on sys.path before the installed package
    assert info["runs"].startswith("the XLA path (no native extension in ")
    assert "failed to load" not in info["runs"]
  else:  # a GPU build (CI's CUDA build) on a machine without that GPU
    assert f"built for {info['platform']}, but this process has no {info['platform']} devices" in info["runs"]
    assert "JAX backend: cpu" in info["runs"]


def test_build_info_on_a_gpu_build_with_its_gpus_names_what_auto_takes(monkeypatch):
  """auto takes the pipelined algorithm across GPUs and XLA's dot for a group of one; the fused kernels only when
  asked for (the wording once said auto ran the fused kernels)."""
  built = {"platform": "cuda", "archs": "90", "compiler": "NVIDIA 13.0", "ffi_api": "0.1", "fused_kernels": True}
  monkeypatch.setattr(native, "_native", types.SimpleNamespace(build_info=lambda: dict(built)))
  monkeypatch.setattr(native, "gpu_available", lambda: True)
  runs = native.build_info()["runs"]
  assert runs.startswith("on cuda, algorithm='auto' takes the pipelined algorithm for groups of two or more"), runs
  assert "XLA's dot for a group of one" in runs and "fused kernels run when asked for (algorithm='fused')" in runs


def _build_info_in(cwd) -> dict:
  """build_info() and the package's file, from `python -c` run in `cwd` (which Python puts first on sys.path)."""
  code = "import json, jax_overlap; print(json.dumps({**jax_overlap.build_info(), 'file': jax_overlap.__file__}))"
  run = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)
  assert run.returncode == 0, run.stderr
  return json.loads(run.stdout.strip().splitlines()[-1])


def test_build_info_from_the_repository_root_tells_which_copy_it_imported(tmp_path):
  """`python -c` in the repository root imports ./jax_overlap; unless that is the installed package (an editable
  install), build_info says it imported the sources and where the installed package is."""
  from_root, elsewhere = _build_info_in(ROOT), _build_info_in(tmp_path)
  if from_root["file"] == elsewhere["file"]:
    assert from_root == elsewhere
  else:
    installed = pathlib.Path(elsewhere["file"]).resolve().parent
    assert from_root["platform"] is None
    assert f"Python imported these sources, which come before the installed package in {installed}" \
        in from_root["runs"], from_root


def test_build_info_never_shows_import_machinery():
  """A pure-Python install used to report Python's 'circular import' wording for the missing module."""
  info = jax_overlap.build_info()
  text = " ".join(str(v) for v in info.values())
  assert "circular import" not in text and "partially initialized" not in text
  if native.module() is None:
    assert info["note"].startswith("no native extension in ")


def test_debug_log_names_the_path(caplog, make_mesh):
  mesh = make_mesh((4,), ("tp",))
  x, w = np.ones((16, 32), np.float32), np.ones((32, 16), np.float32)
  with caplog.at_level(logging.DEBUG, logger="jax_overlap"):
    jax.jit(jax.shard_map(lambda x, w: jax_overlap.ag_matmul(x, w, axis_name="tp"), mesh=mesh,
                          in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"))).lower(x, w).compile()
    args = (jax.device_put(x, NamedSharding(mesh, P(None, "tp"))), jax.device_put(w, NamedSharding(mesh, P("tp"))))
    jax.jit(jax_overlap.matmul_rs).lower(*args).compile()  # K sharded alike, nothing asks for a scatter
    jax.jit(jax_overlap.ag_matmul).lower(*args).compile()  # w's columns are not sharded
  text = caplog.text
  assert "jax_overlap.ag_matmul: XLA path (lowered for cpu)" in text
  assert "jax_overlap.matmul_rs: global arrays, all-reduce over ('tp',)" in text
  assert "jax_overlap.ag_matmul: global arrays, plain partitioning (" in text
