"""docs/maxtext-0.2.5.patch, what MaxText itself should change (docs/maxtext.md): it applies to the pinned MaxText
exactly (every hunk's context and removed lines where it says), and the Python files it changes still compile. The
integration does not need it (test_train.py runs MaxText unpatched)."""

from __future__ import annotations

import pathlib
import re

from installed import maxtext_root, requires_maxtext

pytestmark = requires_maxtext

PATCH = pathlib.Path(__file__).resolve().parents[2] / "docs" / "maxtext-0.2.5.patch"
HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def files(text: str) -> dict:
  """{path below src/maxtext: [(old start, [hunk lines])]} of a unified diff."""
  out, path = {}, None
  for line in text.splitlines():
    if line.startswith(("diff ", "--- ")):
      path = None
    elif line.startswith("+++ "):
      path = line[4:].split("\t")[0].removeprefix("b/src/maxtext/")
      out[path] = []
    elif (m := HUNK.match(line)):
      out[path].append((int(m.group(1)), []))
    elif path and out[path] and line[:1] in (" ", "+", "-"):
      out[path][-1][1].append(line)
  return out


def apply(original: list, hunks: list) -> list:
  result, at = [], 0
  for start, lines in hunks:
    old = [line[1:] for line in lines if line[0] in " -"]
    begin = start - 1
    assert original[begin:begin + len(old)] == old, f"a hunk at line {start} does not match the file"
    result += original[at:begin] + [line[1:] for line in lines if line[0] in " +"]
    at = begin + len(old)
  return result + original[at:]


def test_the_patch_applies_to_the_pinned_maxtext_and_compiles():
  root = maxtext_root()
  changed = files(PATCH.read_text())
  assert set(changed) == {"configs/base.yml", "configs/types.py", "layers/linears.py", "layers/moe.py",
                          "layers/quantizations.py"}
  for path, hunks in changed.items():
    patched = "\n".join(apply((root / path).read_text().splitlines(), hunks)) + "\n"
    if path.endswith(".py"):
      compile(patched, path, "exec")
  assert "def _configure_quantization(" in "\n".join(
      apply((root / "layers/quantizations.py").read_text().splitlines(), changed["layers/quantizations.py"]))
