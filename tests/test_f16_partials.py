"""float16 reductions keep their partials in float32 (issue 52.4): a rank's partial product past float16's 65504
must not become inf when the sum of the partials is in range. The XLA path on 8 CPU devices against float64; the
GPU paths' staging and eligibility through the planner and the lowering (tests/gpu/test_pipelined.py runs them)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap
from jax_overlap import planning
from jax_overlap.ops import OPS
from jax_overlap.ops import matmul_rs as rs_op
from jax_overlap.quantization import formats

from fake_gpu import cuda_text, custom_calls

F16_MAX = 65504.0
TP = 8


def large_partials(rng, m=32, k_local=16, n=48):
  """x [m, TP * k_local] and w [TP * k_local, n] in float16 whose per-rank partials x_r @ w_r exceed 65504 in
  places while their sum stays well inside float16: ranks 2j and 2j + 1 hold nearly opposite large rows of x
  against nearly equal blocks of w, with random data of ordinary size on top."""
  big = rng.choice([-1.0, 1.0], size=(m, k_local)) * rng.uniform(12000, 20000, size=(m, k_local))
  x_blocks, w_blocks = [], []
  for r in range(TP):
    w_r = rng.standard_normal((k_local, n)) if r % 2 == 0 else w_blocks[-1] + 1e-3 * rng.standard_normal((k_local, n))
    x_blocks.append((1 if r % 2 == 0 else -1) * big + rng.standard_normal((m, k_local)))
    w_blocks.append(w_r)
  x = np.concatenate(x_blocks, axis=1).astype(np.float16)
  w = np.concatenate(w_blocks, axis=0).astype(np.float16)
  x64, w64 = x.astype(np.float64), w.astype(np.float64)
  partials = [x64[:, r * k_local:(r + 1) * k_local] @ w64[r * k_local:(r + 1) * k_local] for r in range(TP)]
  total = sum(partials)
  # The data must be the case under test: some partial past float16's range, every sum well inside it.
  assert max(np.abs(p).max() for p in partials) > 1.5 * F16_MAX
  assert np.abs(total).max() < F16_MAX / 4
  return x, w, total


def check_near(got, want):
  got = np.asarray(got, np.float64)
  assert np.isfinite(got).all(), f"{np.count_nonzero(~np.isfinite(got))} non-finite elements"
  # float16 rounds the sum once (2^-11 relative); the float32 sums of partials near 1e5 add a few 1e-2.
  np.testing.assert_allclose(got, want, rtol=2 ** -10, atol=0.1)


def test_shard_map_matmul_rs_in_float16_keeps_large_partials(make_mesh):
  x, w, want = large_partials(np.random.default_rng(0))
  mesh = make_mesh((TP,), ("tp",))
  f = jax.jit(jax.shard_map(lambda a, b: jax_overlap.matmul_rs(a, b, axis_name="tp"), mesh=mesh,
                            in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None)))
  z = f(jnp.asarray(x), jnp.asarray(w))
  assert z.dtype == jnp.float16
  check_near(z, want)


def test_global_matmul_rs_in_float16_keeps_large_partials(make_mesh):
  """On global arrays (the partitioned call: a reduce-scatter plan onto the rows)."""
  x, w, want = large_partials(np.random.default_rng(1))
  mesh = make_mesh((TP,), ("tp",))
  xs = jax.device_put(x, NamedSharding(mesh, P(None, "tp")))
  ws = jax.device_put(w, NamedSharding(mesh, P("tp", None)))
  z = jax.jit(jax_overlap.matmul_rs)(xs, ws)
  check_near(z, want)


def test_all_reduce_in_float16_keeps_large_partials(make_mesh):
  x, w, want = large_partials(np.random.default_rng(2))
  mesh = make_mesh((TP,), ("tp",))
  f = jax.jit(jax.shard_map(lambda a, b: rs_op.reference_all_reduce(a, b, axis_name="tp"), mesh=mesh,
                            in_specs=(P(None, "tp"), P("tp", None)), out_specs=P(), check_vma=False))
  check_near(f(jnp.asarray(x), jnp.asarray(w)), want)


def test_bfloat16_partials_are_still_rounded_to_bfloat16(make_mesh):
  """bfloat16 keeps its documented numerics: each partial rounded to bfloat16, summed in float32, rounded once."""
  rng = np.random.default_rng(3)
  x = rng.standard_normal((16, TP * 32)).astype(jnp.bfloat16)
  w = rng.standard_normal((TP * 32, 24)).astype(jnp.bfloat16)
  mesh = make_mesh((TP,), ("tp",))
  f = jax.jit(jax.shard_map(lambda a, b: jax_overlap.matmul_rs(a, b, axis_name="tp", algorithm="xla"), mesh=mesh,
                            in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None)))
  x32, w32 = np.asarray(x, np.float32), np.asarray(w, np.float32)
  partials = [(x32[:, r * 32:(r + 1) * 32] @ w32[r * 32:(r + 1) * 32]).astype(jnp.bfloat16).astype(np.float32)
              for r in range(TP)]
  want = sum(partials[1:], partials[0]).astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(f(x, w), np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("dtype, partial", [("float16", "float32"), ("bfloat16", "bfloat16"),
                                            ("float32", "float32")])
def test_partial_dtype(dtype, partial):
  assert formats.partial(dtype) == np.dtype(partial)


def _problem(out_dtype, world=4, op="matmul_rs"):
  return planning.Problem(op, out_dtype, 1, 4096, 1024, 1024, world, tuple((tuple(range(world)),)), False)


def test_fused_declines_float16_matmul_rs_with_peers_and_says_why():
  why = planning.eligible(_problem("float16"), OPS["matmul_rs"], "fused")
  assert why is not None and "float16" in why and "float32" in why
  assert planning.eligible(_problem("bfloat16"), OPS["matmul_rs"], "fused") is None
  assert planning.eligible(_problem("float16", world=1), OPS["matmul_rs"], "fused") is None


def test_pipelined_float16_matmul_rs_stages_float32_partials(fake_gpu_runtime, make_mesh):
  """The region and the scratch of a float16 call are sized for 4-byte partials: the native sizes take the
  partials' element (csrc/pipelined/schedule.h partial_bytes)."""
  region_calls, scratch_calls = [], []
  region, scratch = fake_gpu_runtime.pipelined_region_bytes, fake_gpu_runtime.pipelined_scratch_bytes
  fake_gpu_runtime.pipelined_region_bytes = lambda *a: region_calls.append(a) or region(*a)
  fake_gpu_runtime.pipelined_scratch_bytes = lambda *a: scratch_calls.append(a) or scratch(*a)
  mesh = make_mesh((4,), ("tp",))
  f = jax.jit(jax.shard_map(lambda a, b: jax_overlap.matmul_rs(a, b, axis_name="tp", algorithm="pipelined"),
                            mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)), out_specs=P("tp", None)))
  x = jax.ShapeDtypeStruct((4096, 4 * 256), jnp.float16)
  w = jax.ShapeDtypeStruct((4 * 256, 512), jnp.float16)
  calls = custom_calls(cuda_text(f, x, w))
  assert len(calls) == 1 and "@jax_overlap_matmul_rs_pipelined(" in calls[0], calls
  assert [c[7] for c in region_calls] == [4], region_calls  # out_bytes: the partials' element
  assert [c[5] for c in scratch_calls] == [4], scratch_calls
