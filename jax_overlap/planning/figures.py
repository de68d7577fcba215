"""Figures measured on this machine's GPUs: what the cost models know of a call.

GEMM and reduction times are taken once per shape at the first lowering that needs them, with the algorithm tuning
chooses (tuning.py). Copy rates are measured when initialize() maps the peers; before that the link is guessed from
the local copy rate (LINK_GUESS_FRACTION). Only process 0 measures and every process decides with its figures
(processes.agree), so noise cannot make processes decide differently. A failed measurement raises SetupError on
every process and is not retried in this runtime generation.
"""

from __future__ import annotations

import dataclasses

from jax_overlap.planning import pipelined, tuning
from jax_overlap.quantization import formats
from jax_overlap.runtime import backend, processes, workspace

LINK_GUESS_FRACTION = 0.25
# A GPU idle before a timing runs its first tens of milliseconds on higher clocks than a training step's sustained
# load: without this warm-up the model predicted the loopback schedule 10-17% short (docs/performance.md).
GEMM_WARMUP_MS = 300.0
_LOCAL_COPY_PROBE_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class Figures:
  """Times in us, rates in bytes per us."""

  gemm_us: tuple  # [s - 1]: the vendor GEMM over s chunks' rows
  chunk_bytes: int  # one chunk a rank receives
  link_bytes_per_us: float
  local_bytes_per_us: float
  reduce_us: float | None = None
  # [s - 1]: a stage's GEMMs where they are not one GEMM over its rows (one per shard's scale); None: gemm_us.
  stage_gemm_us: tuple | None = None
  stage_overhead_us: float = pipelined.STAGE_OVERHEAD_US
  call_overhead_us: float = pipelined.CALL_OVERHEAD_US
  sm_pull_hidden: float = pipelined.SM_PULL_HIDDEN
  # Copies on the SMs take the GEMMs' SMs instead of overlapping with them.
  publish_on_sms: bool = False
  pulls_on_sms: bool = False


def in_loopback(f: Figures) -> Figures:
  """f for the benchmarks' one-GPU loopback, whose stand-in pulls are copies within this GPU."""
  return dataclasses.replace(f, link_bytes_per_us=f.local_bytes_per_us, pulls_on_sms=f.publish_on_sms)


def _native():
  return backend.current().native


def _local_copy_bytes_per_us() -> float:
  probe = _LOCAL_COPY_PROBE_BYTES
  return processes.agree("local_copy", lambda: probe / _native().time_copy(workspace.first_ordinal(), 0, probe))


def gemm_us(dtype_name: str, chunk_rows: int, world: int, n: int, k: int, w_kmajor: bool,
            types: tuple | None = None, scaling=None) -> tuple:
  """The vendor GEMM's us over s chunks of `chunk_rows` rows, s = 1 .. world. types: (w, out) where they are not
  x's dtype (float8; float16 x writing float32 partials)."""
  rows = [chunk_rows * s for s in range(1, world + 1)]
  unshared = scaling if scaling is None else scaling.sharing_x(False)  # the same GEMMs either way
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
  """The figures for one call of `op` (an Op, ops/op.py); SetupError when a measurement failed. A reducing op
  moves partials in formats.partial of the output dtype; a float8 gather runs one GEMM per shard (its own x
  scale) unless the shards share one, and block scales one GEMM per chunk."""
  blocks = scaling is not None and scaling.blocks
  link, local = workspace.link_bytes_per_us(), workspace.local_bytes_per_us()
  if link is None:
    local = _local_copy_bytes_per_us()
    link = LINK_GUESS_FRACTION * local
  publish_on_sms, pulls_on_sms = workspace.copies_on_sms()
  out_dtype = dtype_name if types is None else types[1]
  chunk_rows = op.planning.chunk_rows(rows, world)
  moved = formats.name(formats.partial(out_dtype)) if op.planning.reduces else dtype_name
  # A reduction's GEMMs write its partials: float32 ones for a float16 result.
  gemm_types = (dtype_name, moved) if types is None and moved != dtype_name and op.planning.reduces else types
  gemm = gemm_us(dtype_name, chunk_rows, world, n, k, w_kmajor, gemm_types, scaling)
  per_shard = (types is not None and not op.planning.reduces and not (scaling is not None and scaling.x_shared)) or blocks
  return Figures(gemm_us=gemm, chunk_bytes=op.planning.chunk_bytes(rows, k, n, world, formats.itemsize(moved)),
                 link_bytes_per_us=link, local_bytes_per_us=local,
                 reduce_us=reduce_us(out_dtype, chunk_rows, world, n) if op.planning.reduces else None,
                 stage_gemm_us=tuple(s * gemm[0] for s in range(1, world + 1)) if per_shard else None,
                 publish_on_sms=publish_on_sms, pulls_on_sms=pulls_on_sms)
