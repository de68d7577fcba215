"""Whether a GPU algorithm can take a call at all, judged before anything is measured (the same on every process),
and which float8 formats this process's GPUs run."""

from __future__ import annotations

from jax_overlap.planning.problem import Problem
from jax_overlap.quantization import formats
from jax_overlap.runtime import workspace

# The kernels' per-rank pointer table (kMaxWorld in csrc/kernels/params.h; a native test checks they agree).

MAX_WORLD = 8


def eligible(problem: Problem, op, algorithm: str) -> str | None:
  """None when `algorithm` ("pipelined" or "fused") can take the call, else why not."""
  if not formats.takes(algorithm, problem.dtype_name):
    return (f"dtype {problem.dtype_name} (the {algorithm} algorithm takes "
            f"{', '.join(formats.dtypes_for(algorithm))})")
  if problem.world > MAX_WORLD:
    return f"group of {problem.world} ranks (at most {MAX_WORLD})"
  vector = formats.vector_elems(problem.dtype_name)
  if problem.k % vector or problem.n % vector:
    return f"k={problem.k} and n={problem.n} must be multiples of {vector} (16-byte rows)"
  if problem.rows == 0 or problem.k == 0 or problem.n == 0:
    return "empty operand"
  partial = formats.partial(problem.out_dtype)
  if algorithm == "fused" and op.planning.reduces and problem.world > 1 and partial != problem.out_dtype:
    return (f"a {problem.out_dtype} result with peers: the fused kernel stages each rank's partial in the result's "
            f"dtype, where a partial past its range is inf while the sum is not (the pipelined algorithm and the XLA "
            f"path stage them in {partial})")
  if problem.scaled and algorithm == "pipelined":
    archs = tuple(sorted({arch for _, arch in workspace.local_gpus()}))
    rows = problem.rows if problem.world == 1 else op.planning.chunk_rows(problem.m, problem.world)
    why = (fp8_declined(problem.dtype_name, problem.w_dtype)
           or problem.scaling.gpu_refused(archs, rows, problem.batch, problem.world))
    if why:
      return why
  return op.planning.eligible(problem.rows, problem.world)


def fp8_declined(*operand_dtypes) -> str | None:
  """Why this process's GPUs cannot run these float8 operands (the dtype and the device), or None (also where no
  operand is float8 or no GPU is known here)."""
  families = {formats.fp8_family(d): formats.name(d) for d in operand_dtypes if formats.is_fp8(d)}
  if not families:
    return None
  for name, arch in workspace.local_gpus():
    for family, dtype_name in families.items():
      if formats.fp8_family_of(arch) != family:
        return (f"{dtype_name} on this device ({name}, {arch}): {family.upper()} float8 formats run on "
                f"{formats.fp8_devices(family)}")
  return None


