"""The README's main job runs, checks itself against its reference and says PASS (a short run: 2 steps)."""

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("flax", reason="the transformer block example needs flax (pip install '.[examples]')")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_transformer_block_example():
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
  run = subprocess.run([sys.executable, str(ROOT / "examples" / "transformer_block.py"), "--steps", "2"], env=env,
                       capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stdout + run.stderr
  assert "step 2/2" in run.stdout and "ms/step (compilation excluded)" in run.stdout
  assert run.stdout.strip().splitlines()[-1].startswith("PASS: "), run.stdout
