"""bench_model_sweep's fit of the cost model's fixed figures to loopback rows (no GPU)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_model_sweep as sweep  # noqa: E402
from jax_overlap.ops import OPS  # noqa: E402
from jax_overlap.planning.figures import Figures  # noqa: E402


def _rows(truth: dict) -> tuple:
  """Rows of both ops and several plans whose loopback times are the model's with `truth`'s fixed figures."""
  rows, figs = [], []
  for op, stages in [("ag_matmul", (1, 1)), ("ag_matmul", (1, 3)), ("ag_matmul", (1, 2, 1)), ("matmul_rs", (2,)),
                     ("matmul_rs", (2, 2)), ("matmul_rs", (1, 1, 1, 1))]:
    world = sum(stages)
    for scale in (0.05, 0.3, 1.0):
      gemm = tuple(scale * 400.0 * s / world * (1.1 if s < world else 1.0) for s in range(1, world + 1))
      f = Figures(gemm, int(scale * (8 << 20)), 2e6, 2e6, reduce_us=scale * 9.0, publish_on_sms=True,
                  pulls_on_sms=True)
      loopback = OPS[op].planning.pipelined_us(stages, dataclasses.replace(f, **truth))
      model = OPS[op].planning.pipelined_us(stages, f)
      rows.append(dict(op=op, stages=str(stages), loopback_us=loopback, model_ratio=model / loopback))
      figs.append(f)
  return rows, figs


def test_the_fit_finds_the_figures_the_rows_were_made_with():
  truth = dict(stage_overhead_us=1.5, call_overhead_us=7.0, sm_pull_hidden=0.3)
  rows, figs = _rows(truth)
  fit = sweep.fit_model(rows, figs)
  assert {k: fit[k] for k in sweep.FITTED} == pytest.approx(truth)
  assert fit["rows_off_after"] == 0 and fit["worst_after"] == pytest.approx(0.0, abs=1e-9)
  assert all(r["fit_ratio"] == pytest.approx(1.0) for r in rows)
  json.dumps(dict(table="fit", **fit))  # the sweep writes it with its rows


def test_recorded_rows_take_their_figures_and_where_their_copies_ran(tmp_path):
  rows, figs = _rows({})
  recorded = [dict(r, figures={k: v for k, v in dataclasses.asdict(f).items()
                               if k not in ("publish_on_sms", "pulls_on_sms")})  # figures of before the fields
              for r, f in zip(rows, figs)]
  path = tmp_path / "sweep.json"
  path.write_text(json.dumps({"meta": {"device": "NVIDIA H200"}, "rows": recorded + [{"table": "fit"}]}))
  got_rows, got_figs = sweep._recorded([str(path)])
  assert len(got_rows) == len(rows) and got_figs == figs  # loopback on an NVIDIA GPU: every copy on the SMs
  path.write_text(json.dumps({"meta": {"device": "AMD Instinct MI300X"}, "rows": recorded}))
  assert not any(f.pulls_on_sms or f.publish_on_sms for f in sweep._recorded([str(path)])[1])
