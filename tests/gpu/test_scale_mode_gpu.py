"""The GEMM handlers take the scaling mode from the call's attributes, not from the scales' shapes (issue 52.6;
csrc/core/scale_mode.h, ffi/common.cc check_gemm): the vendor GEMM of a group of one, called directly, computes
with tensor scales, and a mode that disagrees with the scales comes back as XLA's error. Which scales each mode
takes, and every refusal's words, are tests/test_native_contracts.py's (check_gemm on a CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jax_overlap as jo
from gpu_util import random, requires_gpu
from jax_overlap.quantization import scaling
from jax_overlap.runtime import backend, native

pytestmark = [pytest.mark.gpu, requires_gpu]

E4M3 = jnp.float8_e4m3fn
M, K, N = 64, 256, 256


def _operands(rng):
  x = jnp.asarray(random(rng, (M, K), E4M3))
  w = jnp.asarray(random(rng, (N, K), E4M3))  # K-major
  return x, w


def _prepared(x, w):
  """A group of one's float8 call through jax: registers the targets and prepares the vendor BLAS."""
  mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
  f = jax.jit(jax.shard_map(
      lambda x, w, sx, sw: jo.matmul_rs(x, w, x_scale=sx, w_scale=sw, axis_name="tp", algorithm="pipelined",
                                        w_kmajor=True),
      mesh=mesh, in_specs=(P(), P(), P(), P()), out_specs=P()))
  return f(x, w, jnp.float32(0.5), jnp.float32(0.25))


def _vendor_gemm(x, w, x_scale, w_scale, mode: int):
  target = backend.current().target("vendor_gemm_no_graph")
  scratch = native.module().pipelined_scratch_bytes("ag_matmul", 1, 1, M, N, 2)
  call = jax.ffi.ffi_call(target, (jax.ShapeDtypeStruct((M, N), jnp.bfloat16),
                                   jax.ShapeDtypeStruct((scratch,), jnp.uint8)))
  y, _ = call(x, w, jnp.zeros((0,), jnp.bfloat16), x_scale, w_scale, w_kmajor=np.int64(1), scaling=np.int64(mode),
              fast_accumulation=np.int64(0))
  return jax.block_until_ready(y)


def test_tensor_mode_computes_with_one_float_each():
  rng = np.random.default_rng(5)
  x, w = _operands(rng)
  want = np.asarray(_prepared(x, w), np.float32)
  got = _vendor_gemm(x, w, jnp.full((1,), 0.5, jnp.float32), jnp.full((1,), 0.25, jnp.float32),
                     scaling.TENSOR.code)
  np.testing.assert_array_equal(np.asarray(got, np.float32), want)


@pytest.mark.parametrize("mode, x_scale, w_scale, said", [
    # A block scale passed as a tensor one: w_scale of 4 floats is not read as block scales.
    (scaling.TENSOR.code, (1,), (2, 2), ["w_scale", "float32 [1] (scaling mode tensor)", "[2, 2]"]),
    # Tensor scales under the block mode: the block scales' counts.
    (scaling.BLOCK.code, (1,), (1,), ["x_scale", "block scales", "scaling mode block"]),
])
def test_the_mode_comes_from_the_attribute(mode, x_scale, w_scale, said):
  rng = np.random.default_rng(6)
  x, w = _operands(rng)
  _prepared(x, w)
  with pytest.raises(Exception) as raised:
    _vendor_gemm(x, w, jnp.full(x_scale, 0.5, jnp.float32), jnp.full(w_scale, 0.25, jnp.float32), mode)
  for words in said:
    assert words in str(raised.value), str(raised.value)
