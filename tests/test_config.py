"""config.py: eligibility and launch configuration of the fused kernels, as pure Python (no devices).

Tile shapes and device properties are made up here; only their relations matter.
"""

import dataclasses
import math

import numpy as np
import pytest

from jax_overlap import config, native

TILES = (
    config.TileShape(index=0, bm=128, bn=128, bk=64, threads=256, smem_bytes=65536),
    config.TileShape(index=1, bm=256, bn=128, bk=32, threads=512, smem_bytes=98304),
    config.TileShape(index=2, bm=64, bn=64, bk=32, threads=128, smem_bytes=16384),
)
H100 = config.DeviceProps(sm_count=132, smem_per_block=232448)
MI300X = config.DeviceProps(sm_count=304, smem_per_block=65536)
SHARED_GPU = config.DeviceProps(sm_count=132, smem_per_block=232448, ranks_per_gpu=4)
PLANNERS = {"ag_matmul": config.plan_ag_matmul, "matmul_rs": config.plan_matmul_rs}


def plan(op, *, dtype_name="bfloat16", rows=4096, k=4096, n=4096, world=8, device=H100, tiles=TILES,
         algorithm="auto"):
  return PLANNERS[op](dtype_name=dtype_name, rows=rows, k=k, n=n, world=world, device=device, tiles=tiles,
                      algorithm=algorithm)


def _tile(index):
  return next(t for t in TILES if t.index == index)


# --- eligibility ----------------------------------------------------------------

@pytest.mark.parametrize("op", PLANNERS)
@pytest.mark.parametrize("dtype_name", ["float32", "float64", "int8"])
def test_only_16_bit_dtypes(op, dtype_name):
  p, why = plan(op, dtype_name=dtype_name, algorithm="fused")
  assert p is None and why.startswith(f"dtype {dtype_name}"), why


@pytest.mark.parametrize("op", PLANNERS)
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_16_bit_dtypes_planned(op, dtype_name):
  p, why = plan(op, dtype_name=dtype_name, algorithm="fused")
  assert p is not None and why == "fused"


@pytest.mark.parametrize("op", PLANNERS)
@pytest.mark.parametrize("k,n", [(4100, 4096), (4096, 4092), (12, 8)])
def test_k_and_n_multiples_of_8(op, k, n):
  p, why = plan(op, k=k, n=n, algorithm="fused")
  assert p is None and f"k={k} and n={n} must be multiples of {config.VECTOR_ELEMS}" in why


@pytest.mark.parametrize("op", PLANNERS)
def test_world_above_max(op):
  world = config.MAX_WORLD + 1
  p, why = plan(op, world=world, rows=world * 512, algorithm="fused")
  assert p is None and why == f"group of {world} ranks (at most {config.MAX_WORLD})"


def test_max_world_matches_native():
  if native.module() is None:
    pytest.skip(f"no native extension to compare with ({native.build_info().get('note')})")
  assert config.MAX_WORLD == native.module().MAX_WORLD


@pytest.mark.parametrize("op", PLANNERS)
def test_empty_operand(op):
  p, why = plan(op, rows=0, algorithm="fused")
  assert p is None and why == "empty operand"


def test_matmul_rs_rows_divisible_by_world():
  p, why = plan("matmul_rs", rows=4100, world=8, algorithm="fused")
  assert p is None and why == "rows=4100 not divisible by the group size 8"
  assert plan("ag_matmul", rows=4100, world=8, algorithm="fused")[0] is not None  # ag_matmul has no such rule


@pytest.mark.parametrize("op", PLANNERS)
def test_world_1_auto_declines(op):
  p, why = plan(op, world=1)
  assert p is None and why.startswith("world 1 has no communication to overlap")


@pytest.mark.parametrize("op", PLANNERS)
def test_world_1_fused_forced(op):
  p, why = plan(op, world=1, algorithm="fused")
  assert p is not None and why == "fused" and p.workers == 0


# A GEMM-bound call (little to gather next to a lot of math): the fused kernel's slower GEMM loses.
COMPUTE_BOUND = dict(rows=8192, k=8192, n=16384, world=2)
# A communication-bound call (a thin GEMM next to a large gather or reduction): overlap wins.
COMM_BOUND = {"ag_matmul": dict(rows=8192, k=8192, n=256, world=8),
              "matmul_rs": dict(rows=8192, k=256, n=8192, world=8)}


@pytest.mark.parametrize("op", PLANNERS)
def test_cost_model_declines_compute_bound(op):
  p, why = plan(op, **COMPUTE_BOUND)
  assert p is None and why.startswith("cost model predicts fused"), why


@pytest.mark.parametrize("op", PLANNERS)
def test_fused_forces_a_plan(op):
  p, why = plan(op, **COMPUTE_BOUND, algorithm="fused")
  assert p is not None and why == "fused"
  assert p.est_fused_us >= 0.95 * p.est_xla_us  # the model still says it is slower; the caller asked anyway


@pytest.mark.parametrize("op", PLANNERS)
def test_cost_model_takes_comm_bound(op):
  p, why = plan(op, **COMM_BOUND[op])
  assert p is not None and why == "fused"
  assert p.est_fused_us < 0.95 * p.est_xla_us


# --- the plan's numbers ---------------------------------------------------------

SHAPES = [dict(rows=r, k=k, n=n, world=w) for r, k, n, w in [
    (4096, 4096, 4096, 8), (512, 8192, 1024, 2), (64, 64, 64, 4), (8192, 8200, 256, 8), (16, 131072, 8, 2),
    (1024, 4096, 11008, 4)]]


@pytest.mark.parametrize("device", [H100, MI300X, SHARED_GPU], ids=["sm132", "sm304", "sm132_4ranks"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "r{rows}_k{k}_n{n}_w{world}".format(**s))
def test_chunk_k_is_whole_k_tiles(shape, device):
  p, _ = plan("ag_matmul", **shape, device=device, algorithm="fused")
  bk = _tile(p.tile).bk
  assert p.chunk_k > 0 and p.chunk_k % bk == 0
  # About 8 ready flags along K: never more K tiles per flag than needed to cover K in 8 chunks.
  assert math.ceil(shape["k"] / p.chunk_k) <= 8
  assert p.chunk_k <= max(bk, math.ceil(math.ceil(shape["k"] / bk) / 8) * bk)


@pytest.mark.parametrize("op", PLANNERS)
@pytest.mark.parametrize("device", [H100, MI300X, SHARED_GPU], ids=["sm132", "sm304", "sm132_4ranks"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "r{rows}_k{k}_n{n}_w{world}".format(**s))
def test_workers_bounded(op, shape, device):
  """World > 1: 2 to a quarter of a rank's slots fetchers/reducers, and never more than they have work units
  (ag_matmul: row tiles x K chunks of one shard; matmul_rs: tiles of one row block)."""
  p, _ = plan(op, **shape, device=device, algorithm="fused")
  tile = _tile(p.tile)
  if op == "ag_matmul":
    units = math.ceil(shape["rows"] / tile.bm) * math.ceil(shape["k"] / p.chunk_k)
  else:
    units = math.ceil(shape["rows"] // shape["world"] / tile.bm) * math.ceil(shape["n"] / tile.bn)
  assert min(2, units) <= p.workers <= min(config.gemm_slots(device) // 4, units)


def test_workers_at_least_two_with_work():
  for op in PLANNERS:
    p, _ = plan(op, rows=8192, k=8192, n=8192, world=8, algorithm="fused")
    assert 2 <= p.workers <= config.gemm_slots(H100) // 4


def test_matmul_rs_has_no_chunks():
  p, _ = plan("matmul_rs", algorithm="fused")
  assert p.chunk_k == 0


def test_plan_attribute():
  p = config.FusedPlan(tile=1, workers=6, chunk_k=512, est_fused_us=1.0, est_xla_us=2.0)
  attr = p.attribute()
  assert attr == {"tile": 1, "workers": 6, "chunk_k": 512}
  assert all(isinstance(v, np.int64) for v in attr.values())


def test_gemm_slots():
  assert config.gemm_slots(H100) == 132
  assert config.gemm_slots(SHARED_GPU) == 33
  assert config.gemm_slots(config.DeviceProps(sm_count=2, smem_per_block=1, ranks_per_gpu=8)) == 1


# --- tile choice ----------------------------------------------------------------

WIDE = config.TileShape(index=10, bm=128, bn=64, bk=32, threads=256, smem_bytes=1)
TALL = config.TileShape(index=11, bm=64, bn=128, bk=32, threads=256, smem_bytes=1)
BIG = config.TileShape(index=12, bm=128, bn=128, bk=32, threads=256, smem_bytes=1)
SMALL = config.TileShape(index=13, bm=64, bn=64, bk=32, threads=256, smem_bytes=1)


def test_tile_fewer_waves_at_equal_area():
  # rows=128, n=192, 3 slots: 128x64 covers it in 1x3 = 3 tiles (one wave), 64x128 in 2x2 = 4 (two waves).
  assert config.choose_tile((TALL, WIDE), rows=128, n=192, slots=3) == WIDE
  assert config.choose_tile((WIDE, TALL), rows=192, n=128, slots=3) == TALL


def test_tile_least_quantized_work():
  # 128x128 in 4 slots: the big tile is one tile (one wave, 16384); the small one 4 tiles, one wave, 4096.
  assert config.choose_tile((BIG, SMALL), rows=128, n=128, slots=4) == SMALL
  # Four row groups (the world's blocks): big 4 tiles = 1 wave (16384); small 16 tiles = 4 waves (16384).
  # The tie goes to the bigger tile.
  assert config.choose_tile((SMALL, BIG), rows=128, n=128, slots=4, groups=4) == BIG


@pytest.mark.parametrize("op,rows", [("ag_matmul", 128), ("matmul_rs", 512)])
def test_plan_tiles_every_row_block_of_the_group(op, rows):
  """The output has `world` row blocks of 128 rows (ag: one per rank's x; rs: the world's partial sums).

  6 SMs: 1 worker and 5 GEMM slots. Over 4 blocks, BIG is 4 tiles (one wave, 16384) and SMALL 16 tiles
  (four waves, 16384): a tie, so BIG. Had the plan looked at one block, SMALL would win (4096 vs 16384).
  """
  p, _ = plan(op, rows=rows, k=256, n=128, world=4, device=config.DeviceProps(sm_count=6, smem_per_block=1),
              tiles=(SMALL, BIG), algorithm="fused")
  assert p.workers == 1 and p.tile == BIG.index


@pytest.mark.parametrize("op,rows", [("ag_matmul", 8192), ("matmul_rs", 16384)])
def test_plan_takes_only_tiles_that_fit_shared_memory(op, rows):
  # Shapes where the cost model picks tile 1 (96 KiB of stages) on an H100; with 64 KiB of shared
  # memory per workgroup (MI300X's LDS) it cannot launch, so the plan takes tile 0 instead.
  small_lds = config.DeviceProps(sm_count=132, smem_per_block=65536)
  assert plan(op, rows=rows, device=H100, tiles=(_tile(1), _tile(0)), algorithm="fused")[0].tile == 1
  assert plan(op, rows=rows, device=small_lds, tiles=(_tile(1), _tile(0)), algorithm="fused")[0].tile == 0
  p, why = plan(op, device=small_lds, tiles=(_tile(1),), algorithm="fused")
  assert p is None and why == "no compiled tile fits 65536 bytes of shared memory per workgroup"


def test_tail_slots_only_for_a_partial_wave_of_whole_tiles_one_workgroup_per_sm():
  dev = config.DeviceProps(sm_count=132, smem_per_block=232448)
  big = config.TileShape(index=0, bm=128, bn=256, bk=64, threads=256, smem_bytes=147456, stream_k=True)
  small = config.TileShape(index=1, bm=128, bn=128, bk=32, threads=128, smem_bytes=65536, stream_k=True)

  def slots(tile, rows, n, k=512, device=dev):
    return config.tail_slots(tile, rows, n, k, device)

  assert slots(big, 2048, 3584) == 132  # 224 tiles: 1.7 waves
  assert slots(big, 16384, 3584, 8192) == 132  # 1792 tiles: 13.6 waves
  assert slots(big, 16384, 8192, 3584) == 132  # 4096 tiles: 31.03 waves
  assert slots(big, 128 * 132, 256) == 0  # exactly one wave
  assert slots(big, 128 * 11, 256 * 24) == 0  # 264 tiles: two whole waves
  assert slots(big, 1024, 3584) == 0  # 112 tiles: less than a wave
  assert slots(small, 2048, 3584) == 0  # two workgroups may share an SM: grid unknown here
  # The kernel's tail runs on whole tiles only: rows, n and k multiples of 128, 256 and 64.
  assert slots(big, 2048 - 8, 3584) == slots(big, 2048, 3584 - 8) == slots(big, 2048, 3584, k=520) == 0
  assert slots(big, 2048, 2 ** 18 + 256) == 0  # w's row stride past the fast copies' 32-bit strides
  assert slots(big, 2048, 3584, k=2 ** 18 + 64) == 0  # the same for a transposed w
  half = config.DeviceProps(sm_count=132, smem_per_block=232448, ranks_per_gpu=2)
  assert slots(big, 2048, 3584, device=half) == 66  # a rank's share of the SMs
  assert slots(dataclasses.replace(big, stream_k=False), 2048, 3584) == 0  # a build without the tail (AMD)


@pytest.mark.parametrize("op", PLANNERS)
def test_group_of_one_takes_the_tile_whose_last_wave_its_tail_evens_out(op):
  # The H200's compiled tiles. 16384 x 8192 is 4096 tiles of 128 x 256 on 132 SMs, 31.03 waves:
  # whole waves would cost 32 x 32768, more than the 128 x 128 tile's 63 x 16384; but the large
  # tile's stream-K tail runs them as 31.03, the least work. With peers there is no tail.
  big = config.TileShape(index=0, bm=128, bn=256, bk=64, threads=256, smem_bytes=147456, stream_k=True)
  small = config.TileShape(index=1, bm=128, bn=128, bk=32, threads=128, smem_bytes=65536)
  p, _ = plan(op, rows=16384, k=3584, n=8192, world=1, tiles=(big, small), algorithm="fused")
  assert p.tile == 0
  no_tail = dataclasses.replace(big, stream_k=False)  # e.g. an AMD build: whole waves count again
  assert plan(op, rows=16384, k=3584, n=8192, world=1, tiles=(no_tail, small), algorithm="fused")[0].tile == 1
  assert config.choose_tile((big, small), rows=16384, n=8192, slots=132).index == 1
