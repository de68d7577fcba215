"""The op as one typed object (jax_overlap/ops/op.py): checked when it is made, and the registered ops whole."""

import dataclasses

import pytest

from jax_overlap import ops
from jax_overlap.integration.results import Kind, Results
from jax_overlap.ops import ag_matmul, matmul_rs
from jax_overlap.ops.op import Op, PlanningFigures, Rules


@pytest.mark.parametrize("name", list(ops.OPS))
def test_every_op_is_an_op_named_by_its_key_whose_dual_names_it(name):
  op = ops.OPS[name]
  assert isinstance(op, Op) and op.name == name and ops.OPS[op.dual].dual == name


def test_a_group_with_a_field_of_the_wrong_type_is_refused_naming_it():
  with pytest.raises(TypeError, match=r"^jax_overlap\.ops\.Rules: as_matrix must be a callable, got 'as_matrix'$"):
    Rules(ag_matmul.primitive, ag_matmul.bind, ag_matmul.abstract_eval, "as_matrix")
  figures = dataclasses.asdict(ag_matmul.OP.planning)
  with pytest.raises(TypeError, match=r"^jax_overlap\.ops\.PlanningFigures: reduces must be a bool, got 'no'$"):
    PlanningFigures(**dict(figures, reduces="no"))
  with pytest.raises(TypeError, match=r"^jax_overlap\.ops\.PlanningFigures: algorithms must be some of "):
    PlanningFigures(**dict(figures, algorithms=("pipelined", "ring")))


def test_an_op_is_refused_when_its_parts_disagree():
  with pytest.raises(TypeError, match=r"^jax_overlap\.ops\.Op: planning must be a PlanningFigures, got None$"):
    dataclasses.replace(ag_matmul.OP, planning=None)
  with pytest.raises(TypeError, match=r"its primitive must be named 'jax_overlap_matmul_rs', got "
                                      r"'jax_overlap_ag_matmul'"):
    dataclasses.replace(ag_matmul.OP, name="matmul_rs")
  with pytest.raises(TypeError, match=r"multiple_results must be False for 1 results, got True"):
    dataclasses.replace(ag_matmul.OP, results=matmul_rs.OP.results)


def test_results_are_refused_out_of_order_or_without_a_tag_each():
  with pytest.raises(TypeError, match=r"must start with Kind\.PRODUCT"):
    Results((Kind.GATHERED, Kind.PRODUCT), ("a", "b"))
  with pytest.raises(TypeError, match=r"must come last"):
    Results((Kind.PRODUCT, Kind.GATHERED_SCALES, Kind.GATHERED), ("a", "b", "c"))
  with pytest.raises(TypeError, match=r"one checkpoint name \(str\) per kind \(2\)"):
    Results((Kind.PRODUCT, Kind.GATHERED), ("a",))


def test_duals_that_do_not_name_each_other_are_refused():
  lone = dataclasses.replace(matmul_rs.OP, dual="matmul_rs")
  with pytest.raises(TypeError, match=r"op 'ag_matmul' names 'matmul_rs' as its dual, which must be an op of "
                                      r"\['ag_matmul', 'matmul_rs'\] naming 'ag_matmul' as its own; got one whose "
                                      r"dual is 'matmul_rs'"):
    ops.check_duals({"ag_matmul": ag_matmul.OP, "matmul_rs": lone})
  with pytest.raises(TypeError, match=r"got no op of that name$"):
    ops.check_duals({"ag_matmul": ag_matmul.OP})


def test_results_map_back_by_kind():
  ag, rs = ag_matmul.OP.results, matmul_rs.OP.results
  assert ag.gathers and not rs.gathers and ag.multiple and not rs.multiple
  assert ag.of_call(scaled=False) == (Kind.PRODUCT, Kind.GATHERED)
  assert ag.of_one("y", "x", lambda i: f"own{i}", scaled=True) == ["y", "x", "own2"]
  assert rs.of_one("y", "x", None, scaled=False) == ["y"]
