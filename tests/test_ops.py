"""The op protocol (jax_overlap/ops/__init__.py): every op module defines it whole, and one that does not is
refused by name at import."""

import types

import pytest

from jax_overlap import ops


@pytest.mark.parametrize("name", list(ops.OPS))
def test_every_op_defines_the_protocol(name):
  ops.check(ops.OPS[name])
  assert ops.OPS[name].NAME == name and ops.OPS[ops.OPS[name].DUAL].DUAL == name


def test_an_op_lacking_part_of_the_protocol_is_refused_by_name():
  parts = {name: getattr(ops.ag_matmul, name) for name in ops.PROTOCOL if name not in ("pipelined_us", "MOVERS")}
  op = types.ModuleType("jax_overlap.ops.new_op")
  op.__dict__.update(parts)
  with pytest.raises(TypeError, match=r"^jax_overlap.ops.new_op does not define \['pipelined_us', 'MOVERS'\]"):
    ops.check(op)
