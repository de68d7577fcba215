"""The float8 features under the shardings a fuzz found failing (issue #38), one named test each, against the float64
reference of the same quantized computation (fp8_reference.py); the controls the issue named, which worked before,
ride along.

  1. block scales whose block dim propagation shards over more devices than it has blocks (a sub-axis: the
     custom partitioning could not decode it, IndivisibleError / KeyError at compile time)
  2. the fp8 layers on Explicit meshes (reshapes JAX could not type: ShardingTypeError)
  3. an amax below the format's max * 2^-126 (its scale became 1 and everything quantized to zero): also
     tests/test_numerics.py
  4. block scales laid out unlike their operand on an Explicit mesh with algorithm="xla" (also under
     jax.set_mesh)
  5. XLA's "Involuntary full rematerialization" of a call's result (values right, time lost)
"""

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap
from fp8_reference import B, E4M3, E5M2, blocks_q, check, layer_reference, mesh_of, scale_of, vjp
from jax_overlap.quantization import numerics

DN = (((2,), (0,)), ((), ()))


def blocky(rng, shape, axis=-1):
  """Normal values whose magnitude changes by powers of ten from one 128-block of `axis` to the next."""
  a = rng.standard_normal(shape).astype(np.float32)
  exps = np.arange(shape[axis] // B) % 4 - 2
  f = np.repeat(10.0 ** exps, B).reshape([-1 if d == axis % len(shape) else 1 for d in range(len(shape))])
  return (a * f).astype(np.float32)


def tiny(rng, shape, top):
  """Magnitudes in [top / 2, top], random signs: tiny values that stay float32 normals (XLA on CPU flushes
  subnormal inputs to zero)."""
  return (rng.choice([-1.0, 1.0], shape) * rng.uniform(0.5, 1, shape) * top).astype(np.float32)


def run_layer(target, scaling, mesh, x, w, ct, specs, assert_close, algorithm="auto", out_sharding=None,
              forward_only=False):
  """The layer's (y[, dx, dW]) on global arrays laid out by specs (x, w, ct), against the float64 reference."""
  layer = getattr(jax_overlap, target)(algorithm=algorithm, scaling=scaling)
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w, ct), specs)]
  f = lambda x, w: layer(x, w, DN, out_sharding=out_sharding)
  want = layer_reference(target, scaling, x, w, ct)
  terms = (x.shape[-1], w.shape[-1], math.prod(x.shape[:-1]))
  if forward_only:
    check(jax.jit(f)(*args[:2]), want[0], terms[0], "value", assert_close)
    return
  got = jax.jit(lambda x, w, ct: vjp(f, x, w, ct))(*args)
  for name, g, r, k in zip(("value", "dx", "dW"), got, want, terms):
    check(g, r, k, name, assert_close)


# --- 1. block scales on sub-axes --------------------------------------------------------------------------------

@pytest.mark.parametrize("rows", [(1, 256), (2, 128)], ids=["1_256_rows_issue", "2_128_rows_control"])
def test_1a_block_ag_gradient_rows_and_kernel_columns_on_tp(rows, rng, make_mesh, assert_close):
  """x rows on tp, the kernel's columns on tp (4 devices, Auto): the weight gradient has 2 row blocks."""
  x, w, ct = blocky(rng, (*rows, 128)), blocky(rng, (128, 512), 0) / 12, blocky(rng, (*rows, 512))
  run_layer("Fp8AgDotGeneral", "block", make_mesh((4,), ("tp",)), x, w, ct,
            (P(None, "tp", None), P(None, "tp"), P(None, None, "tp")), assert_close)


def test_1b_block_rs_gradient_k_on_tp(rng, make_mesh, assert_close):
  """x's K and the kernel's rows on tp, the output's rows asked on tp (the README's pattern)."""
  mesh = make_mesh((4,), ("tp",))
  x, w, ct = blocky(rng, (1, 256, 512)), blocky(rng, (512, 256), 1) / 24, blocky(rng, (1, 256, 256))
  rows = P(None, "tp", None)
  run_layer("Fp8RsDotGeneral", "block", mesh, x, w, ct, (P(None, None, "tp"), P("tp", None), rows), assert_close,
            out_sharding=NamedSharding(mesh, rows))


def test_1c_block_rs_cotangent_n_on_tp(rng, make_mesh, assert_close):
  """The cotangent's N (256: 2 blocks) sharded on an axis of 4."""
  x, w, ct = blocky(rng, (1, 256, 512)), blocky(rng, (512, 256), 1) / 24, blocky(rng, (1, 256, 256))
  run_layer("Fp8RsDotGeneral", "block", make_mesh((4,), ("tp",)), x, w, ct,
            (P(None, None, "tp"), P("tp", None), P(None, None, "tp")), assert_close)


@pytest.mark.parametrize("n", [256, 1024], ids=["n256_issue", "n1024_control"])
def test_1d_matmul_rs_scales_computed_in_jit_from_w_sharded_8_ways(n, rng, make_mesh, assert_close):
  mesh = make_mesh((8,), ("tp",))
  x, w = blocky(rng, (256, 256)), blocky(rng, (256, n), 0) / 16

  @jax.jit
  def f(x, w):
    x8, xs = numerics.block_scaling(x, jnp.float8_e4m3fn)
    w8, ws = numerics.tile_scaling(w, jnp.float8_e4m3fn)
    return jax_overlap.matmul_rs(x8, w8, x_scale=xs, w_scale=ws, out_dtype=jnp.float32)

  got = f(jax.device_put(x, NamedSharding(mesh, P())), jax.device_put(w, NamedSharding(mesh, P(None, "tp"))))
  check(got, blocks_q(x, E4M3, 1) @ blocks_q(w, E4M3, B), 256, "value", assert_close)


# --- 2. the layers on Explicit meshes ----------------------------------------------------------------------------

CASES_2 = {
    # (a) tensor scaling, x rows on the axis, the kernel replicated
    "2a_tensor_rs_gradient": ("Fp8RsDotGeneral", "tensor", "auto", ((2, 16, 64), (64, 32), (2, 16, 32)),
                              (P(None, "tp", None), P(), P(None, "tp", None)), False),
    # (b) algorithm="xla", x's rows and the kernel's columns on the axis
    "2b_tensor_ag_xla_gradient": ("Fp8AgDotGeneral", "tensor", "xla", ((2, 16, 64), (64, 32), (2, 16, 32)),
                                  (P(None, "tp", None), P(None, "tp"), P(None, None, "tp")), False),
    # (c) block scales, x's K and the kernel's K on the axis: the forward
    "2c_block_rs_forward": ("Fp8RsDotGeneral", "block", "auto", ((2, 64, 512), (512, 256), (2, 64, 256)),
                            (P(None, None, "tp"), P("tp", None), P()), True),
    # (d) block scales, the kernel's columns on the axis: the gradient
    "2d_block_ag_gradient": ("Fp8AgDotGeneral", "block", "auto", ((2, 64, 256), (256, 512), (2, 64, 512)),
                             (P(), P(None, "tp"), P(None, None, "tp")), False),
}


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"], ids=["Explicit_issue", "Auto_control"])
@pytest.mark.parametrize("name", list(CASES_2))
def test_2_layers_on_explicit_meshes(name, axis_type, rng, assert_close):
  target, scaling, algorithm, shapes, specs, forward_only = CASES_2[name]
  mesh = mesh_of((4,), ("tp",), axis_type == "Explicit")
  if scaling == "block":
    contract_axis = 0 if target == "Fp8AgDotGeneral" else 1
    x, w, ct = blocky(rng, shapes[0]), blocky(rng, shapes[1], contract_axis) / 24, blocky(rng, shapes[2])
  else:
    x, w, ct = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    w = w / 8
  run_layer(target, scaling, mesh, x, w, ct, specs, assert_close, algorithm=algorithm, forward_only=forward_only)


# --- 3. tiny tensors ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,amax", [(E4M3, 4e-36), (E4M3, 1e-37), (E5M2, 5e-34), (E5M2, 1e-36), (E4M3, 1e-30)])
def test_3_scale_of_a_tiny_amax_is_the_documented_power_of_two(fmt, amax):
  got = float(jax.jit(lambda a: numerics.fp8_scale(a, fmt))(jnp.float32(amax)))
  assert got == float(scale_of(np.float32(amax), fmt))


@pytest.mark.parametrize("tiny_operand,scaling", [("x", "tensor"), ("cotangent", "tensor"), ("x", "block")])
@pytest.mark.parametrize("target", ["Fp8AgDotGeneral", "Fp8RsDotGeneral"])
def test_3_layers_keep_tiny_values(target, tiny_operand, scaling, rng, make_mesh, assert_close):
  """x of amax 4e-36 (below e4m3's max * 2^-126) or a cotangent of 5e-34 (below e5m2's): y, dx and dW are theirs,
  not zero (a layer output of 0 instead of 2.7e-36 before)."""
  k, n = (64, 32) if scaling == "tensor" else (128, 256)
  x = tiny(rng, (2, 64, k), 4e-36) if tiny_operand == "x" else rng.standard_normal((2, 64, k)).astype(np.float32)
  w = (rng.standard_normal((k, n)) / 8).astype(np.float32)
  ct = tiny(rng, (2, 64, n), 5e-34) if tiny_operand == "cotangent" else rng.standard_normal((2, 64, n)).astype(
      np.float32)
  specs = ((P(None, "tp", None), P(None, "tp"), P(None, None, "tp")) if target == "Fp8AgDotGeneral" else
           (P(None, None, "tp"), P("tp", None), P(None, "tp", None)))
  run_layer(target, scaling, make_mesh((4,), ("tp",)), x, w, ct, specs, assert_close)


# --- 4. block scales laid out unlike their operand ---------------------------------------------------------------

@pytest.mark.parametrize("context", ["none", "set_mesh"])
@pytest.mark.parametrize("algorithm", ["xla", "auto"])
@pytest.mark.parametrize("op,x_scale_spec", [("matmul_rs", P("tp", None)), ("ag_matmul", P(None, "tp")),
                                             ("matmul_rs", P(None, "tp")), ("ag_matmul", P("tp", None))],
                         ids=["matmul_rs_unlike_x", "ag_matmul_unlike_x", "matmul_rs_like_x", "ag_matmul_like_x"])
def test_4_block_scales_laid_out_unlike_their_operand_on_explicit_meshes(op, x_scale_spec, algorithm, context, rng,
                                                                          assert_close):
  """Also under jax.set_mesh, where jnp.repeat of the scales to their blocks needs its result's layout."""
  mesh = mesh_of((4,), ("tp",), True)
  with jax.set_mesh(mesh) if context == "set_mesh" else contextlib.nullcontext():
    _check_block_scales_unlike_operand(op, x_scale_spec, algorithm, mesh, rng, assert_close)


def _check_block_scales_unlike_operand(op, x_scale_spec, algorithm, mesh, rng, assert_close):
  x, w = blocky(rng, (64, 512)), blocky(rng, (512, 512), 1) / 24
  x8, xs = (np.asarray(a) for a in numerics.block_scaling(jnp.asarray(x), jnp.float8_e4m3fn))
  w8, ws = (np.asarray(a) for a in numerics.tile_scaling(jnp.asarray(w), jnp.float8_e4m3fn))
  # matmul_rs: x's K and w's K on the axis; ag_matmul: x's rows and w's N
  x_spec, w_spec = (P(None, "tp"), P("tp", None)) if op == "matmul_rs" else (P("tp", None), P(None, "tp"))
  args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x8, w8, xs, ws),
                                                                     (x_spec, w_spec, x_scale_spec, w_spec))]
  fn = getattr(jax_overlap, op)
  got = jax.jit(lambda x8, w8, xs, ws: fn(x8, w8, x_scale=xs, w_scale=ws, out_dtype=jnp.float32,
                                          algorithm=algorithm))(*args)
  check(got, blocks_q(x, E4M3, 1) @ blocks_q(w, E4M3, B), 512, "value", assert_close)


# --- 5. no result resharded by replication -----------------------------------------------------------------------

INVOLUNTARY = "Involuntary full rematerialization"


@pytest.mark.parametrize("op,x_spec,w_spec", [
    ("matmul_rs", P(("dp", "tp")), P(None, "dp")),  # the issue's: the plan kept x's rows, propagation w's columns
    ("matmul_rs", P(("tp", "dp")), P(None, "tp")),
    ("ag_matmul", P(("dp", "tp")), P(None, "dp")),
    ("ag_matmul", P("dp"), P("tp")),  # the gathered x's K took w's K sharding in propagation, which no plan gives
    ("ag_matmul", P("dp", "tp"), P()),
], ids=["rs_rows_dp_tp", "rs_rows_tp_dp", "ag_rows_dp_tp", "ag_k_on_tp", "ag_x_k_on_tp"])
def test_5_float8_calls_on_a_2x4_mesh_reshard_nothing_by_replication(op, x_spec, w_spec, rng, make_mesh, capfd):
  mesh = make_mesh((2, 4), ("dp", "tp"))
  x = rng.standard_normal((8, 64)).astype(jnp.float8_e4m3fn)
  w = rng.standard_normal((64, 64)).astype(jnp.float8_e4m3fn)
  fn = getattr(jax_overlap, op)
  f = jax.jit(lambda x, w: fn(x, w, x_scale=jnp.float32(0.5), w_scale=jnp.float32(0.25), out_dtype=jnp.float32))
  args = (jax.device_put(x, NamedSharding(mesh, x_spec)), jax.device_put(w, NamedSharding(mesh, w_spec)))
  capfd.readouterr()
  compiled = f.lower(*args).compile()
  err = capfd.readouterr().err
  assert INVOLUNTARY not in err, err[err.index(INVOLUNTARY) - 200:][:1200]
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64) * 0.125
  np.testing.assert_allclose(np.asarray(compiled(*args)), want, rtol=1e-5, atol=1e-5 * np.max(np.abs(want)))
