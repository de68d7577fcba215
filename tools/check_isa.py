#!/usr/bin/env python3
"""ISA rules for the AMD kernels, checked on the output of tools/hip_compile_check.sh.

    python tools/check_isa.py [OUT_DIR]          (default: build/hip_check)

Reads OUT/<arch>/<file>.s (llvm-objdump -d), .res.log (kernel-resource-usage remarks)
and .notes (amdhsa.kernels metadata) for every arch the compile check built, and
enforces per kernel (a __global__ function, i.e. an entry in amdhsa.kernels):

  (a) MMA:     a kernel whose name contains "matmul" or "gemm" has >= 1 v_mfma/v_smfmac.
  (b) SYSTEM:  a kernel whose name contains "ag_matmul", "matmul_rs", "all_gather", "pipeline_wait",
               "pipeline_verify" or "pipeline_abandon"
               has a system-scope release (gfx942/gfx950: `buffer_wbl2 sc0 sc1` followed
               by a store with `sc0 sc1` or an atomic with `sc1`) and a system-scope
               acquire (a load with `sc0 sc1` or an atomic with `sc1`, followed by
               `buffer_inv sc0 sc1`). Their world-1 instantiations (last template argument
               kPeers = false) have no peer to synchronize with and are exempt.
  (c) SCRATCH: no kernel uses scratch (ScratchSize 0, private_segment_fixed_size 0,
               no dynamic stack).
  (d) VECTOR:  a kernel whose name contains "copy_2d_vec" (the pipelined algorithm's copy
               kernel, csrc/kernels/copy_kernels.cu) loads and stores 16 bytes per instruction
               (global_load_dwordx4 and global_store_dwordx4): the copy runs on a few CUs, so
               narrower moves would cut its rate by the width.

"Name" is the kernel's own unqualified function name (demangled, without namespaces,
template arguments and parameters). When a kernel calls a non-inlined function
(s_swappc_b64), the bodies of all non-kernel functions in its code object count for it.

Prints a table and exits 1 naming each violation; 0 when all rules hold (or when
there are no kernels yet); 2 when the inputs are missing.
`--warn c` (or JAX_OVERLAP_ISA_WARN=c; letters a, b, c, d) reports those rules' violations
as warnings without failing, for a rule that is known broken and being worked on.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

MMA_WORDS = ("matmul", "gemm")
SYS_WORDS = ("ag_matmul", "matmul_rs", "all_gather", "pipeline_wait", "pipeline_verify", "pipeline_abandon")
VEC_WORDS = ("copy_2d_vec",)
VEC_OPS = ("global_load_dwordx4", "global_store_dwordx4")
# Archs whose memory model uses the sc0/sc1 scope bits checked by rule (b).
SC_ARCH_RE = re.compile(r"^gfx9(4[0-9a-f]|5[0-9a-f])$")

FUNC_RE = re.compile(r"^[0-9a-fA-F]+ <(?P<sym>[^>]+)>:\s*$")
REMARK_RE = re.compile(
    r"remark:\s+(?P<key>Function Name|VGPRs|AGPRs|TotalSGPRs|ScratchSize \[bytes/lane\]|"
    r"Dynamic Stack|Occupancy \[waves/SIMD\]|SGPRs Spill|VGPRs Spill|LDS Size \[bytes/block\]):"
    r"\s*(?P<val>\S+)"
)


@dataclass
class Kernel:
    arch: str
    file: str
    sym: str
    name: str = ""  # demangled
    disp: str = ""  # compact, for the table and messages
    short: str = ""  # unqualified function name
    insts: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # from .notes
    res: dict = field(default_factory=dict)  # from remarks
    calls: bool = False
    mfma: int = 0
    sys_release: bool = False
    sys_acquire: bool = False
    scratch: int = 0
    vgprs: str = "?"
    agprs: str = "?"
    occupancy: str = "?"


def read_toolchain(out: str) -> dict:
    path = os.path.join(out, "toolchain.txt")
    info = {}
    with open(path) as f:
        for line in f:
            if "=" in line:
                k, v = line.rstrip("\n").split("=", 1)
                info[k] = v
    return info


def parse_disasm(path: str) -> dict[str, list[list[str]]]:
    """symbol -> list of instructions, each a token list (opcode, operands..., modifiers...)."""
    funcs: dict[str, list[list[str]]] = {}
    cur = None
    with open(path, errors="replace") as f:
        for line in f:
            m = FUNC_RE.match(line)
            if m:
                cur = funcs.setdefault(m.group("sym"), [])
                continue
            if cur is None or not line.startswith(("\t", " ")):
                continue
            text = line.split("//", 1)[0].strip()
            if not text or text.startswith("s_nop"):
                continue
            cur.append([t for t in re.split(r"[\s,]+", text) if t])
    return funcs


def parse_notes(path: str) -> dict[str, dict]:
    """amdhsa.kernels metadata: kernel symbol -> {key: value} (scalar keys only)."""
    kernels: dict[str, dict] = {}
    if not os.path.exists(path):
        return kernels
    in_kernels = False
    cur: dict = {}
    items: list[dict] = []
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("amdhsa.kernels:"):
                in_kernels = True
                continue
            if not in_kernels:
                continue
            if line.strip() and not line.startswith(" "):
                break  # next top-level key (amdhsa.target, ...)
            m = re.match(r"^  - \.(\w+):\s*(.*)$", line)
            if m:
                cur = {m.group(1): m.group(2).strip()}
                items.append(cur)
                continue
            m = re.match(r"^    \.(\w+):\s*(.*)$", line)
            if m and cur is not None:
                cur[m.group(1)] = m.group(2).strip()
    for it in items:
        if "name" in it:
            kernels[it["name"]] = it
    return kernels


def parse_remarks(path: str) -> dict[str, dict]:
    res: dict[str, dict] = {}
    cur = None
    if not os.path.exists(path):
        return res
    with open(path, errors="replace") as f:
        for line in f:
            m = REMARK_RE.search(line)
            if not m:
                continue
            key, val = m.group("key"), m.group("val")
            if key == "Function Name":
                cur = res.setdefault(val, {})
            elif cur is not None:
                cur[key.split(" [")[0]] = val
    return res


def find_demangler(info: dict) -> str | None:
    cand = info.get("cxxfilt") or ""
    if cand and os.access(cand, os.X_OK):
        return cand
    best = None
    for d in os.environ.get("PATH", "").split(os.pathsep):
        for p in glob.glob(os.path.join(d, "llvm-cxxfilt-*")):
            v = p.rsplit("-", 1)[-1]
            if v.isdigit() and (best is None or int(v) > best[0]):
                best = (int(v), p)
    if best:
        return best[1]
    return shutil.which("llvm-cxxfilt") or shutil.which("c++filt")


def demangle(names: list[str], tool: str | None) -> dict[str, str]:
    if not names or not tool:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names) + "\n", capture_output=True, text=True)
    lines = out.stdout.splitlines()
    if out.returncode != 0 or len(lines) != len(names):
        return {n: n for n in names}
    return dict(zip(names, lines))


def _strip_tail(s: str, open_c: str, close_c: str) -> str:
    """Remove one balanced trailing group like '(...)' or '<...>'."""
    s = s.rstrip()
    if not s.endswith(close_c):
        return s
    depth = 0
    for i in range(len(s) - 1, -1, -1):
        if s[i] == close_c:
            depth += 1
        elif s[i] == open_c:
            depth -= 1
            if depth == 0:
                return s[:i].rstrip()
    return s


def short_name(demangled: str) -> str:
    s = demangled.replace("(anonymous namespace)", "{anon}")
    s = _strip_tail(s, "(", ")")  # parameters
    s = _strip_tail(s, "<", ">")  # template arguments
    # Drop a leading return type ("void jo::k") at template depth 0.
    depth, last_space = 0, -1
    for i, c in enumerate(s):
        if c == "<":
            depth += 1
        elif c == ">":
            depth -= 1
        elif c == " " and depth == 0:
            last_space = i
    s = s[last_space + 1 :]
    return s.rsplit("::", 1)[-1]


def display_name(demangled: str) -> str:
    """Compact name for the table: no return type, parameters or jo::/std:: prefixes."""
    s = _strip_tail(demangled, "(", ")")
    if s.startswith("void "):
        s = s[5:]
    for p in ("(anonymous namespace)::", "jo::gemm::", "jo::", "std::"):
        s = s.replace(p, "")
    return s


def is_mem(op: str, kind: str) -> bool:
    return re.match(rf"^(global|flat|buffer|scratch)_{kind}", op) is not None


def analyse(insts: list[list[str]]) -> tuple[int, bool, bool, bool]:
    mfma = 0
    calls = False
    rel_pending = acq_pending = False
    release = acquire = False
    for toks in insts:
        op, mods = toks[0], set(toks[1:])
        if op.startswith(("v_mfma", "v_smfmac")):
            mfma += 1
        if op == "s_swappc_b64":
            calls = True
        sc01 = "sc0" in mods and "sc1" in mods
        sys_atomic = is_mem(op, "atomic") and "sc1" in mods
        # release: buffer_wbl2 sc0 sc1, then a system-scope store / atomic
        if op == "buffer_wbl2" and sc01:
            rel_pending = True
        elif rel_pending and ((is_mem(op, "store") and sc01) or sys_atomic):
            release = True
        # acquire: a system-scope load / atomic, then buffer_inv sc0 sc1
        if (is_mem(op, "load") and sc01) or sys_atomic:
            acq_pending = True
        elif acq_pending and op == "buffer_inv" and sc01:
            acquire = True
    return mfma, calls, release, acquire


def to_int(v, default=0) -> int:
    try:
        return int(str(v).strip())
    except (TypeError, ValueError):
        return default


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default="build/hip_check", help="hip_compile_check.sh output dir")
    ap.add_argument("--warn", default=os.environ.get("JAX_OVERLAP_ISA_WARN", ""),
                    help="rules (letters a, b, c, d) whose violations only warn")
    args = ap.parse_args()
    out = args.out
    warn_only = {c for c in args.warn.lower() if c in "abcd"}

    if not os.path.exists(os.path.join(out, "toolchain.txt")):
        print(f"check_isa: {out}/toolchain.txt not found: run tools/hip_compile_check.sh {out} first")
        return 2
    info = read_toolchain(out)
    archs = info.get("archs", "").split()
    skipped = info.get("skipped_archs", "").split()
    n_files = to_int(info.get("kernels"), 0)
    print(f"check_isa: {info.get('clang_version', '?')}; archs: {' '.join(archs)}"
          + (f"; SKIPPED (compiler too old): {' '.join(skipped)}" if skipped else ""))
    if to_int(info.get("failures"), 0) > 0:
        print("check_isa: the compile check reported failures; results are incomplete")
    if n_files == 0:
        print("check_isa: no kernels (csrc/kernels has no .cu file)")
        return 0

    violations: list[str] = []
    kernels: list[Kernel] = []
    for arch in archs:
        s_files = sorted(glob.glob(os.path.join(out, arch, "*.s")))
        if len(s_files) != n_files:
            violations.append(f"{arch}: {len(s_files)} disassembly file(s) for {n_files} kernel source(s)")
        for s_path in s_files:
            stem = os.path.splitext(os.path.basename(s_path))[0]
            funcs = parse_disasm(s_path)
            notes = parse_notes(os.path.join(out, arch, stem + ".notes"))
            remarks = parse_remarks(os.path.join(out, arch, stem + ".res.log"))
            kernel_syms = list(notes) if notes else list(remarks)
            helpers = [insts for sym, insts in funcs.items() if sym not in kernel_syms]
            for sym in kernel_syms:
                k = Kernel(arch=arch, file=stem, sym=sym, meta=notes.get(sym, {}), res=remarks.get(sym, {}))
                k.insts = funcs.get(sym, [])
                if not k.insts:
                    violations.append(f"{arch} {stem}: kernel {sym} has no disassembly")
                k.mfma, k.calls, k.sys_release, k.sys_acquire = analyse(k.insts)
                if k.calls and helpers:  # count non-inlined callees (conservative)
                    extra = [t for h in helpers for t in h]
                    m2, _, r2, a2 = analyse(k.insts + extra)
                    k.mfma, k.sys_release, k.sys_acquire = max(k.mfma, m2), r2, a2
                k.scratch = max(to_int(k.res.get("ScratchSize")), to_int(k.meta.get("private_segment_fixed_size")))
                if k.res.get("Dynamic Stack", "False").lower() == "true" or \
                        k.meta.get("uses_dynamic_stack", "false").lower() == "true":
                    k.scratch = max(k.scratch, 1)
                k.vgprs = k.res.get("VGPRs", k.meta.get("vgpr_count", "?"))
                k.agprs = k.res.get("AGPRs", k.meta.get("agpr_count", "?"))
                k.occupancy = k.res.get("Occupancy", "?")
                kernels.append(k)

    if not kernels:
        print("check_isa: no kernels (no __global__ function in csrc/kernels/*.cu)")
        for v in violations:
            print(f"VIOLATION: {v}")
        return 1 if violations else 0

    names = demangle(sorted({k.sym for k in kernels}), find_demangler(info))
    for k in kernels:
        k.name = names.get(k.sym, k.sym)
        k.short = short_name(k.name)
        k.disp = display_name(k.name)

    seen = {w: False for w in MMA_WORDS + SYS_WORDS + VEC_WORDS}
    for k in kernels:
        low = k.short.lower()
        for w in seen:
            if w in low:
                seen[w] = True
        where = f"{k.arch} {k.file}.cu: {k.disp}"
        if any(w in low for w in MMA_WORDS) and k.mfma == 0:
            violations.append(f"(a) no v_mfma in matmul/gemm kernel [{where}]")
        world1 = k.disp.rstrip().endswith(", false>")
        if any(w in low for w in SYS_WORDS) and not world1:
            if not SC_ARCH_RE.match(k.arch):
                print(f"check_isa: rule (b) has no pattern for {k.arch}; not checked [{where}]")
            else:
                if not k.sys_release:
                    violations.append(f"(b) no system-scope release (buffer_wbl2 sc0 sc1 + sc0 sc1 store/sc1 atomic) [{where}]")
                if not k.sys_acquire:
                    violations.append(f"(b) no system-scope acquire (sc0 sc1 load/sc1 atomic + buffer_inv sc0 sc1) [{where}]")
        if any(w in low for w in VEC_WORDS):
            ops = {t[0] for t in k.insts}
            for op in VEC_OPS:
                if op not in ops:
                    violations.append(f"(d) no {op} in the copy kernel [{where}]")
        if k.scratch != 0:
            spills = f"VGPR spill {k.res.get('VGPRs Spill', k.meta.get('vgpr_spill_count', '?'))}, " \
                     f"SGPR spill {k.res.get('SGPRs Spill', k.meta.get('sgpr_spill_count', '?'))}"
            violations.append(f"(c) scratch in use: {k.scratch} bytes/lane ({spills}) [{where}]")

    # Table
    rows = [("arch", "file", "kernel", "mfma", "sys_rel", "sys_acq", "scratch", "VGPRs", "AGPRs", "occ", "calls")]
    for k in sorted(kernels, key=lambda k: (k.arch, k.file, k.short, k.name)):
        shown = k.disp if len(k.disp) <= 90 else k.disp[:87] + "..."
        rows.append((k.arch, k.file, shown, str(k.mfma), "yes" if k.sys_release else "-",
                     "yes" if k.sys_acquire else "-", str(k.scratch), str(k.vgprs), str(k.agprs),
                     str(k.occupancy), "yes" if k.calls else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))

    absent = [w for w, s in seen.items() if not s]
    if absent:
        print("check_isa: no kernel named *" + "*, *".join(absent) + "* yet; their rules are not exercised")
    n = len(kernels)
    warnings = [v for v in violations if v[:3] in {f"({r})" for r in warn_only}]
    violations = [v for v in violations if v not in warnings]
    for v in warnings:
        print(f"WARNING (rule {v[1]} set to warn): {v}")
    if violations:
        for v in violations:
            print(f"VIOLATION: {v}")
        print(f"check_isa: FAILED: {len(violations)} violation(s) in {n} kernel(s) x arch")
        return 1
    rules = ("(a) mfma", "(b) system scope", "(c) no scratch", "(d) 16-byte copies")
    held = [r for r in rules if r[1] not in warn_only]
    print(f"check_isa: OK: {n} kernel(s) x arch; rules hold: {', '.join(held) or 'none'}"
          + (f"; warn only: {', '.join(sorted(warn_only))} ({len(warnings)} warning(s))" if warn_only else ""))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # output piped into head
        sys.exit(1)
