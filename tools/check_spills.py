#!/usr/bin/env python3
"""Register spills of the NVIDIA build's kernels, checked on ptxas's report (beside tools/check_isa.py).

    python tools/check_spills.py BUILD_LOG

BUILD_LOG is the output of a CUDA build with JAX_OVERLAP_PTXAS_VERBOSE=ON (ptxas -v prints, per
kernel, "Compiling entry function '<mangled>'", then "N bytes spill stores, M bytes spill loads"
and "Used R registers"). Every kernel must be spill-free, except those in BUDGET, which may
spill up to their budget: a kernel that spills more, or a new kernel that spills at all, fails.
Prints a table of the kernels that spill or use 255 registers; exits 1 on a violation, 2 when
the log has no ptxas report.

Budgets are today's figures (ptxas 13.0, sm_90), the same for bf16 and fp16. They belong to the
8-warp 128x256x64 tile of NvidiaArch, the one the benchmarks and the planner's large shapes run:
its warp tile of 64x64 holds 128 fp32 accumulators plus two fragment buffers (pipelined
fragments: 64 registers), so it sits at the 255-register limit with 4-8 address registers of
its loaders and epilogue to spare. What spills is outside the interior k-loop of the world-1
kernels (the SASS of those loops has no LDL/STL); the w-transposed (kKMajor) layout's checked
loader reloads a few per k-tile. Measured on the H200 (git show 6a98e4b:benchmarks/results/NOTES.md): pipelining
the fragments paid 12% on this tile despite the spills; 4 stages (more registers to the ring)
measured the same or slower, with spill reloads in the k-loop; unpipelined, the fused kernel did
not spill but ran 3.22 ms against 2.88. A budget moves only with a measurement that says so.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys

ENTRY_RE = re.compile(r"Compiling entry function '(\S+)'")
SPILL_RE = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
REGS_RE = re.compile(r"Used (\d+) registers")

# (kernel, arch, tile BMxBNxBK, w layout, peers) -> (spill store bytes, spill load bytes) allowed.
BUDGET = {
    ("ag_matmul_kernel", "nvidia", "128x256x64", "kNMajor", False): (328, 336),
    ("ag_matmul_kernel", "nvidia", "128x256x64", "kKMajor", False): (448, 540),
    ("ag_matmul_kernel", "nvidia", "128x256x64", "kNMajor", True): (64, 180),
    ("ag_matmul_kernel", "nvidia", "128x256x64", "kKMajor", True): (96, 208),
    ("matmul_rs_kernel", "nvidia", "128x256x64", "kNMajor", False): (328, 336),
    ("matmul_rs_kernel", "nvidia", "128x256x64", "kKMajor", False): (448, 540),
    ("matmul_rs_kernel", "nvidia", "128x256x64", "kNMajor", True): (52, 84),
    ("matmul_rs_kernel", "nvidia", "128x256x64", "kKMajor", True): (16, 24),
}


def demangle(names: list[str]) -> list[str]:
  tool = shutil.which("c++filt") or shutil.which("llvm-cxxfilt")
  if not tool or not names:
    return names
  out = subprocess.run([tool], input="\n".join(names) + "\n", capture_output=True, text=True)
  lines = out.stdout.splitlines()
  return lines if out.returncode == 0 and len(lines) == len(names) else names


def kernel_key(demangled: str):
  """(kernel, arch, tile, layout, peers) of a fused GEMM kernel, else (name, None, ...)."""
  name = re.search(r"(\w+_kernel)\b", demangled)
  shape = re.search(r"TileShape<(\d+), (\d+), (\d+),", demangled)
  layout = re.search(r"\(jo::gemm::BLayout\)(\d)", demangled)
  peers = re.search(r", (true|false)>\(", demangled)
  if not (name and shape and layout and peers):
    return (name.group(1) if name else demangled, None, None, None, None)
  arch = "amd" if "AmdArch" in demangled else "nvidia"
  return (name.group(1), arch, "x".join(shape.groups()), ("kNMajor", "kKMajor")[int(layout.group(1))],
          peers.group(1) == "true")


def parse(log: str) -> list[tuple[str, int, int, int]]:
  """[(mangled name, spill store bytes, spill load bytes, registers)] in log order."""
  out, cur, spill = [], None, (0, 0)
  for line in log.splitlines():
    m = ENTRY_RE.search(line)
    if m:
      cur, spill = m.group(1), (0, 0)
      continue
    m = SPILL_RE.search(line)
    if m and cur:
      spill = (int(m.group(1)), int(m.group(2)))
      continue
    m = REGS_RE.search(line)
    if m and cur:
      out.append((cur, spill[0], spill[1], int(m.group(1))))
      cur = None
  return out


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("log", help="CUDA build output with JAX_OVERLAP_PTXAS_VERBOSE=ON")
  args = ap.parse_args()
  with open(args.log, errors="replace") as f:
    kernels = parse(f.read())
  if not kernels:
    print(f"check_spills: no ptxas report in {args.log} (build with JAX_OVERLAP_PTXAS_VERBOSE=ON)")
    return 2
  # Each kernel once (a log may hold a file's compile twice).
  unique = {name: (st, ld, regs) for name, st, ld, regs in kernels}
  names = sorted(unique)
  violations, rows = [], []
  for name, shown in zip(names, demangle(names)):
    stores, loads, regs = unique[name]
    key = kernel_key(shown)
    budget = BUDGET.get(key, (0, 0))
    label = "/".join(str(p) for p in key) if key[1] else key[0]
    if stores > budget[0] or loads > budget[1]:
      violations.append(f"{label}: spills {stores} B stored / {loads} B loaded, budget {budget[0]} / {budget[1]}")
    if stores or loads or regs >= 255:
      rows.append((label, str(regs), str(stores), str(loads), f"{budget[0]}/{budget[1]}"))
  header = ("kernel", "regs", "spill st", "spill ld", "budget")
  widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
  for r in [header] + sorted(rows):
    print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
  for v in violations:
    print(f"VIOLATION: {v}")
  if violations:
    print(f"check_spills: FAILED: {len(violations)} kernel(s) over their spill budget (of {len(names)})")
    return 1
  print(f"check_spills: OK: {len(names)} kernel(s); {len(rows)} at 255 registers or spilling, all within budget")
  return 0


if __name__ == "__main__":
  sys.exit(main())
