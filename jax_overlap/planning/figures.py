"""Figures measured on this machine's GPUs: what the cost models know of a call (planning/pipelined.py, fused.py).

- GEMM times: the vendor GEMM (what the pipelined algorithm runs, and close to
  what XLA's dot runs) timed at the rows each number of chunks of a call
  covers, once per shape and dtype, at the first lowering that needs them,
  after a warm-up (GEMM_WARMUP_MS) that puts the GPU on its sustained clocks,
  each with the algorithm tuning chooses for it (planning/tuning.py), as the
  calls run it.
- The reduction of an op that reduces (matmul_rs): its kernel timed on one
  block of each rank count and shape, once, like the GEMMs.
- The peer link and the local copy rate: copy-engine copies timed when
  initialize() maps the peers (workspace._measure_copies), and whether the
  copies run on the SMs (workspace.copies_on_sms). Before that, the
  decision whether to set the workspace up at all guesses the link at a
  quarter of the local copy rate (H200: about 0.5 of 2 TB/s, near NVLink's
  450 GB/s per direction; MI300X: about 0.4 TB/s, near its 7 xGMI links): the
  measurement then replaces the guess, and the call may still take the XLA path.

With several processes, every process decides with process 0's figures
(processes.agree): only process 0 measures, and timings that differ from
process to process (noise, one GPU busier) cannot make them decide differently.
A measurement that fails (out of memory for its buffers, no vendor BLAS)
raises SetupError on every process, and `auto` takes the XLA path; it is not
retried in this runtime generation.
"""

from __future__ import annotations

import dataclasses

from jax_overlap.planning import pipelined, tuning
from jax_overlap.quantization import formats
from jax_overlap.runtime import backend, processes, workspace

LINK_GUESS_FRACTION = 0.25
# GEMMs run back to back for this long before the GEMM times are taken: a GPU idle before a timing
# runs its first tens of milliseconds on higher clocks than under a training step's sustained load.
# Measured on the H200 (git show 6a98e4b:benchmarks/results/pipelined_2026-12-01_f83e693.json): without it the model
# predicted the loopback schedule 10-17% short; after 300 ms (or 1000) within -4% to +2%.
GEMM_WARMUP_MS = 300.0
# Bytes the copy rate within a GPU is timed over before any workspace exists (between temporary buffers).
_LOCAL_COPY_PROBE_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class Figures:
  """What the models know of one call on this machine (times in us, rates in bytes per us)."""

  gemm_us: tuple  # gemm_us[s - 1]: the vendor GEMM over s chunks' rows, s = 1 .. world
  chunk_bytes: int  # bytes of one chunk a rank receives (ag_matmul: a shard of x; matmul_rs: a block of partials)
  link_bytes_per_us: float  # a copy-engine pull from a peer
  local_bytes_per_us: float  # a copy-engine copy within this GPU
  reduce_us: float | None = None  # the reduction of world blocks into one (None: from the local copy rate)
  # stage_gemm_us[s - 1]: what a stage of s chunks spends in GEMMs where that is not one GEMM over their rows
  # (a float8 call that gathers x: one GEMM per shard, each with its rank's scale); None: gemm_us.
  stage_gemm_us: tuple | None = None
  # The schedule's fixed costs (planning/pipelined.py): a stage's wait and launch, a call's fork, join and trailing
  # kernel; and the share of a pull on the SMs the GEMMs hide. benchmarks/bench_model_sweep.py fits them to loopback
  # runs.
  stage_overhead_us: float = pipelined.STAGE_OVERHEAD_US
  call_overhead_us: float = pipelined.CALL_OVERHEAD_US
  sm_pull_hidden: float = pipelined.SM_PULL_HIDDEN
  # Whether the copy of x into its published slot (within this GPU) and the pulls run on the SMs
  # (workspace.copies_on_sms), where they take the GEMMs' SMs instead of overlapping with the GEMMs.
  publish_on_sms: bool = False
  pulls_on_sms: bool = False


def in_loopback(f: Figures) -> Figures:
  """f for the one-GPU loopback of the benchmarks (csrc/pipelined/measure.h): its stand-in pulls are copies within
  this GPU, at its local copy rate and where such a copy runs."""
  return dataclasses.replace(f, link_bytes_per_us=f.local_bytes_per_us, pulls_on_sms=f.publish_on_sms)


def _native():
  return backend.current().native


def _local_copy_bytes_per_us() -> float:
  """A copy-engine copy within this GPU, before any workspace exists."""
  probe = _LOCAL_COPY_PROBE_BYTES
  return processes.agree("local_copy", lambda: probe / _native().time_copy(workspace.first_ordinal(), 0, probe))


def gemm_us(dtype_name: str, chunk_rows: int, world: int, n: int, k: int, w_kmajor: bool,
            types: tuple | None = None, scaling=None) -> tuple:
  """The vendor GEMM's time (us) over s chunks of `chunk_rows` rows, s = 1 .. world. types: a float8 call's
  (w dtype, out dtype), its x of dtype_name, and scaling its scales' Scaling."""
  rows = [chunk_rows * s for s in range(1, world + 1)]
  unshared = scaling if scaling is None else scaling.sharing_x(False)  # the same GEMMs either way: one figure
  name = dtype_name if types is None else f"{dtype_name}x{types[0]}->{types[1]}/{unshared}"
  extra = {} if types is None else {"w_dtype": types[0], "out_dtype": types[1]}
  if scaling is not None and scaling.blocks:
    extra["blocks"] = True
  if scaling is not None and scaling.fast_accumulation:
    extra["fast_accumulation"] = True
  return tuple(processes.agree(f"gemm/{name}/{chunk_rows}x{world}/{n}/{k}/{int(w_kmajor)}", lambda: list(
      _native().time_gemms(workspace.first_ordinal(), dtype_name, rows, n, k, w_kmajor, warmup_ms=GEMM_WARMUP_MS,
                           **extra, **tuning.options()))))


def reduce_us(dtype_name: str, block_rows: int, world: int, n: int) -> float:
  """The reduction (us) of `world` partials of [block_rows, n] (in formats.partial(dtype_name)) into one of
  `dtype_name`."""
  return processes.agree(f"reduce/{dtype_name}/{block_rows}x{world}/{n}", lambda: _native().time_reduce(
      workspace.first_ordinal(), dtype_name, world, block_rows, n))


def measure(op, dtype_name: str, rows: int, k: int, n: int, world: int, w_kmajor: bool,
            types: tuple | None = None, scaling=None) -> Figures:
  """The figures for one call of `op` (an op module, ops/) with x of `dtype_name` (types: a float8 call's
  (w dtype, out dtype); None: x's dtype throughout; scaling: a float8 call's Scaling): measured link and copy rates
  once the workspace exists, else the local copy rate and the link guessed from it (see the module docstring).
  SetupError when a measurement failed.

  An op that reduces moves partial products (formats.partial of the output's dtype) and reduces them; one that
  gathers moves x, and with float8 x one GEMM per shard (each shard's own x scale) unless the shards share one
  (scaling.x_shared); with block scales either op runs one GEMM per chunk (its scales contiguous)."""
  blocks = scaling is not None and scaling.blocks
  link, local = workspace.link_bytes_per_us(), workspace.local_bytes_per_us()
  if link is None:
    local = _local_copy_bytes_per_us()
    link = LINK_GUESS_FRACTION * local
  publish_on_sms, pulls_on_sms = workspace.copies_on_sms()
  out_dtype = dtype_name if types is None else types[1]
  chunk_rows = op.chunk_rows(rows, world)
  gemm = gemm_us(dtype_name, chunk_rows, world, n, k, w_kmajor, types, scaling)
  moved = formats.name(formats.partial(out_dtype)) if op.REDUCES else dtype_name
  per_shard = (types is not None and not op.REDUCES and not (scaling is not None and scaling.x_shared)) or blocks
  return Figures(gemm_us=gemm, chunk_bytes=op.chunk_bytes(rows, k, n, world, formats.itemsize(moved)),
                 link_bytes_per_us=link, local_bytes_per_us=local,
                 reduce_us=reduce_us(out_dtype, chunk_rows, world, n) if op.REDUCES else None,
                 stage_gemm_us=tuple(s * gemm[0] for s in range(1, world + 1)) if per_shard else None,
                 publish_on_sms=publish_on_sms, pulls_on_sms=pulls_on_sms)
