"""Every python snippet in README.md runs as pasted, in a fresh interpreter against the installed package, and ends
by printing its check against plain jnp / stock Flax: PASS."""

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
# (line of the opening fence, code) of every ```python block.
SNIPPETS = [(README.read_text()[:m.start()].count("\n") + 1, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```$", README.read_text(), re.M | re.S)]


def test_readme_has_its_snippets():
  """The Flax layers, shard_map and global-array snippets (a broken pattern would leave nothing to run)."""
  assert len(SNIPPETS) >= 3, SNIPPETS


@pytest.mark.parametrize("line, code", SNIPPETS, ids=[f"README.md:{line}" for line, _ in SNIPPETS])
def test_readme_snippet_runs_as_pasted(line, code, tmp_path):
  if re.search(r"^from flax|^import flax", code, re.M) and importlib.util.find_spec("flax") is None:
    pytest.skip("this snippet needs flax (pip install '.[examples]')")
  path = tmp_path / f"readme_{line}.py"
  path.write_text(code)
  run = subprocess.run([sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, f"README.md:{line}\n{run.stdout}{run.stderr}"
  lines = run.stdout.strip().splitlines()
  assert lines and lines[-1].endswith(": PASS"), f"README.md:{line}\n{run.stdout}{run.stderr}"


def test_ci_runs_the_readmes_test_command():
  """The README's second set-up command is the one CI runs (.ci/run), so the time the README states is CI's."""
  block = re.search(r"^```bash\n(.*?)^```$", README.read_text(), re.M | re.S)
  assert block, "README.md has no ```bash block of set-up commands"
  commands = [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]
  assert len(commands) == 2, commands
  ci = (README.parent / ".ci" / "run").read_text().splitlines()
  assert any(line.strip().split(" || ")[0] == commands[1] for line in ci), f"CI does not run {commands[1]!r}"


def test_readme_figures_are_performance_mds():
  """Each figure lives in docs/performance.md; the README's performance table and ratios copy it, never drift."""
  text = README.read_text()
  performance = (README.parent / "docs" / "performance.md").read_text()
  section = text[text.index("## Performance"):text.index("\n## ", text.index("## Performance") + 1)]
  table = [cell.strip() for line in section.splitlines() if line.startswith("| ") for cell in line.split("|")]
  figures = [c for c in table if re.fullmatch(r"\d+\.\d+", c)] + re.findall(r"\d+\.\d+(?:-\d+\.\d+)?x", text)
  assert len(figures) >= 20, figures
  missing = [f for f in figures if f not in performance]
  assert not missing, f"README.md figures that docs/performance.md does not hold: {missing}"
