"""One copy against the same bytes in pieces of the pipelined algorithm's cap, on one GPU.

  python benchmarks/bench_copy_split.py [--sizes-mib 256 512 1024 2048] [--paths copy_engine kernel]
                                        [--rounds 5] [--repeats 10] [--no-ipc] [--json FILE]

Every copy of the pipelined algorithm is split at MAX_COPY_BYTES (128 MiB, csrc/pipelined/copy.h): one SDMA
copy of 256 MiB or more can stall the engine and hang on 8x MI355X, where 128 MiB pieces cost no bandwidth
(ROCm/rocm-systems #9927). This measures what the split costs here. For each size, source and copy path:
the copy as one call and as pieces of the cap, each timed by jax_overlap._native.time_copy (events around
the copy into a fresh buffer, median of --repeats after one warm-up), the two alternating for --rounds
rounds so that clocks drift alike; medians, in GB/s (bytes / time), and pieces / one.

Sources:
  local  this GPU's memory (the schedule's local copies: x into its slot, its own rows)
  ipc    a buffer another process allocated and exported by IPC handle, mapped here (a pull from a peer
         process's workspace; on one GPU, its own memory through the mapping). Needs cupy (CUDA); skipped
         without it or with --no-ipc.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from jax_overlap.runtime import native

_EXPORTER = """
import sys
import cupy
ptr = cupy.cuda.runtime.malloc(int(sys.argv[1]))
print(cupy.cuda.runtime.ipcGetMemHandle(ptr).hex(), flush=True)
sys.stdin.readline()  # the importer is done
cupy.cuda.runtime.free(ptr)
"""


class IpcBuffer:
  """`nbytes` of device memory of a child process, mapped into this one by IPC handle."""

  def __init__(self, nbytes: int):
    import cupy
    self._cupy = cupy
    self._child = subprocess.Popen([sys.executable, "-c", _EXPORTER, str(nbytes)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
    handle = bytes.fromhex(self._child.stdout.readline().strip())
    self.ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle)

  def close(self):
    self._cupy.cuda.runtime.ipcCloseMemHandle(self.ptr)
    self._child.stdin.write("done\n")
    self._child.stdin.flush()
    self._child.wait(timeout=60)


def measure(nat, src: int, nbytes: int, path: str, rounds: int, repeats: int, cap: int) -> dict:
  one, pieces = [], []
  for _ in range(rounds):
    one.append(nat.time_copy(0, src, nbytes, repeats, path, nbytes))
    pieces.append(nat.time_copy(0, src, nbytes, repeats, path, cap))
  one_us, pieces_us = statistics.median(one), statistics.median(pieces)
  return {"one_us": one_us, "pieces_us": pieces_us, "one_gbps": nbytes / one_us / 1e3,
          "pieces_gbps": nbytes / pieces_us / 1e3, "pieces_over_one": pieces_us / one_us}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--sizes-mib", type=int, nargs="+", default=[256, 512, 1024, 2048])
  ap.add_argument("--paths", nargs="+", default=["copy_engine"], help="copy paths (copy_engine, device_to_device, "
                  "kernel)")
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--repeats", type=int, default=10)
  ap.add_argument("--no-ipc", action="store_true")
  ap.add_argument("--json", help="also write the rows here, one JSON object per line")
  args = ap.parse_args(argv)
  nat = native.module()
  if nat is None or native.platform() is None:
    print("bench_copy_split: needs a GPU build of jax_overlap")
    return 1
  from jax_overlap import _native_testing
  sources = {"local": None}
  if not args.no_ipc:
    try:
      sources["ipc"] = IpcBuffer(max(args.sizes_mib) << 20)
    except ImportError:
      print("bench_copy_split: no cupy here: the ipc rows are skipped")
  cap = _native_testing.MAX_COPY_BYTES
  cap_mib = cap >> 20
  rows = []
  try:
    for mib in args.sizes_mib:
      for source, buffer in sources.items():
        for path in args.paths:
          row = {"mib": mib, "source": source, "path": path, "cap_mib": cap_mib,
                 **measure(nat, 0 if buffer is None else buffer.ptr, mib << 20, path, args.rounds, args.repeats, cap)}
          rows.append(row)
          print(f"{mib:>6} MiB  {source:<5}  {path:<16}  one copy {row['one_gbps']:7.1f} GB/s  "
                f"{cap_mib} MiB pieces {row['pieces_gbps']:7.1f} GB/s  pieces/one {row['pieces_over_one']:.3f}",
                flush=True)
  finally:
    for buffer in sources.values():
      if buffer is not None:
        buffer.close()
  if args.json:
    with open(args.json, "w") as fh:
      for row in rows:
        fh.write(json.dumps(row) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
