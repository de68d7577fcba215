"""planning/fused.py and planning.eligible: eligibility and launch configuration of the fused kernels, as pure
Python (no devices).

Tile shapes and device properties are made up here; only their relations matter. The launch
geometry is C++'s (csrc/kernels/launch.h); the planner tests use a stand-in with one workgroup
per SM, and the C++ figures themselves are checked where the extension is built.
"""

import dataclasses
import math
import re
import types
from pathlib import Path

import numpy as np
import pytest

import native_testing
from jax_overlap import planning
from jax_overlap.runtime import backend, native
from jax_overlap.runtime.backend import DeviceProps, GemmGeometry, TileShape
from jax_overlap.ops import OPS
from jax_overlap.planning import fused

TILES = (
    TileShape(index=0, bm=128, bn=128, bk=64, threads=256, smem_bytes=65536),
    TileShape(index=1, bm=256, bn=128, bk=32, threads=512, smem_bytes=98304),
    TileShape(index=2, bm=64, bn=64, bk=32, threads=128, smem_bytes=16384),
)
H100 = DeviceProps(sm_count=132, smem_per_block=232448)
MI300X = DeviceProps(sm_count=304, smem_per_block=65536)
SHARED_GPU = DeviceProps(sm_count=132, smem_per_block=232448, ranks_per_gpu=4)
PLANNERS = list(OPS)


def stand_in_geometry(op, *, rows, k, n, world, device, per_sm=1):
  """A launch like C++'s for the made-up tiles: per_sm workgroups per SM, tail on a partial wave of whole tiles."""
  def geometry(tile, comm, chunk_k):
    co_resident = per_sm * device.sm_count // device.ranks_per_gpu
    group_rows = rows if op == "ag_matmul" else rows // world
    tiles = math.ceil(group_rows / tile.bm) * math.ceil(n / tile.bn) * world
    grid = min(co_resident, comm + tiles)
    whole = group_rows % tile.bm == 0 and n % tile.bn == 0 and k % tile.bk == 0
    tail = grid if tile.stream_k and world == 1 and whole and tiles > grid and tiles % grid else 0
    return GemmGeometry(per_sm, co_resident, comm, grid, tiles, 1, tail, 0, 0, grid > comm)
  return geometry


def plan(op, *, dtype_name="bfloat16", rows=4096, k=4096, n=4096, world=8, device=H100, tiles=TILES):
  """(plan, "fused") as the planner makes it for an eligible call (planning.eligible), else (None, why not)."""
  why = planning.eligible(planning.Problem(op, dtype_name, 1, rows, k, n, world, (), False), OPS[op], "fused")
  if why:
    return None, why
  geometry = stand_in_geometry(op, rows=rows, k=k, n=n, world=world, device=device)
  return fused.plan(OPS[op], dtype_name=dtype_name, rows=rows, k=k, n=n, world=world, device=device, tiles=tiles,
                    geometry=geometry)


def _tile(index):
  return next(t for t in TILES if t.index == index)


# --- eligibility ----------------------------------------------------------------

@pytest.mark.parametrize("op", PLANNERS)
@pytest.mark.parametrize("dtype_name", ["float32", "float64", "int8"])
def test_only_16_bit_dtypes(op, dtype_name):
  p, why = plan(op, dtype_name=dtype_name)
  assert p is None and why.startswith(f"dtype {dtype_name}"), why


@pytest.mark.parametrize("op", PLANNERS)
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_16_bit_dtypes_planned(op, dtype_name):
  """Except float16 matmul_rs with peers: the kernel stages partials in the output dtype (tests/test_f16_partials.py)."""
  p, why = plan(op, dtype_name=dtype_name)
  if op == "matmul_rs" and dtype_name == "float16":
    assert p is None and "float16 result with peers" in why, why
    p, why = plan(op, dtype_name=dtype_name, world=1)
  assert p is not None and why == "fused"


@pytest.mark.parametrize("op", PLANNERS)
@pytest.mark.parametrize("k,n", [(4100, 4096), (4096, 4092), (12, 8)])
def test_k_and_n_multiples_of_8(op, k, n):
  p, why = plan(op, k=k, n=n)
  assert p is None and f"k={k} and n={n} must be multiples of 8" in why


@pytest.mark.parametrize("op", PLANNERS)
def test_world_above_max(op):
  world = planning.MAX_WORLD + 1
  p, why = plan(op, world=world, rows=world * 512)
  assert p is None and why == f"group of {world} ranks (at most {planning.MAX_WORLD})"


def test_max_world_matches_native():
  if native.module() is None:
    pytest.skip(f"no native extension to compare with ({native.build_info().get('note')})")
  assert planning.MAX_WORLD == native_testing.module().MAX_WORLD


@pytest.mark.parametrize("op", PLANNERS)
def test_empty_operand(op):
  p, why = plan(op, rows=0)
  assert p is None and why == "empty operand"


def test_matmul_rs_rows_divisible_by_world():
  p, why = plan("matmul_rs", rows=4100, world=8)
  assert p is None and why == "rows=4100 not divisible by the group size 8"
  assert plan("ag_matmul", rows=4100, world=8)[0] is not None  # ag_matmul has no such rule


@pytest.mark.parametrize("op", PLANNERS)
def test_world_1_auto_declines(op):
  problem = planning.Problem(op, "bfloat16", 1, 4096, 4096, 4096, 1, (), False)
  with pytest.raises(planning.Declined, match="^a group of one has no communication to overlap"):
    planning.decide(problem, OPS[op], "auto")


@pytest.mark.parametrize("op", PLANNERS)
def test_world_1_fused_forced(op):
  p, why = plan(op, world=1)
  assert p is not None and why == "fused" and p.comm_workgroups == 0


# A GEMM-bound call (little to gather next to a lot of math): the fused kernel's slower GEMM loses.
COMPUTE_BOUND = dict(rows=8192, k=8192, n=16384, world=2)
# A communication-bound call (a thin GEMM next to a large gather or reduction): overlap wins.
COMM_BOUND = {"ag_matmul": dict(rows=8192, k=8192, n=256, world=8),
              "matmul_rs": dict(rows=8192, k=256, n=8192, world=8)}


@pytest.mark.parametrize("op", PLANNERS)
def test_cost_model_declines_compute_bound(op):
  """The plan is made (an explicit "fused" runs it: the caller asked), and auto's margin turns it down."""
  p, why = plan(op, **COMPUTE_BOUND)
  assert p is not None and why == "fused"
  assert p.est_us >= planning.AUTO_MARGIN * p.est_xla_us and not planning.faster(p.est_us, p.est_xla_us)


@pytest.mark.parametrize("op", PLANNERS)
def test_cost_model_takes_comm_bound(op):
  p, why = plan(op, **COMM_BOUND[op])
  assert p is not None and why == "fused"
  assert planning.faster(p.est_us, p.est_xla_us)


# --- the plan's numbers ---------------------------------------------------------

SHAPES = [dict(rows=r, k=k, n=n, world=w) for r, k, n, w in [
    (4096, 4096, 4096, 8), (512, 8192, 1024, 2), (64, 64, 64, 4), (8192, 8200, 256, 8), (16, 131072, 8, 2),
    (1024, 4096, 11008, 4)]]


@pytest.mark.parametrize("device", [H100, MI300X, SHARED_GPU], ids=["sm132", "sm304", "sm132_4ranks"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "r{rows}_k{k}_n{n}_w{world}".format(**s))
def test_chunk_k_is_whole_k_tiles(shape, device):
  p, _ = plan("ag_matmul", **shape, device=device)
  bk = _tile(p.tile).bk
  assert p.chunk_k > 0 and p.chunk_k % bk == 0
  # About 8 ready flags along K: never more K tiles per flag than needed to cover K in 8 chunks.
  assert math.ceil(shape["k"] / p.chunk_k) <= 8
  assert p.chunk_k <= max(bk, math.ceil(math.ceil(shape["k"] / bk) / 8) * bk)


@pytest.mark.parametrize("op", PLANNERS)
@pytest.mark.parametrize("device", [H100, MI300X, SHARED_GPU], ids=["sm132", "sm304", "sm132_4ranks"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "r{rows}_k{k}_n{n}_w{world}".format(**s))
def test_workers_bounded(op, shape, device):
  """World > 1: 2 to a quarter of a rank's co-resident workgroups fetchers/reducers, and never more than they
  have work units (ag_matmul: row tiles x K chunks of one shard; matmul_rs: tiles of one row block)."""
  p, _ = plan(op, **shape, device=device)
  tile = _tile(p.tile)
  if op == "ag_matmul":
    units = math.ceil(shape["rows"] / tile.bm) * math.ceil(shape["k"] / p.chunk_k)
  else:
    units = math.ceil(shape["rows"] // shape["world"] / tile.bm) * math.ceil(shape["n"] / tile.bn)
  co_resident = device.sm_count // device.ranks_per_gpu  # the stand-in's one workgroup per SM
  assert min(2, units) <= p.comm_workgroups <= min(co_resident // 4, units)


def test_comm_workgroups_at_least_two_with_work():
  for op in PLANNERS:
    p, _ = plan(op, rows=8192, k=8192, n=8192, world=8)
    assert 2 <= p.comm_workgroups <= H100.sm_count // 4


def test_matmul_rs_has_no_chunks():
  p, _ = plan("matmul_rs")
  assert p.chunk_k == 0


def test_plan_attribute_names_every_ffi_config_member():
  """FusedPlan.attribute() and csrc/ffi/common.h's struct-attribute decoding of FusedConfig name the same members."""
  p = fused.FusedPlan(tile=1, comm_workgroups=6, chunk_k=512, tail_slots=0, tail_scratch_bytes=0,
                      region_bytes=4096, est_us=1.0, est_xla_us=2.0)
  attr = p.attribute(w_kmajor=True, region_offset=256, site=3, generation=2)
  common_h = (Path(__file__).parents[1] / "csrc" / "ffi" / "common.h").read_text()
  decoding = re.search(r"XLA_FFI_REGISTER_STRUCT_ATTR_DECODING\(::jo::FusedConfig,(.*?)\);", common_h, re.S).group(1)
  assert list(attr) == re.findall(r'StructMember<int64_t>\("(\w+)"\)', decoding)
  assert attr["comm_workgroups"] == 6 and attr["w_kmajor"] == 1 and attr["region_offset"] == 256 and attr["site"] == 3
  assert all(isinstance(v, np.int64) for v in attr.values())


# --- tile choice ----------------------------------------------------------------

WIDE = TileShape(index=10, bm=128, bn=64, bk=32, threads=256, smem_bytes=1)
TALL = TileShape(index=11, bm=64, bn=128, bk=32, threads=256, smem_bytes=1)
BIG = TileShape(index=12, bm=128, bn=128, bk=32, threads=256, smem_bytes=1)
SMALL = TileShape(index=13, bm=64, bn=64, bk=32, threads=256, smem_bytes=1)


def _launch(tile, rows, n, co_resident, groups=1, per_sm=1, tail=False):
  tiles = groups * math.ceil(rows / tile.bm) * math.ceil(n / tile.bn)
  return tile, GemmGeometry(per_sm, co_resident, 0, min(co_resident, tiles), tiles, 1,
                                   co_resident if tail else 0, 0, 0)


def test_tile_fewer_waves_at_equal_area():
  # rows=128, n=192, 3 workgroups: 128x64 covers it in 1x3 = 3 tiles (one wave), 64x128 in 2x2 = 4 (two waves).
  assert fused.choose_tile([_launch(TALL, 128, 192, 3), _launch(WIDE, 128, 192, 3)])[0] == WIDE
  assert fused.choose_tile([_launch(WIDE, 192, 128, 3), _launch(TALL, 192, 128, 3)])[0] == TALL


def test_tile_least_quantized_work():
  # 128x128 in 4 workgroups: the big tile is one tile (one wave, 16384); the small one 4 tiles, one wave, 4096.
  assert fused.choose_tile([_launch(BIG, 128, 128, 4), _launch(SMALL, 128, 128, 4)])[0] == SMALL
  # Four row groups (the world's blocks): big 4 tiles = 1 wave (16384); small 16 tiles = 4 waves (16384).
  # The tie goes to the bigger tile.
  assert fused.choose_tile([_launch(SMALL, 128, 128, 4, 4), _launch(BIG, 128, 128, 4, 4)])[0] == BIG


def test_tile_cost_counts_workgroups_sharing_an_sm():
  # 16384 x 8192 on 132 SMs: the 128x256 tile alone on its SM, 4096 tiles in 31.03 waves evened out by the
  # stream-K tail; the 128x128 tile two to an SM (264 co-resident), 8192 tiles in 32 whole waves of two
  # tiles per SM. Counted with its real grid, the small tile's waves cost an SM twice its area.
  big = TileShape(index=0, bm=128, bn=256, bk=64, threads=256, smem_bytes=147456, stream_k=True)
  small = TileShape(index=1, bm=128, bn=128, bk=32, threads=128, smem_bytes=65536)
  launches = [_launch(big, 16384, 8192, 132, tail=True), _launch(small, 16384, 8192, 264, per_sm=2)]
  assert fused.choose_tile(launches)[0] == big
  no_tail = [_launch(big, 16384, 8192, 132), launches[1]]  # e.g. an AMD build: whole waves count again
  assert fused.choose_tile(no_tail)[0] == big  # 32 x 32768 vs 32 x 16384 x 2: a tie, to the larger tile


@pytest.mark.parametrize("op,rows", [("ag_matmul", 128), ("matmul_rs", 512)])
def test_plan_tiles_every_row_block_of_the_group(op, rows):
  """The output has `world` row blocks of 128 rows (ag: one per rank's x; rs: the world's partial sums).

  6 SMs: 1 comm workgroup and 5 GEMM workgroups. Over 4 blocks, BIG is 4 tiles (one wave, 16384) and SMALL 16
  tiles (four waves, 16384): a tie, so BIG. Had the plan looked at one block, SMALL would win (4096 vs 16384).
  """
  p, _ = plan(op, rows=rows, k=256, n=128, world=4, device=DeviceProps(sm_count=6, smem_per_block=1),
              tiles=(SMALL, BIG))
  assert p.comm_workgroups == 1 and p.tile == BIG.index


@pytest.mark.parametrize("op,rows", [("ag_matmul", 8192), ("matmul_rs", 16384)])
def test_plan_takes_only_tiles_that_fit_shared_memory(op, rows):
  # Shapes where the cost model picks tile 1 (96 KiB of stages) on an H100; with 64 KiB of shared
  # memory per workgroup (MI300X's LDS) it cannot launch, so the plan takes tile 0 instead.
  small_lds = DeviceProps(sm_count=132, smem_per_block=65536)
  assert plan(op, rows=rows, device=H100, tiles=(_tile(1), _tile(0)))[0].tile == 1
  assert plan(op, rows=rows, device=small_lds, tiles=(_tile(1), _tile(0)))[0].tile == 0
  p, why = plan(op, device=small_lds, tiles=(_tile(1),))
  assert p is None and why == "no compiled tile fits 65536 bytes of shared memory per workgroup"


@pytest.mark.parametrize("op", PLANNERS)
def test_group_of_one_plan_carries_the_launch_tail(op):
  big = TileShape(index=0, bm=128, bn=256, bk=64, threads=256, smem_bytes=147456, stream_k=True)
  p, _ = plan(op, rows=2048, k=512, n=3584, world=1, tiles=(big,))
  assert p.tail_slots == 132  # 224 tiles on 132 SMs: a partial second wave
  p, _ = plan(op, rows=2048, k=520, n=3584, world=1, tiles=(big,))
  assert p.tail_slots == 0  # k not whole k-tiles: whole tiles only


def test_tiles_for_arch():
  tiles = (dataclasses.replace(_tile(0), arch="nvidia"), dataclasses.replace(_tile(1), arch="amd"))
  assert backend.tiles_for_arch(tiles) == tiles[:1]  # the build's own: its first tile's
  assert backend.tiles_for_arch(tiles, "amd") == tiles[1:]
  with pytest.raises(ValueError, match="no compiled tiles for ArchTraits 'gfx'"):
    backend.tiles_for_arch(tiles, "gfx")


def test_an_unknown_arch_traits_setting_names_the_variable(monkeypatch):
  tile = dataclasses.asdict(dataclasses.replace(_tile(0), arch="nvidia"))
  compiled = types.SimpleNamespace(tile_shapes=lambda: [tile])
  monkeypatch.setenv("JAX_OVERLAP_ARCH_TRAITS", "gfx")
  with pytest.raises(ValueError, match=r"^jax_overlap: JAX_OVERLAP_ARCH_TRAITS='gfx'; expected one of nvidia, amd$"):
    backend.Backend(compiled, "cuda").tile_shapes()
  monkeypatch.setenv("JAX_OVERLAP_ARCH_TRAITS", "amd")  # a name this build has no tiles of
  with pytest.raises(ValueError, match=r"^jax_overlap: JAX_OVERLAP_ARCH_TRAITS='amd': no compiled tiles for ArchTraits "
                                       r"'amd'; this build has \['nvidia'\]$"):
    backend.Backend(compiled, "cuda").tile_shapes()


# --- the C++ geometry (csrc/kernels/launch.h), where the extension is built --------

needs_native = pytest.mark.skipif(native.module() is None, reason="no native extension (pure-Python install)")
H200 = DeviceProps(sm_count=132, smem_per_block=232448, l2_bytes=60 << 20)


def _geometry(op, tile, comm=0, chunk_k=0, *, world=1, batch=1, m=2048, k=512, n=3584, per_sm=1, device=H200):
  return backend.current().gemm_geometry(op, tile, comm, chunk_k, dtype_name="bfloat16", w_kmajor=False,
                                        world=world, batch=batch, m=m, k=k, n=n, device=device,
                                        workgroups_per_sm=per_sm)


@needs_native
@pytest.mark.parametrize("op", PLANNERS)
def test_native_geometry_grid_is_the_co_resident_workgroups(op):
  tiles = backend.current().tile_shapes()
  big, small = tiles[0], tiles[1]
  g = _geometry(op, small, per_sm=2, m=16384, n=8192)
  assert (g.co_resident, g.grid, g.tiles) == (264, 264, 128 * 64)  # two 4-warp workgroups per SM, all launched
  shared = dataclasses.replace(H200, ranks_per_gpu=4)
  g = _geometry(op, big, 8, per_sm=1, world=4, m=4 * 4096 if op == "matmul_rs" else 4096, device=shared)
  assert (g.co_resident, g.comm_workgroups, g.grid) == (33, 8, 33)  # a rank's share of the SMs
  assert g.region_bytes == 0 if op == "ag_matmul" else g.region_bytes > 0  # ag_matmul's region needs chunk_k


@needs_native
@pytest.mark.parametrize("op", PLANNERS)
def test_native_tail_only_for_a_partial_wave_of_whole_tiles(op):
  big = backend.current().tile_shapes()[0]
  if not big.stream_k:
    pytest.skip("this build's large tile has no stream-K tail (AMD)")
  g = _geometry(op, big)
  assert g.tail_slots == 132 and g.tail_scratch_bytes == native_testing.module().tail_scratch_bytes(0, 132)
  assert _geometry(op, big, m=16384, k=8192).tail_slots == 132  # 1792 tiles: 13.6 waves
  assert _geometry(op, big, m=128 * 132, n=256).tail_slots == 0  # exactly one wave
  assert _geometry(op, big, m=128 * 11, n=256 * 24).tail_slots == 0  # 264 tiles: two whole waves
  assert _geometry(op, big, m=1024).tail_slots == 0  # 112 tiles: less than a wave
  assert _geometry(op, big, m=2040).tail_slots == _geometry(op, big, k=520).tail_slots == 0  # not whole tiles
  assert _geometry(op, big, n=2 ** 18 + 256).tail_slots == 0  # w's row stride past the fast copies' strides
  assert _geometry(op, big, per_sm=1, device=dataclasses.replace(H200, ranks_per_gpu=2)).tail_slots == 66
  assert _geometry(op, backend.current().tile_shapes()[1], per_sm=2).tail_slots == 0  # the 4-warp tile runs whole tiles


@needs_native
def test_native_tiles_list_both_archs_in_a_cuda_build():
  if native.platform() != "cuda":
    pytest.skip("only CUDA builds compile the AMD data path beside their own")
  compiled = backend.current().compiled_tile_shapes()
  assert [t.arch for t in compiled] == ["nvidia", "nvidia", "amd", "amd"]
  assert [(t.bm, t.bn, t.bk) for t in compiled if t.arch == "amd"] == [(256, 128, 64), (128, 128, 32)]
  assert not any(t.stream_k for t in compiled if t.arch == "amd")
  assert backend.current().tile_shapes() == compiled[:2]
