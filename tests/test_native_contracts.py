"""The GEMM handlers' checks and the one-enqueuer-per-GPU claim, run on a CPU: the C++ the handlers run
(csrc/ffi/common.cc check_gemm and EnqueueClaim), called through the harness module on buffers described by dtype
and shape and from host threads it starts (csrc/testing/bind_handler_checks.cc).

check_gemm (issue 52.6): the scaling mode comes from the call's attributes (csrc/core/scale_mode.h) and the scales
must have the shape that mode gives them, else the call is refused naming the argument, what was expected and what
came. EnqueueClaim (issue 52.2; docs/protocol.md, "Host threads"): a second thread claiming a GPU while another holds
it is refused naming both threads. That XLA's execute path takes the claim is tests/gpu/test_enqueue_threads.py's.
"""

from __future__ import annotations

import pytest

from jax_overlap.quantization import scaling

import native_testing

pytestmark = pytest.mark.skipif(native_testing.module() is None, reason="needs jax_overlap's native module (a "
                                                                       "pure-Python install has none)")

NONE, TENSOR, BLOCK = scaling.NO_SCALES_CODE, scaling.TENSOR.code, scaling.BLOCK.code
E4M3, E5M2, BF16, F16, F32 = "float8_e4m3fn", "float8_e5m2", "bfloat16", "float16", "float32"
NO_BIAS = (BF16, [0])
ONE = (F32, [1])  # a tensor scale
NO_SCALE = (F32, [0])  # a 16-bit call's scale operand

# Float8 x [2, 3, 7, 48] and K-major w [80, 48]: k and n whole 16-byte vectors, no dim a power of two.
X8, W8, Y8 = (E4M3, [2, 3, 7, 48]), (E4M3, [80, 48]), (BF16, [2, 3, 7, 80])
# Block scales: k = 3 blocks (a w_scale row padded to 4), n = 5 blocks, batch * m = 42 rows of x.
XB, WB, YB = (E4M3, [2, 3, 7, 384]), (E4M3, [640, 384]), (BF16, [2, 3, 7, 640])
XB_SCALE, WB_SCALE = (F32, [2, 3, 7, 3]), (F32, [5, 4])  # 3 * 42 = 126 floats, 5 * 4 = 20


def harness():
  return native_testing.module()


def check(x, w, y, x_scale, w_scale, scaling=TENSOR, bias=NO_BIAS, **kw):
  """check_gemm as matmul_rs's pipelined handler calls it (w K-major unless w_kmajor says otherwise)."""
  kw.setdefault("w_kmajor", True)
  return harness().check_gemm("matmul_rs", x, w, bias, x_scale, w_scale, y, scaling=scaling, **kw)


def refusal(result) -> str:
  assert isinstance(result, str), f"accepted: {result}"
  assert result.startswith("INVALID_ARGUMENT: jax_overlap matmul_rs: invalid "), result
  return result


# --- check_gemm: tensor scales -----------------------------------------------------------------------------------


def test_a_tensor_scale_of_shape_1_is_accepted_in_tensor_mode():
  p = check(X8, W8, Y8, ONE, ONE)
  assert isinstance(p, dict), p
  assert (p["batch"], p["rows"], p["k"], p["n"]) == (6, 7, 48, 80)
  assert (p["x"], p["w"], p["out"], p["scaled"], p["blocks"], p["w_kmajor"], p["bias"]) == \
      (E4M3, E4M3, BF16, True, False, True, False)


@pytest.mark.parametrize("x_scale, w_scale, name, got", [
    # Block scales passed as tensor ones: neither read as the other mode.
    (ONE, (F32, [5, 3]), "w_scale", "[5, 3]"),
    ((F32, [6, 7, 3]), ONE, "x_scale", "[6, 7, 3]"),
    # One float, but not one per operand: a [7] row of x's scales.
    ((F32, [7]), ONE, "x_scale", "[7]"),
    # No scale at all, as a 16-bit call would pass.
    (NO_SCALE, ONE, "x_scale", "[0]"),
])
def test_tensor_mode_refuses_scales_of_another_shape_naming_them(x_scale, w_scale, name, got):
  message = refusal(check(X8, W8, Y8, x_scale, w_scale, TENSOR))
  assert f"invalid {name}: expected float32 [1] (scaling mode tensor), got {got}" in message, message


def test_scales_of_another_dtype_are_refused():
  message = refusal(check(X8, W8, Y8, ONE, (BF16, [1])))
  assert "invalid dtype of scales: expected float32 with float8 operands, got bfloat16" in message, message


def test_fast_accumulation_takes_tensor_scales_only():
  assert check(X8, W8, Y8, ONE, ONE, fast_accumulation=True)["fast_accumulation"] is True
  message = refusal(check(XB, WB, YB, XB_SCALE, WB_SCALE, BLOCK, fast_accumulation=True))
  assert "invalid fast_accumulation: expected tensor-scaled float8 operands, got block scales" in message, message


# --- check_gemm: block scales ------------------------------------------------------------------------------------


def test_block_scales_of_the_right_counts_are_accepted_in_block_mode():
  p = check(XB, WB, YB, XB_SCALE, WB_SCALE, BLOCK)
  assert isinstance(p, dict), p
  assert (p["batch"], p["rows"], p["k"], p["n"], p["scaled"], p["blocks"]) == (6, 7, 384, 640, True, True)
  # Counts, not shapes: the scales come as flat operands.
  assert check(XB, WB, YB, (F32, [126]), (F32, [20]), BLOCK)["blocks"] is True


@pytest.mark.parametrize("x_scale, w_scale, name, expected, got", [
    # Tensor scales under the block mode.
    (ONE, ONE, "x_scale", "126 block scales ([k/128][rows of x], scaling mode block)", "[1] (1)"),
    # w's scale rows unpadded: k/128 = 3, not rounded up to 4.
    (XB_SCALE, (F32, [5, 3]), "w_scale", "20 block scales ([n/128][k/128 rounded up to a multiple of 4], "
                                         "scaling mode block)", "[5, 3] (15)"),
    # x's scales for one batch element only.
    ((F32, [7, 3]), WB_SCALE, "x_scale", "126 block scales", "[7, 3] (21)"),
])
def test_block_mode_refuses_scales_of_other_counts_naming_them(x_scale, w_scale, name, expected, got):
  message = refusal(check(XB, WB, YB, x_scale, w_scale, BLOCK))
  assert f"invalid {name}: expected {expected}" in message and message.endswith(f"got {got}"), message


def test_block_mode_takes_whole_blocks_of_k_and_n_and_a_k_major_w():
  x, w, y = (E4M3, [5, 272]), (E4M3, [640, 272]), (BF16, [5, 640])  # k = 272: 2 blocks and 16
  message = refusal(check(x, w, y, (F32, [10]), (F32, [20]), BLOCK))
  assert "invalid k and n: expected multiples of 128 with float8 block scales, got k = 272, n = 640" in message
  message = refusal(check(XB, (E4M3, [384, 640]), YB, XB_SCALE, WB_SCALE, BLOCK, w_kmajor=False))
  assert "invalid layout of w: expected [n, k] (w_kmajor) with float8 block scales, got [k, n]" in message


# --- check_gemm: the mode against the operands -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("mode, name", [(TENSOR, "tensor"), (BLOCK, "block")])
def test_16_bit_operands_with_a_scaling_mode_are_refused(dtype, mode, name):
  x, w, y = (dtype, [3, 40]), (dtype, [24, 40]), (dtype, [3, 24])
  message = refusal(check(x, w, y, ONE, ONE, mode, bias=(dtype, [0])))
  assert f"invalid scaling mode (config): expected none (0) with {dtype} operands, got {name} ({mode})" in message


def test_16_bit_operands_take_mode_none_and_no_scales():
  x, w, y = (BF16, [3, 40]), (BF16, [24, 40]), (BF16, [3, 24])
  p = check(x, w, y, NO_SCALE, NO_SCALE, NONE, bias=(BF16, [24]))
  assert isinstance(p, dict) and (p["rows"], p["k"], p["n"], p["scaled"], p["bias"]) == (3, 40, 24, False, True), p
  message = refusal(check(x, w, y, NO_SCALE, ONE, NONE))
  assert "invalid scales: expected none (f32[0]) with bfloat16 operands, got [1]" in message, message


def test_float8_operands_in_mode_none_are_refused():
  message = refusal(check(X8, W8, Y8, ONE, ONE, NONE))
  assert ("invalid scaling mode (config): expected tensor (1) or block (2) with float8_e4m3fn operands, got none (0)"
          in message), message


@pytest.mark.parametrize("mode", [3, -1, 1 << 40])
def test_an_unknown_mode_number_is_refused(mode):
  message = refusal(check(X8, W8, Y8, ONE, ONE, mode))
  assert message.endswith(f"invalid scaling mode (config): expected one of none (0), tensor (1), block (2), got "
                          f"{mode}"), message


def test_the_fused_targets_take_no_float8():
  """The fused kernels' handlers pass no scales (None) and mode none."""
  result = harness().check_gemm("ag_matmul", X8, (E4M3, [48, 80]), NO_BIAS, None, None, Y8, like_x=X8,
                                scaling=NONE)
  assert result.startswith("INVALID_ARGUMENT: jax_overlap ag_matmul: invalid dtype of x: expected bfloat16 or "
                           "float16 (the fused kernels take no float8), got float8_e4m3fn"), result


def test_both_e5m2_and_other_dtypes_are_refused_by_name():
  message = refusal(check((E5M2, [7, 48]), (E5M2, [80, 48]), (BF16, [7, 80]), ONE, ONE))
  assert "invalid dtypes of x and w: expected not both e5m2, got float8_e5m2 and float8_e5m2" in message
  message = refusal(check((E4M3, [7, 48]), ("int8", [80, 48]), (BF16, [7, 80]), ONE, ONE))
  assert "invalid dtype of w: expected a float8 format of x's kind (OCP), got int8" in message, message


# --- EnqueueClaim ------------------------------------------------------------------------------------------------


def claims(ordinals, hold):
  """(thread id, status) of each thread's claim on its ordinal, as ag_matmul's execute takes it, the threads in
  turn; hold: each keeps a claim it got until all have claimed."""
  return harness().enqueue_claims("ag_matmul", ordinals, hold)


def refused(thread, holder, ordinal) -> str:
  return (f"FAILED_PRECONDITION: jax_overlap ag_matmul: host thread {thread} ran a call on GPU {ordinal} while "
          f"thread {holder} was enqueuing another there; ")


def test_a_second_claim_on_a_held_gpu_is_refused_naming_both_threads():
  (holder, held), (thread, message) = claims([0, 0], hold=True)
  assert holder != thread and held == "", held
  assert message.startswith(refused(thread, holder, 0)), message
  assert '(docs/protocol.md, "Host threads")' in message, message


def test_each_gpu_has_one_holder_and_a_refused_claim_frees_nothing():
  """Claims on GPUs 5 and 6 in turn: the first on each holds it; a refused claim, dropped at once, leaves the
  holder's in place, so the claims after it are refused too."""
  got = claims([5, 6, 5, 5, 6], hold=True)
  (t5, s5), (t6, s6) = got[0], got[1]
  assert (s5, s6) == ("", ""), got
  for (thread, message), ordinal, holder in zip(got[2:], [5, 5, 6], [t5, t5, t6]):
    assert message.startswith(refused(thread, holder, ordinal)), message


def test_held_claims_on_different_gpus_are_not_refused():
  got = claims([0, 1, 2, 63], hold=True)
  assert [s for _, s in got] == [""] * 4, got


def test_claims_one_after_another_are_not_refused():
  got = claims([0, 0, 0], hold=False)
  assert len({t for t, _ in got}) == 3 and [s for _, s in got] == [""] * 3, got
  # The holder's release frees the GPU for the next thread's call.
  claims([4, 4], hold=True)
  assert [s for _, s in claims([4], hold=False)] == [""]


@pytest.mark.parametrize("ordinal", [-1, 64])
def test_an_ordinal_out_of_range_is_refused(ordinal):
  assert harness().MAX_LOCAL_DEVICES == 64
  ((_, message),) = claims([ordinal], hold=False)
  assert message == (f"INVALID_ARGUMENT: jax_overlap ag_matmul: invalid device ordinal: expected 0 to 63, got "
                     f"{ordinal}"), message
