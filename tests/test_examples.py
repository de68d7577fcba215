"""The README's main job and the MLP examples run, check themselves against their references and say PASS, against
the installed package as a user runs them (python examples/<name>.py, nothing added to PYTHONPATH)."""

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

import jax_overlap

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str) -> str:
  """The example's stdout, from the repository root; fails unless it exits 0 and its last line says PASS."""
  run = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
  assert run.returncode == 0, run.stdout + run.stderr
  assert run.stdout.strip().splitlines()[-1].startswith("PASS: "), run.stdout
  return run.stdout


@pytest.mark.skipif(importlib.util.find_spec("flax") is None,
                    reason="the transformer block example needs flax (pip install '.[examples]')")
def test_transformer_block_example():
  """The README's main job as a user runs it: the CPU default, the stock block timed beside auto."""
  out = run_example("transformer_block.py")
  assert f"jax_overlap runs {jax_overlap.build_info()['runs']}\n" in out, "the example imported another jax_overlap"
  for label in ("stock", "auto"):
    assert f"{label}: step 2/2" in out, out
    assert re.search(rf"^{label}: median [\d.]+ ms/step, IQR [\d.]+-[\d.]+, min-max [\d.]+-[\d.]+ over 10 steps",
                     out, re.M), out
  assert "x the stock block's speed" in out and "On CPU devices every call takes the XLA path" in out, out


@pytest.mark.skipif(importlib.util.find_spec("flax") is None,
                    reason="the transformer block example needs flax (pip install '.[examples]')")
def test_transformer_block_example_in_fp8():
  """--fp8: the projections on the float8 layers, checked at the float8 tolerance."""
  out = run_example("transformer_block.py", "--fp8", "--steps", "1", "--timed", "2")
  assert "fp8 auto: step 1/1" in out and "fp8 auto: median" in out, out
  assert "within the float8 tolerance" in out.splitlines()[-1]


@pytest.mark.parametrize("name", ["mlp_shard_map.py", "mlp_jit.py"])
def test_mlp_example(name):
  out = run_example(name, "--steps", "2")
  assert "2 steps: " in out and " ms/step" in out
  assert f"{jax_overlap.build_info()['platform'] or 'no'} native build;" in out, \
      "the example imported another jax_overlap"
