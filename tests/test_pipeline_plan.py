"""The pipelined algorithm's stage planner and cost model (planning/pipelined.py, each op's pipelined_us), with no
GPU."""

import dataclasses
import math

import pytest

from jax_overlap import planning
from jax_overlap.ops import OPS, ag_matmul, matmul_rs
from jax_overlap.planning import pipelined as pp
from jax_overlap.planning.figures import Figures


def figures(world, gemm_whole_us=1000.0, chunk_penalty=1.05, chunk_bytes=32 << 20, link=3.7e5, local=2e6):
  """A GEMM of `gemm_whole_us` over all chunks, each smaller GEMM `chunk_penalty` slower per row."""
  gemm = tuple(gemm_whole_us * s / world * (chunk_penalty if s < world else 1.0) for s in range(1, world + 1))
  return Figures(gemm, chunk_bytes, link, local)


@pytest.mark.parametrize("total", [1, 2, 3, 5, 8])
def test_compositions_are_every_split(total):
  splits = list(pp.compositions(total))
  assert len(splits) == 2 ** (total - 1) == len(set(splits))
  assert all(sum(s) == total and min(s) >= 1 for s in splits)


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("world", [2, 4, 8])
def test_plan_covers_the_ring(op, world):
  plan = pp.plan(OPS[op], world, figures(world))
  assert sum(plan.stages) == world and min(plan.stages) >= 1
  if op == "ag_matmul":
    assert plan.stages[0] == 1  # its own shard, at once
  assert plan.est_us == min(OPS[op].planning.pipelined_us(s, figures(world))
                            for s in ((1,) + r if op == "ag_matmul" else r
                                      for r in pp.compositions(world - 1 if op == "ag_matmul" else world)))


def test_matmul_rs_model_takes_the_measured_reduction():
  f = figures(4)
  stages = (1, 1, 1, 1)
  from_copy_rate = 5 * f.chunk_bytes / (2 * f.local_bytes_per_us)  # 4 blocks read, 1 written
  measured = matmul_rs.pipelined_us(stages, dataclasses.replace(f, reduce_us=123.0))
  assert measured - matmul_rs.pipelined_us(stages, f) == pytest.approx(123.0 - from_copy_rate)


@pytest.mark.parametrize("op,text,world,want", [
    ("ag_matmul", "1,3", 4, (1, 3)), ("matmul_rs", "4", 4, (4,)), ("matmul_rs", "2,1,1", 4, (2, 1, 1)),
    ("ag_matmul", "1,1", 4, None), ("matmul_rs", " 1, 7 ", 8, (1, 7))])
def test_pinned_stages_parse_for_their_group_size(op, text, world, want):
  assert pp.parse_stages(text, OPS[op], world) == want


@pytest.mark.parametrize("op,text,why", [("ag_matmul", "2,2", "own shard alone"), ("matmul_rs", "1;3", "commas"),
                                         ("matmul_rs", "0,4", "at least one chunk")])
def test_pinned_stages_that_cannot_be_a_plan_raise(op, text, why):
  with pytest.raises(ValueError, match=why):
    pp.parse_stages(text, OPS[op], 4)


def test_a_pinned_plan_is_modelled_not_replaced():
  f = figures(4)
  plan = pp.plan(matmul_rs.OP, 4, f, (4,))
  assert plan.stages == (4,) and plan.est_us == matmul_rs.pipelined_us((4,), f) and plan.est_xla_us == pp.xla_us(4, f)


def test_ag_matmul_model_by_hand():
  f = Figures(gemm_us=(100.0, 190.0), chunk_bytes=3_000_000, link_bytes_per_us=30_000.0,
                 local_bytes_per_us=1_500_000.0)
  # own shard 0..100; the peer's shard arrives after the publish copy (2 us) and its pull (100 us): 102.
  want = max(100.0, 2.0 + 100.0) + pp.STAGE_OVERHEAD_US + 100.0 + pp.CALL_OVERHEAD_US
  assert ag_matmul.pipelined_us((1, 1), f) == pytest.approx(want)
  assert pp.xla_us(2, f) == pytest.approx(100.0 + 190.0)


def test_matmul_rs_model_by_hand():
  f = Figures(gemm_us=(100.0, 190.0), chunk_bytes=3_000_000, link_bytes_per_us=30_000.0,
                 local_bytes_per_us=1_500_000.0)
  # Two single-block stages, each a stage overhead and 100 us; the peer's partial of my block is ready when the
  # first ends and pulled (100 us) as the second ends; then the reduction of 2 blocks into 1: 3 blocks' bytes at
  # twice the copy rate.
  gemm_end = 2 * (pp.STAGE_OVERHEAD_US + 100.0)
  pulled = pp.STAGE_OVERHEAD_US + 100.0 + pp.STAGE_OVERHEAD_US + 100.0
  want = max(gemm_end, pulled) + 3 * 3_000_000 / (2 * 1_500_000.0) + pp.CALL_OVERHEAD_US
  assert matmul_rs.pipelined_us((1, 1), f) == pytest.approx(want)


def test_ag_matmul_copies_on_the_sms_take_the_gemms_time():
  f = Figures(gemm_us=(100.0, 190.0, 280.0), chunk_bytes=3_000_000, link_bytes_per_us=30_000.0,
              local_bytes_per_us=1_500_000.0)
  overlapped = ag_matmul.pipelined_us((1, 2), f)
  # The publish (2 us) on the SMs: the own shard's GEMM starts after it, the pulls still overlap.
  published = ag_matmul.pipelined_us((1, 2), dataclasses.replace(f, publish_on_sms=True))
  assert published == pytest.approx(max(102.0, 2.0 + 2 * 100.0) + pp.STAGE_OVERHEAD_US + 190.0 + pp.CALL_OVERHEAD_US)
  assert overlapped == pytest.approx(max(100.0, 2.0 + 2 * 100.0) + pp.STAGE_OVERHEAD_US + 190.0 + pp.CALL_OVERHEAD_US)
  # Pulls on the SMs too: each stage's pulls before its GEMM, less the share the last waves hide.
  serial = ag_matmul.pipelined_us((1, 2), dataclasses.replace(f, publish_on_sms=True, pulls_on_sms=True))
  want = 2.0 + 100.0 + (1 - f.sm_pull_hidden) * 2 * 100.0 + pp.STAGE_OVERHEAD_US + 190.0 + pp.CALL_OVERHEAD_US
  assert serial == pytest.approx(want)


def test_matmul_rs_pulls_on_the_sms_follow_its_gemms():
  f = Figures(gemm_us=(100.0, 190.0, 280.0), chunk_bytes=3_000_000, link_bytes_per_us=30_000.0,
              local_bytes_per_us=1_500_000.0, reduce_us=7.0, pulls_on_sms=True)
  gemms = 3 * (pp.STAGE_OVERHEAD_US + 100.0)
  want = gemms + (1 - f.sm_pull_hidden) * 2 * 100.0 + 7.0 + pp.CALL_OVERHEAD_US
  assert matmul_rs.pipelined_us((1, 1, 1), f) == pytest.approx(want)
  assert matmul_rs.pipelined_us((1, 1, 1), dataclasses.replace(f, pulls_on_sms=False)) < want


@pytest.mark.parametrize("op, world, chunk_mib", [("ag_matmul", 4, 128), ("ag_matmul", 8, 64), ("matmul_rs", 8, 128)])
def test_copies_on_the_sms_take_away_the_gain_overlap_would_give(op, world, chunk_mib):
  # In loopback (and with every rank on one GPU) the pulls are copies within the GPU, on its SMs: where pulls on
  # copy engines at the same rate would pay, those do not.
  op = OPS[op]
  f = dataclasses.replace(figures(world, chunk_bytes=chunk_mib << 20), publish_on_sms=True)
  loopback = planning.figures.in_loopback(f)
  assert loopback.pulls_on_sms and loopback.link_bytes_per_us == loopback.local_bytes_per_us
  engines = dataclasses.replace(loopback, pulls_on_sms=False)
  assert planning.faster(pp.plan(op, world, engines).est_us, pp.xla_us(world, engines))
  assert not planning.faster(pp.plan(op, world, loopback).est_us, pp.xla_us(world, loopback))


@pytest.mark.parametrize("op", list(OPS))
def test_overlap_pays_when_the_transfer_is_a_fraction_of_the_gemm(op):
  # 8 ranks, 32 MiB per chunk over 370 GB/s: 0.6 ms of transfer next to a 1.2 ms GEMM.
  f = figures(8, gemm_whole_us=1200.0)
  plan = pp.plan(OPS[op], 8, f)
  assert plan.est_us < 0.9 * plan.est_xla_us and planning.faster(plan.est_us, plan.est_xla_us)


@pytest.mark.parametrize("op", list(OPS))
def test_a_free_transfer_leaves_only_the_chunking_cost(op):
  f = figures(8, gemm_whole_us=1200.0, link=1e9, local=1e9)
  plan = pp.plan(OPS[op], 8, f)
  assert not planning.faster(plan.est_us, plan.est_xla_us)
  assert len(plan.stages) <= 3  # few large stages: chunks only cost here


def test_stages_follow_the_data_and_the_chunk_cost():
  # A fast link: everything arrives at once, so one stage for all the peers' shards.
  assert pp.plan(ag_matmul.OP, 8, figures(8, gemm_whole_us=2000.0, link=1e9, local=1e9)).stages == (1, 7)
  # Free chunks, data arriving one shard at a time: many small stages, each close behind its data.
  slow = pp.plan(ag_matmul.OP, 8, figures(8, gemm_whole_us=2000.0, chunk_penalty=1.0, link=1e5))
  assert len(slow.stages) >= 5


def test_gemm_figures_must_cover_every_stage_size():
  with pytest.raises(ValueError, match=r"gemm_us needs 4 entries \(1 \.\. world chunks\), got 3"):
    pp.plan(ag_matmul.OP, 4, Figures((1.0, 2.0, 3.0), 1, 1.0, 1.0))


@pytest.mark.parametrize("args,why", [
    (("ag_matmul", "float32", 64, 64, 64, 2), "dtype float32"),
    (("ag_matmul", "bfloat16", 64, 60, 64, 2), "k=60 and n=64 must be multiples of 8"),
    (("matmul_rs", "bfloat16", 66, 64, 64, 4), "rows=66 not divisible by the group size 4"),
    (("ag_matmul", "bfloat16", 64, 64, 64, 16), "group of 16 ranks"),
    (("ag_matmul", "float16", 0, 64, 64, 2), "empty operand"),
])
def test_eligibility(args, why):
  assert why in _eligible(*args)


def _eligible(op, dtype_name, rows, k, n, world):
  problem = planning.Problem(op, dtype_name, 1, rows, k, n, world, (), False)
  return planning.eligible(problem, OPS[op], "pipelined")


def test_eligible():
  assert planning.MAX_WORLD == 8
  assert _eligible("matmul_rs", "bfloat16", 64, 64, 64, 4) is None


def test_faster_needs_the_margin():
  assert planning.faster(90.0, 100.0) and not planning.faster(96.0, 100.0) and not planning.faster(math.inf, 100.0)


def test_chunk_sizes():
  assert ag_matmul.chunk_rows(2048, 8) == 2048 and matmul_rs.chunk_rows(16384, 8) == 2048
  assert ag_matmul.chunk_bytes(2048, 8192, 3584, 8, 2) == 2048 * 8192 * 2
  assert matmul_rs.chunk_bytes(16384, 3584, 8192, 8, 2) == 2048 * 8192 * 2
