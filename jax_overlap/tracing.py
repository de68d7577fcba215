"""Per-workgroup traces of the fused kernels as Chrome/Perfetto JSON: initialize(trace=True), run, export(path) (up
to 65536 events per GPU). The switch is a word in GPU memory, so it reaches compiled calls and command buffers too.
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
  """(one local GPU's events, cleared after reading; timer ticks per us)."""
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
