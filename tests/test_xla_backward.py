"""algorithm="xla" is JAX's own derivative of the ops' plain decomposition; its backward pass multiplies 16-bit
operands as stock lax.dot_general's does. (JAX's derivative of a float32-accumulated product rounded to 16 bits
multiplied the float32 cotangent by the 16-bit operand, which XLA ran as float32 GEMMs.)"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap


def dot_operand_types(jitted, *args) -> list[str]:
  """The element types of every dot_general's operands in the lowered module."""
  text = jitted.lower(*args).as_text()
  return [t for line in text.splitlines() if "stablehlo.dot_general" in line
          for t in re.findall(r"tensor<[\dx]*x?(\w+)>", line.split(":")[-1].split("->")[0])]


MLIR_TYPE = {"bfloat16": "bf16", "float16": "f16"}


@pytest.mark.parametrize("dtype", sorted(MLIR_TYPE))
@pytest.mark.parametrize("op, specs, out_spec", [("ag_matmul", (P("tp", None), P(None, "tp"), P("tp")), P(None, "tp")),
                                                 ("matmul_rs", (P(None, "tp"), P("tp", None), P()), P("tp", None))])
@pytest.mark.parametrize("inside_shard_map", [False, True], ids=["global", "shard_map"])
def test_xla_backward_multiplies_16_bit_operands(op, specs, out_spec, dtype, inside_shard_map, make_mesh, normal,
                                                 assert_close):
  mesh = make_mesh((4,), ("tp",))
  x, w, b = normal((24, 40), dtype), normal((40, 36), dtype), normal((36,), dtype)
  fn = getattr(jax_overlap, op)
  if inside_shard_map:
    fn = jax.shard_map(lambda x, w, b: getattr(jax_overlap, op)(x, w, b, axis_name="tp", algorithm="xla"),
                       mesh=mesh, in_specs=specs, out_specs=out_spec)
    args = (x, w, b)
  else:
    fn = lambda x, w, b: getattr(jax_overlap, op)(x, w, b, algorithm="xla")  # noqa: E731
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w, b), specs)]
  grad = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.square(fn(*a).astype(jnp.float32))), argnums=(0, 1, 2)))
  types = dot_operand_types(grad, *args)
  assert types and set(types) == {MLIR_TYPE[dtype]}, f"the dots' operand types: {types}"
  x64, w64, b64 = (np.asarray(a, np.float64) for a in (x, w, b))
  dout = 2 * (x64 @ w64 + b64)
  scale = float(np.sqrt(np.mean(dout ** 2)))
  for name, got, want, k in zip(("dx", "dw", "dbias"), grad(*args), (dout @ w64.T, x64.T @ dout, dout.sum(0)),
                                (36, 24, 24)):
    assert_close(got, want, dtype=dtype, k=k, scale=scale, what=name)
