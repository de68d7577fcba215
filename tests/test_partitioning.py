"""Global-mode partition decisions (each op's sharding_plan, _sharding.spec_of) and the Shardy rules, with no
devices.

Specs are what _sharding.spec_of makes of a sharding: one entry per dim,
a tuple of mesh axes or None. The mesh is a stand-in with a .shape.
"""

import types

import pytest
from jax.sharding import PartitionSpec as P

from jax_overlap.integration import partitioning

from jax_overlap import _sharding
from jax_overlap.ops import ag_matmul, matmul_rs
from jax_overlap.quantization import scaling

MESH = types.SimpleNamespace(shape={"dp": 2, "tp": 4})
DP, TP, BOTH = ("dp",), ("tp",), ("dp", "tp")


def ag(x_spec, w_spec, x_shape=(16, 16), w_shape=(16, 24), w_kmajor=False, gather=-2):
  return ag_matmul.sharding_plan(MESH, x_spec, w_spec, x_shape, w_shape, w_kmajor, gather)


def rs(x_spec, w_spec, x_shape=(16, 16), w_shape=(16, 24), w_kmajor=False, scatter=None, request=None):
  return matmul_rs.sharding_plan(MESH, x_spec, w_spec, x_shape, w_shape, w_kmajor, scatter, request)


# (name, x spec, w spec, w_kmajor, x shape, w shape) -> (axes, x, w, bias, y, gathered)
AG_CASES = [
    ("fused", [TP, None], [None, TP], False, (16, 16), (16, 24),
     (TP, P("tp", None), P(None, "tp"), P("tp"), P(None, "tp"), P(None, None))),
    ("fused_w_kmajor", [TP, None], [TP, None], True, (16, 16), (24, 16),
     (TP, P("tp", None), P("tp", None), P("tp"), P(None, "tp"), P(None, None))),
    ("fused_dp_batch_passes_through", [DP, TP, None], [None, TP], False, (2, 16, 16), (16, 24),
     (TP, P("dp", "tp", None), P(None, "tp"), P("tp"), P("dp", None, "tp"), P("dp", None, None))),
    ("fused_over_two_axes", [BOTH, None], [None, BOTH], False, (16, 16), (16, 24),
     (BOTH, P(BOTH, None), P(None, BOTH), P(BOTH), P(None, BOTH), P(None, None))),
    ("fused_rows_keep_dp", [BOTH, None], [None, TP], False, (16, 16), (16, 24),
     (TP, P(BOTH, None), P(None, "tp"), P("tp"), P("dp", "tp"), P("dp", None))),
    ("fused_heads_kernel", [None, TP, None], [None, TP, None], False, (2, 16, 16), (16, 4, 8),
     (TP, P(None, "tp", None), P(None, "tp", None), P("tp", None), P(None, None, "tp", None), P(None, None, None))),
    ("fused_gated_kernel", [DP, TP, None], [None, None, TP], False, (2, 16, 16), (16, 2, 24),
     (TP, P("dp", "tp", None), P(None, None, "tp"), P(None, "tp"), P("dp", None, None, "tp"),
      P("dp", None, None))),
    ("rows_only_w_replicated", [TP, None], [None, None], False, (16, 16), (16, 24),
     (None, P("tp", None), P(None, None), P(None), P("tp", None), P("tp", None))),
    ("k_sharded_is_gathered", [None, TP], [TP, None], False, (16, 16), (16, 24),
     (None, P(None, None), P(None, None), P(None), P(None, None), P(None, None))),
    ("rows_dp_cols_tp", [DP, None], [None, TP], False, (16, 16), (16, 24),
     (None, P("dp", None), P(None, "tp"), P("tp"), P("dp", "tp"), P("dp", None))),
    ("rows_and_cols_on_different_axes", [TP, None], [None, DP], False, (16, 16), (16, 24),
     (None, P("tp", None), P(None, "dp"), P("dp"), P("tp", "dp"), P("tp", None))),
    ("cols_axis_taken_by_batch", [TP, None, None], [None, TP], False, (4, 16, 16), (16, 24),
     (None, P("tp", None, None), P(None, None), P(None), P("tp", None, None), P("tp", None, None))),
    ("group_axes_not_minor_in_rows", [("tp", "dp"), None], [None, TP], False, (16, 16), (16, 24),
     (None, P(("tp", "dp"), None), P(None, None), P(None), P(("tp", "dp"), None), P(("tp", "dp"), None))),
    ("two_sharded_output_dims", [TP, None], [None, DP, TP], False, (16, 16), (16, 2, 8),
     (None, P("tp", None), P(None, "dp", None), P("dp", None), P("tp", "dp", None), P("tp", None))),
    # 15.4: a dim its axes do not divide is unsharded, so nothing gathers or multiplies padding
    ("uneven_rows_not_gathered", [TP, None], [None, TP], False, (10, 16), (16, 24),
     (None, P(None, None), P(None, "tp"), P("tp"), P(None, "tp"), P(None, None))),
    ("uneven_cols_not_sharded", [TP, None], [None, TP], False, (16, 16), (16, 10),
     (None, P("tp", None), P(None, None), P(None), P("tp", None), P("tp", None))),
]


@pytest.mark.parametrize("name,x_spec,w_spec,w_kmajor,x_shape,w_shape,expected", AG_CASES,
                         ids=[c[0] for c in AG_CASES])
def test_ag_plan(name, x_spec, w_spec, w_kmajor, x_shape, w_shape, expected):
  plan = ag(x_spec, w_spec, x_shape, w_shape, w_kmajor)
  assert isinstance(plan, ag_matmul.Plan)
  assert (plan.axes, plan.x, plan.w, plan.bias, plan.y, plan.gathered) == expected
  assert plan.why


def test_ag_plan_gather_axis():
  """gather_axis 0: the batch dim's sharding is gathered, the rows pass through."""
  plan = ag([TP, None, None], [None, TP], (8, 4, 16), (16, 24), gather=-3)
  assert (plan.axes, plan.x, plan.y, plan.gathered) == (TP, P("tp", None, None), P(None, None, "tp"),
                                                        P(None, None, None))
  assert ag([TP, None, None], [None, TP], (8, 4, 16), (16, 24)).axes is None  # rows (-2) are not sharded


# (name, x spec, w spec, x shape, w shape, scatter, requested out spec) -> (axes, scatter, x, w, bias, out)
RS_CASES = [
    ("fused", [None, TP], [TP, None], (16, 16), (16, 24), None, None,
     (TP, -2, P(None, "tp"), P("tp", None), P(None), P("tp", None))),
    ("fused_dp_batch_passes_through", [DP, None, TP], [TP, None], (2, 16, 16), (16, 24), None, None,
     (TP, -2, P("dp", None, "tp"), P("tp", None), P(None), P("dp", "tp", None))),
    ("fused_over_two_axes", [None, BOTH], [BOTH, None], (16, 16), (16, 24), None, None,
     (BOTH, -2, P(None, BOTH), P(BOTH, None), P(None), P(BOTH, None))),
    ("rows_on_dp_kept_as_batch", [DP, TP], [TP, None], (16, 16), (16, 24), None, None,
     (TP, -2, P("dp", "tp"), P("tp", None), P(None), P(BOTH, None))),
    ("heads_kernel", [None, None, TP, None], [TP, None, None], (2, 16, 4, 8), (4, 8, 24), None, None,
     (TP, -2, P(None, None, "tp", None), P("tp", None, None), P(None), P(None, "tp", None))),
    ("request_picks_columns", [None, TP], [TP, None], (16, 16), (16, 24), None, (None, TP),
     (TP, -1, P(None, "tp"), P("tp", None), P("tp"), P(None, "tp"))),
    ("request_picks_batch", [None, None, TP], [TP, None], (4, 16, 16), (16, 24), None, (TP, None, None),
     (TP, -3, P(None, None, "tp"), P("tp", None), P(None), P("tp", None, None))),
    ("request_without_axes_all_reduces", [DP, TP], [TP, None], (16, 16), (16, 24), None, (DP, None),
     (TP, None, P("dp", "tp"), P("tp", None), P(None), P("dp", None))),
    ("scatter_argument_beats_request", [None, TP], [TP, None], (16, 16), (16, 24), -1, (TP, None),
     (TP, -1, P(None, "tp"), P("tp", None), P("tp"), P(None, "tp"))),
    ("rows_not_divisible_all_reduces", [None, TP], [TP, None], (6, 16), (16, 24), None, None,
     (TP, None, P(None, "tp"), P("tp", None), P(None), P(None, None))),
    ("rows_divisible_by_tp_not_by_both", [None, BOTH], [BOTH, None], (4, 16), (16, 24), None, None,
     (BOTH, None, P(None, BOTH), P(BOTH, None), P(None), P(None, None))),
    ("k_on_different_axes", [None, TP], [DP, None], (16, 16), (16, 24), None, None,
     (None, None, P(None, None), P(None, None), P(None), P(None, None))),
    ("rows_dp_cols_tp", [DP, None], [None, TP], (16, 16), (16, 24), None, None,
     (None, None, P("dp", None), P(None, "tp"), P("tp"), P("dp", "tp"))),
    ("cols_axis_taken_by_rows", [TP, None], [None, TP], (16, 16), (16, 24), None, None,
     (None, None, P("tp", None), P(None, None), P(None), P("tp", None))),
    ("w_kmajor", [None, TP], [None, TP], (16, 16), (24, 16), None, None,
     (TP, -2, P(None, "tp"), P(None, "tp"), P(None), P("tp", None))),
    # 15.4: K = 10 on 4 devices would multiply XLA's padding: the contraction is not partitioned
    ("uneven_k_not_reduced", [None, TP], [TP, None], (16, 10), (10, 24), None, None,
     (None, None, P(None, None), P(None, None), P(None), P(None, None))),
]


@pytest.mark.parametrize("name,x_spec,w_spec,x_shape,w_shape,scatter,asked,expected", RS_CASES,
                         ids=[c[0] for c in RS_CASES])
def test_rs_plan(name, x_spec, w_spec, x_shape, w_shape, scatter, asked, expected):
  w_kmajor = name == "w_kmajor"
  plan = rs(x_spec, w_spec, x_shape, w_shape, w_kmajor, scatter, asked)
  assert isinstance(plan, matmul_rs.Plan)
  assert (plan.axes, plan.scatter, plan.x, plan.w, plan.bias, plan.out) == expected
  assert plan.why


@pytest.mark.parametrize("spec,ndim,expected", [
    (P("tp", None), 2, [TP, None]),
    (P(("dp", "tp")), 2, [BOTH, None]),
    (P(None, "tp"), 3, [None, TP, None]),
    (P(), 2, [None, None]),
    (P((), "tp"), 2, [None, TP]),
], ids=["plain", "tuple_padded", "padded", "replicated", "empty_tuple"])
def test_spec_normalization(spec, ndim, expected):
  assert _sharding.spec_of(types.SimpleNamespace(spec=spec), ndim) == expected
  assert _sharding.spec_of(spec, ndim) == expected


def test_spec_without_sharding_is_replicated():
  assert _sharding.spec_of(None, 3) == [None, None, None]


@pytest.mark.parametrize("has_bias,scaled,w_kmajor,w_ndim,expected", [
    (False, False, False, 2, (("b0", "g", "k"), ("k", "n0"))),
    (True, False, True, 2, (("b0", "g", "k"), ("n0", "k"), ("n0",))),
    (True, False, False, 3, (("b0", "g", "k"), ("k", "n0", "n1"), ("n0", "n1"))),
    (True, True, True, 2, (("b0", "g", "k"), ("n0", "k"), ("n0",), (), ())),  # float8: the scales are scalars
])
def test_ag_sharding_rule(has_bias, scaled, w_kmajor, w_ndim, expected):
  """The gathered dim is its own factor p in the results: propagation must not copy x's sharding of it onto y;
  the gathered x's K dim is q, not k: it comes whole, whatever w's K is sharded on (tests/test_grads.py
  no_involuntary_rematerialization). A float8 call's gathered_scales are not among the partitioned results (x_scale
  is added after)."""
  rule = partitioning.custom_partitioned(ag_matmul.OP, 3, w_ndim, has_bias, scaling.TENSOR if scaled else None,
                                         w_kmajor, "auto", -2, None, "bfloat16").sharding_rule
  assert rule.operand_mappings == expected
  n = tuple(f"n{i}" for i in range(w_ndim - 1))
  assert rule.result_mappings == (("b0", "p", *n), ("b0", "p", "q"))


def test_ag_sharding_rule_gather_axis():
  rule = partitioning.custom_partitioned(ag_matmul.OP, 3, 2, False, None, False, "auto", -3, None,
                                         "float32").sharding_rule
  assert rule.operand_mappings == (("g", "b1", "k"), ("k", "n0"))
  assert rule.result_mappings == (("p", "b1", "n0"), ("p", "b1", "q"))


@pytest.mark.parametrize("w_ndim,scaled,expected", [
    (2, False, (("b0", "b1", "k0"), ("k0", "n"), ("n",))),
    (3, False, (("b0", "k0", "k1"), ("k0", "k1", "n"), ("n",))),
    (2, True, (("b0", "b1", "k0"), ("k0", "n"), ("n",), (), ())),
])
def test_rs_sharding_rule(w_ndim, scaled, expected):
  rule = partitioning.custom_partitioned(matmul_rs.OP, 3, w_ndim, True, scaling.TENSOR if scaled else None, False,
                                         "auto", None, None, "float32").sharding_rule
  assert rule.operand_mappings == expected
  out_lead = expected[0][:3 - (w_ndim - 1)]
  assert rule.result_mappings == ((*out_lead, "n"),)
  assert tuple(rule.reduction_factors) == tuple(f"k{i}" for i in range(w_ndim - 1))
