"""Global-mode partition decisions (sharding_plan.ag_plan / rs_plan / spec_of) and the Shardy rules, with no
devices.

Specs are what sharding_plan.spec_of makes of a sharding: one entry per dim,
a tuple of mesh axes or None. The mesh is a stand-in with a .shape.
"""

import types

import pytest
from jax.sharding import PartitionSpec as P

from jax_overlap import partitioning, sharding_plan

MESH = types.SimpleNamespace(shape={"dp": 2, "tp": 4})
DP, TP, BOTH = ("dp",), ("tp",), ("dp", "tp")


# (name, x spec, w spec, w_kmajor) -> (axes, x, w, bias, y, gathered)
AG_CASES = [
    ("fused", [TP, None], [None, TP], False,
     (TP, P("tp", None), P(None, "tp"), P("tp"), P(None, "tp"), P(None, None))),
    ("fused_w_kmajor", [TP, None], [TP, None], True,
     (TP, P("tp", None), P("tp", None), P("tp"), P(None, "tp"), P(None, None))),
    ("fused_dp_batch_passes_through", [DP, TP, None], [None, TP], False,
     (TP, P("dp", "tp", None), P(None, "tp"), P("tp"), P("dp", None, "tp"), P("dp", None, None))),
    ("fused_over_two_axes", [BOTH, None], [None, BOTH], False,
     (BOTH, P(BOTH, None), P(None, BOTH), P(BOTH), P(None, BOTH), P(None, None))),
    ("rows_only_w_replicated", [TP, None], [None, None], False,
     (None, P("tp", None), P(None, None), P(None), P("tp", None), P("tp", None))),
    ("k_sharded_is_gathered", [None, TP], [TP, None], False,
     (None, P(None, None), P(None, None), P(None), P(None, None), P(None, None))),
    ("rows_dp_cols_tp", [DP, None], [None, TP], False,
     (None, P("dp", None), P(None, "tp"), P("tp"), P("dp", "tp"), P("dp", None))),
    ("rows_and_cols_on_different_axes", [TP, None], [None, DP], False,
     (None, P("tp", None), P(None, "dp"), P("dp"), P("tp", "dp"), P("tp", None))),
    ("cols_axis_taken_by_batch", [TP, None, None], [None, TP], False,
     (None, P("tp", None, None), P(None, None), P(None), P("tp", None, None), P("tp", None, None))),
    ("cols_axis_inside_rows_axes", [BOTH, None], [None, TP], False,
     (None, P(BOTH, None), P(None, None), P(None), P(BOTH, None), P(BOTH, None))),
]


@pytest.mark.parametrize("name,x_spec,w_spec,w_kmajor,expected", AG_CASES, ids=[c[0] for c in AG_CASES])
def test_ag_plan(name, x_spec, w_spec, w_kmajor, expected):
  assert sharding_plan.ag_plan(MESH, x_spec, w_spec, w_kmajor) == expected


# (name, x spec, w spec, w_kmajor, rows) -> (axes, x, w, bias, out)
RS_CASES = [
    ("fused", [None, TP], [TP, None], False, 16,
     (TP, P(None, "tp"), P("tp", None), P(None), P("tp", None))),
    ("fused_w_kmajor", [None, TP], [None, TP], True, 16,
     (TP, P(None, "tp"), P(None, "tp"), P(None), P("tp", None))),
    ("fused_dp_batch_passes_through", [DP, None, TP], [TP, None], False, 16,
     (TP, P("dp", None, "tp"), P("tp", None), P(None), P("dp", "tp", None))),
    ("fused_over_two_axes", [None, BOTH], [BOTH, None], False, 16,
     (BOTH, P(None, BOTH), P(BOTH, None), P(None), P(BOTH, None))),
    ("rows_not_divisible", [None, TP], [TP, None], False, 6,
     (None, P(None, None), P(None, None), P(None), P(None, None))),
    ("rows_divisible_by_tp_not_by_both", [None, BOTH], [BOTH, None], False, 4,
     (None, P(None, None), P(None, None), P(None), P(None, None))),
    ("k_on_different_axes", [None, TP], [DP, None], False, 16,
     (None, P(None, None), P(None, None), P(None), P(None, None))),
    ("rows_dp_cols_tp", [DP, None], [None, TP], False, 16,
     (None, P("dp", None), P(None, "tp"), P("tp"), P("dp", "tp"))),
    ("cols_axis_taken_by_rows", [TP, None], [None, TP], False, 16,
     (None, P("tp", None), P(None, None), P(None), P("tp", None))),
    ("rows_axis_taken_by_batch", [TP, TP, None], [None, None], False, 16,
     (None, P("tp", None, None), P(None, None), P(None), P("tp", None, None))),
]


@pytest.mark.parametrize("name,x_spec,w_spec,w_kmajor,rows,expected", RS_CASES, ids=[c[0] for c in RS_CASES])
def test_rs_plan(name, x_spec, w_spec, w_kmajor, rows, expected):
  assert sharding_plan.rs_plan(MESH, x_spec, w_spec, w_kmajor, rows) == expected


@pytest.mark.parametrize("spec,ndim,expected", [
    (P("tp", None), 2, [TP, None]),
    (P(("dp", "tp")), 2, [BOTH, None]),
    (P(None, "tp"), 3, [None, TP, None]),
    (P(), 2, [None, None]),
    (P((), "tp"), 2, [None, TP]),
], ids=["plain", "tuple_padded", "padded", "replicated", "empty_tuple"])
def test_spec_normalization(spec, ndim, expected):
  assert sharding_plan.spec_of(types.SimpleNamespace(spec=spec), ndim) == expected


def test_spec_without_sharding_is_replicated():
  assert sharding_plan.spec_of(None, 3) == [None, None, None]


@pytest.mark.parametrize("has_bias,w_kmajor,expected", [
    (False, False, (("…0", "m", "k"), ("k", "n")), ),
    (True, True, (("…0", "m", "k"), ("n", "k"), ("n",))),
])
def test_ag_sharding_rule(has_bias, w_kmajor, expected):
  """The output rows are their own factor p: propagation must not copy x's row sharding onto y."""
  rule = partitioning._ag_function(3, has_bias, w_kmajor, "auto").sharding_rule
  assert rule.operand_mappings == expected
  assert rule.result_mappings == (("…0", "p", "n"), ("…0", "p", "k"))


def test_rs_sharding_rule():
  rule = partitioning._rs_function(2, True, False, "auto", 16).sharding_rule
  assert rule.operand_mappings == (("…0", "m", "k"), ("k", "n"), ("n",))
  assert rule.result_mappings == (("…0", "m", "n"),)
  assert tuple(rule.reduction_factors) == ("k",)
