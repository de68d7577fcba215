"""docs/performance.md's "Where the code's constants come from" (issue 53 item 5: the provenance of the code's figures
lives in the docs, not in comments): every constant it names is in the file it names, with the value it gives, and
every results file it cites exists, unless it says the file is in git's history. Comments that cite a section of
performance.md by name cite one that exists."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PERFORMANCE = ROOT / "docs" / "performance.md"
SECTION = "Where the code's constants come from"
CODE_SUFFIXES = (".py", ".h", ".cu", ".cc")


def _headings() -> set:
  return {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", PERFORMANCE.read_text(), re.M)}


def _rows() -> list:
  """The section's table rows as (constants cell, measurement cell, where-recorded cell)."""
  text = PERFORMANCE.read_text()
  start = text.find(f"## {SECTION}\n")
  if start < 0:
    return []
  end = text.find("\n## ", start + 1)
  body = text[start:] if end < 0 else text[start:end]
  rows = []
  for line in body.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| ") else []
    if len(cells) == 3 and not set(cells[0]) <= {"-", " "} and cells[0] != "constant or choice (file)":
      rows.append(tuple(cells))
  return rows


def _code_file(name: str) -> Path | None:
  for path in (ROOT / name, ROOT / "jax_overlap" / name):
    if path.is_file():
      return path
  return None


def _value(text: str):
  text = text.strip().rstrip(",")
  try:
    return float(text)
  except ValueError:
    return text.strip("\"'")


def test_the_section_has_rows():
  assert SECTION in _headings(), f"docs/performance.md has no section {SECTION!r}"
  assert len(_rows()) >= 10, _rows()


@pytest.mark.parametrize("row", _rows(), ids=lambda r: r[0][:60])
def test_each_constant_is_in_its_file_with_its_value(row):
  spans = re.findall(r"`([^`]+)`", row[0])
  files = [s for s in spans if s.endswith(CODE_SUFFIXES)]
  assert files, f"row {row[0]!r}: names no file"
  paths = [_code_file(f) for f in files]
  assert all(paths), f"row {row[0]!r}: no such file among {files}"
  sources = "\n".join(p.read_text() for p in paths)
  for span in spans:
    if span in files:
      continue
    name = re.match(r"[A-Za-z_]\w*", span).group(0)
    assert re.search(rf"\b{name}\b", sources), f"row {row[0]!r}: {name} is not in {files}"
    if "=" in span:
      stated = _value(span.split("=", 1)[1])
      found = re.search(rf"^\s*{name}\s*=\s*([^\s#]+)", sources, re.M)
      assert found, f"row {row[0]!r}: no assignment of {name} in {files}"
      assert _value(found.group(1)) == stated, f"{name}: docs/performance.md says {stated!r}, the code {found.group(1)}"


@pytest.mark.parametrize("row", _rows(), ids=lambda r: r[0][:60])
def test_each_results_file_exists_or_is_in_git_history(row):
  recorded = row[2]
  for m in re.finditer(r"`([^`/]+\.(?:json|txt|md|svg|jsonl))`", recorded):
    after = recorded[m.end():].split("`", 1)[0]
    if "git history" in after:
      continue
    assert (ROOT / "benchmarks" / "results" / m.group(1)).is_file(), \
        f"row {row[0]!r}: benchmarks/results/{m.group(1)} does not exist and is not marked as in git's history"


def test_comments_cite_sections_that_exist():
  headings = _headings()
  cited = []
  for path in [*(ROOT / "jax_overlap").rglob("*.py"), *(ROOT / "csrc").rglob("*")]:
    if path.suffix in CODE_SUFFIXES:
      text = re.sub(r"\n\s*(//|#)\s*", " ", path.read_text())
      cited += [(path.name, s) for s in re.findall(r'docs/performance\.md, "([^"]+)"', text)]
  assert cited, "no comment cites a section of docs/performance.md"
  missing = [(f, s) for f, s in cited if s not in headings]
  assert not missing, f"cited sections that docs/performance.md does not have: {missing}"
