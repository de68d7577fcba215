"""Per-workgroup traces of the fused kernels, exported as Chrome/Perfetto JSON.

Enable with jax_overlap.initialize(trace=True) (or JAX_OVERLAP_TRACE=1) before
running the calls to trace; then `export(path)` writes what the GPUs recorded
since the last export (the buffer holds 65536 events per GPU) and returns the
time split: busy time per event kind, summed over workgroups. The switch is a
word in GPU memory that kernels read as they record, so it also reaches calls
compiled earlier, including those XLA replays from its command buffers.
"""

from __future__ import annotations

import json

import numpy as np

from jax_overlap.runtime import backend, workspace

# Mirrors csrc/kernels/params.h TraceEvent and TraceKind.
EVENT_DTYPE = np.dtype([("start", "<u8"), ("end", "<u8"), ("block", "<u4"), ("kind", "<u4"), ("arg0", "<u4"),
                        ("arg1", "<u4")])
KINDS = ("gemm_tile", "wait", "fetch", "publish", "reduce")


def events(ordinal: int) -> tuple[np.ndarray, float]:
  """Raw events of one local GPU (and clears them), with timer ticks per microsecond."""
  raw, ticks_per_us = backend.current().native.read_trace(ordinal)
  return np.frombuffer(raw, dtype=EVENT_DTYPE), ticks_per_us


def export(path: str) -> dict:
  """Writes a Chrome trace (one process per GPU, one thread per workgroup); returns the time split in us.

  Example (after jax_overlap.initialize(trace=True) and the calls to trace): jax_overlap.tracing.export("trace.json")
  """
  trace_events = []
  split: dict[str, float] = {k: 0.0 for k in KINDS}
  for dev in workspace.workspace_info()["devices"]:
    ev, ticks_per_us = events(dev["ordinal"])
    if len(ev) == 0:
      continue
    t0 = int(ev["start"].min())
    for e in ev:
      kind = KINDS[e["kind"]] if e["kind"] < len(KINDS) else f"kind{e['kind']}"
      dur = (int(e["end"]) - int(e["start"])) / ticks_per_us
      split[kind] = split.get(kind, 0.0) + dur
      trace_events.append({"name": kind, "ph": "X", "pid": dev["global_id"], "tid": int(e["block"]),
                           "ts": (int(e["start"]) - t0) / ticks_per_us, "dur": dur,
                           "args": {"index": int(e["arg0"]), "rank": int(e["arg1"])}})
  with open(path, "w") as f:
    json.dump({"traceEvents": trace_events, "displayTimeUnit": "ns"}, f)
  return split
