"""The MaxText wheels for the GPU machine (no network): made where pip reaches PyPI, installed there.

  python tools/maxtext_wheels.py download .whl_maxtext      (a machine with network; the wheels for CPython 3.12)
  python tools/maxtext_wheels.py install .whl_maxtext DIR   (the GPU machine; then PYTHONPATH=DIR)

download fetches the pins of tests/maxtext/gpu_wheels.txt (no dependencies: the list is complete), then makes the
carried set smaller: MaxText's wheel without maxtext/assets (tokenizers, 10 MiB; synthetic data needs none), and in
place of xprof (a 30 MiB wheel, 100 MB installed, which tokamax imports for kernel benchmarks only) a stand-in that
gives what that import reaches. install puts into DIR each wheel whose distribution this Python lacks (one it has,
at any version, stays: the machine's own jax stack wins), and flax where the installed one is older than MaxText
0.2.5 takes; it checks that every pin of the list has its wheel in the folder.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import io
import pathlib
import re
import subprocess
import sys
import zipfile

MANIFEST = pathlib.Path(__file__).resolve().parents[1] / "tests" / "maxtext" / "gpu_wheels.txt"
MINIMUM = {"flax": (0, 12, 9)}  # MaxText 0.2.5's floor: an older installed one is shadowed by the carried wheel
SLIM_TAG = "1slim"
XPROF_STUB = '''"""Stand-in for xprof (100 MB installed): tokamax imports xprof.cli.tools.get_kernel_stats_tool at import time
(tokamax/_src/benchmarking.py) and uses it only to benchmark kernels. Training never calls it."""
'''
XPROF_TOOLS = '''def get_kernel_stats_tool(*args, **kwargs):
  raise NotImplementedError("xprof stand-in (tools/maxtext_wheels.py): kernel statistics need the real xprof")
'''


def pins() -> list:
  """(name, version) of every pin in the manifest."""
  found = []
  for line in MANIFEST.read_text().splitlines():
    line = line.split("#")[0].strip()
    if line:
      name, version = line.split("==")
      found.append((name.strip(), version.strip()))
  return found


def _key(name: str) -> str:
  return re.sub(r"[-_.]+", "_", name).lower()


def _wheel(entries: dict, name: str, version: str, tag: str = "") -> bytes:
  """A py3-none-any wheel holding `entries` (path -> bytes) and its dist-info, RECORD included."""
  info = f"{name}-{version}.dist-info"
  entries = {**entries, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": (f"Wheel-Version: 1.0\nGenerator: maxtext_wheels\nRoot-Is-Purelib: true\n"
                               f"{'Build: ' + tag + chr(10) if tag else ''}Tag: py3-none-any\n").encode()}
  return _zip(entries, info)


def _zip(entries: dict, info: str) -> bytes:
  record = []
  buffer = io.BytesIO()
  with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as z:
    for path, data in entries.items():
      if path == f"{info}/RECORD":
        continue
      z.writestr(path, data)
      digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
      record.append(f"{path},sha256={digest},{len(data)}")
    z.writestr(f"{info}/RECORD", "\n".join(record + [f"{info}/RECORD,,"]) + "\n")
  return buffer.getvalue()


def download(folder: pathlib.Path) -> None:
  folder.mkdir(parents=True, exist_ok=True)
  wanted = [f"{n}=={v}" for n, v in pins()]
  subprocess.check_call([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                         "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64", "--platform",
                         "manylinux_2_27_x86_64", "--platform", "manylinux_2_24_x86_64", "--platform",
                         "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "-d", str(folder), *wanted])
  for path in folder.glob("maxtext-*.whl"):
    if SLIM_TAG in path.name:
      continue
    with zipfile.ZipFile(path) as z:
      entries = {n: z.read(n) for n in z.namelist() if not n.startswith("maxtext/assets/")}
      info = next(n.split("/")[0] for n in entries if n.endswith(".dist-info/WHEEL"))
    entries[f"{info}/WHEEL"] = entries[f"{info}/WHEEL"].replace(b"Tag:", f"Build: {SLIM_TAG}\nTag:".encode(), 1)
    version = info[len("maxtext-"):-len(".dist-info")]
    (folder / f"maxtext-{version}-{SLIM_TAG}-py3-none-any.whl").write_bytes(_zip(entries, info))
    path.unlink()
  stub = _wheel({"xprof/__init__.py": XPROF_STUB.encode(), "xprof/cli/__init__.py": b"",
                 "xprof/cli/tools.py": XPROF_TOOLS.encode()}, "xprof", "0.0.0+stub")
  (folder / "xprof-0.0.0+stub-py3-none-any.whl").write_bytes(stub)
  print(f"{len(list(folder.glob('*.whl')))} wheels in {folder}")


def _version(text: str) -> tuple:
  return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def install(folder: pathlib.Path, target: pathlib.Path) -> None:
  wheels = {_key(p.name.split("-")[0]): p for p in folder.glob("*.whl")}
  missing = [f"{n}=={v}" for n, v in pins() if _key(n) not in wheels]
  if missing:
    raise SystemExit(f"maxtext_wheels: {folder} lacks the wheels of {missing} (tools/maxtext_wheels.py download)")
  todo = []
  for key, path in sorted(wheels.items()):
    name = path.name.split("-")[0]
    try:
      have = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      todo.append(str(path))
      continue
    if key in MINIMUM and _version(have) < MINIMUM[key]:
      print(f"{name} {have} is older than {'.'.join(map(str, MINIMUM[key]))}: the carried wheel shadows it")
      todo.append(str(path))
    else:
      print(f"keep {name} {have}")
  if todo:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                           str(target), *todo])
  print(f"installed {len(todo)} wheels into {target}")


def main(argv: list) -> None:
  if len(argv) == 2 and argv[0] == "download":
    download(pathlib.Path(argv[1]))
  elif len(argv) == 3 and argv[0] == "install":
    install(pathlib.Path(argv[1]), pathlib.Path(argv[2]))
  else:
    raise SystemExit(__doc__)


if __name__ == "__main__":
  main(sys.argv[1:])
