"""The delayed-scaling step kernel (jax_overlap/ops/fp8_scales.py, csrc/kernels/fp8_scales.cu) against XLA's form of
Flax's rule on the same GPU, bit for bit: random states (histories of amaxes over many binades, of lengths 1, 16,
1000 and 1024, with zeros, infinities and NaNs among them; scales of any magnitude) for each OCP format, one and
two operands per launch. The zeros it gives are zeros, and a cast's amax that starts from them is each call's own
however often a compiled function runs. The delayed layer's state after several steps from a random state is the
XLA path's bit for bit. How often the rule's XLA form (div.full.f32 on NVIDIA) differs from exactly rounded
division is printed, not asserted.

  python -m pytest -q -s tests/gpu/test_fp8_scales_kernel.py     (seconds on the H200)
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_overlap.ops import fp8_cast, fp8_scales
from gpu_util import requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

FORMATS = [jnp.float8_e4m3fn, jnp.float8_e5m2]


def _states(rng, cases: int, length: int):
  """(scales [cases], histories [cases, length]): amaxes 10^u (u in [-30, 30]), some zero, infinite or NaN."""
  histories = 10.0 ** rng.uniform(-30, 30, (cases, length)) * rng.uniform(0.5, 1.0, (cases, length))
  special = rng.uniform(size=(cases, length))
  histories[special < 0.02] = 0.0
  histories[(special >= 0.02) & (special < 0.025)] = np.inf
  histories[(special >= 0.025) & (special < 0.03)] = np.nan
  histories[: cases // 8] = 0.0  # whole histories of zeros: the previous scale kept
  scales = 10.0 ** rng.uniform(-20, 20, cases)
  return jnp.asarray(scales, jnp.float32), jnp.asarray(histories.astype(np.float32))


def _mapped(fmts, algorithm):
  """Each case's step (one launch of len(fmts) operands per case, in a loop the kernel runs inside)."""
  def one(case):
    scales, histories = case
    steps, zeros = fp8_scales.step_scales(list(scales), list(histories), fmts, algorithm=algorithm)
    return jnp.stack(steps), jnp.stack(zeros)
  return jax.jit(lambda scales, histories: jax.lax.map(one, (scales, histories)))


def _exact(scales, histories, fmt):
  """Flax's rule with exactly rounded float32 divisions (NumPy's)."""
  with np.errstate(all="ignore"):
    amax = np.max(histories, axis=-1)  # NaN wins
    fp8_max = np.float32(jnp.finfo(fmt).max)
    previous = np.float32(1) / scales
    sf = np.where((amax > 0) & np.isfinite(amax), fp8_max / amax, previous).astype(np.float32)
    return (np.float32(1) / sf).astype(np.float32)


@pytest.mark.parametrize("length", [1, 16, 1000, 1024])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda d: np.dtype(d).name)
def test_kernel_is_xlas_rule_bit_for_bit(fmt, length):
  rng = np.random.default_rng(length + 7 * FORMATS.index(fmt))
  cases = 512
  scales, histories = _states(rng, 2 * cases, length)
  scales, histories = scales.reshape(cases, 2), histories.reshape(cases, 2, length)
  other = jnp.float8_e5m2 if fmt == jnp.float8_e4m3fn else jnp.float8_e4m3fn
  for fmts in ((fmt,), (fmt, other)):
    n = len(fmts)
    kernel, xla = _mapped(fmts, "auto"), _mapped(fmts, "xla")
    text = kernel.lower(scales[:, :n], histories[:, :n]).as_text()
    assert len(re.findall(r"custom_call @jax_overlap_fp8_step_scales\(", text)) == 1, "not the step kernel"
    assert "jax_overlap_fp8_step_scales" not in xla.lower(scales[:, :n], histories[:, :n]).as_text()
    (steps, zeros), (want, _) = kernel(scales[:, :n], histories[:, :n]), xla(scales[:, :n], histories[:, :n])
    np.testing.assert_array_equal(np.asarray(steps).view(np.uint32), np.asarray(want).view(np.uint32),
                                  err_msg=f"{n} operand(s)")
    assert not np.asarray(zeros).any() and not np.signbit(np.asarray(zeros)).any()
  exact = _exact(np.asarray(scales[:, 0]), np.asarray(histories[:, 0]), fmt)
  differ = np.asarray(want)[:, 0].view(np.uint32) != exact.view(np.uint32)
  print(f"\n{np.dtype(fmt).name} length {length}: XLA's rule differs from exactly rounded division in "
        f"{differ.sum()} of {cases} states")


def test_cast_amax_from_the_step_kernels_zero_is_each_calls_own():
  """A compiled step (step kernel, then a cast whose amax result is the kernel's zero) run again with smaller x,
  as XLA's command buffers replay it: each call's own amax, max |x| exactly, and the cast the plain variant's."""
  rng = np.random.default_rng(3)
  history = jnp.asarray(rng.uniform(1, 5, 16), jnp.float32)

  @jax.jit
  def step(x):
    (s,), (zero,) = fp8_scales.step_scales([jnp.float32(0.5)], [history], [jnp.float8_e4m3fn])
    return fp8_cast.cast_with_amax(x, s, jnp.float8_e4m3fn, amax_from=zero), s
  text = step.lower(jnp.zeros((512, 1024), jnp.bfloat16)).as_text()
  assert "custom_call @jax_overlap_fp8_cast_amax_from(" in text
  big = jnp.asarray(rng.standard_normal((512, 1024)) * 100, jnp.bfloat16)
  for x in (big, big / 1000, big / 1000, big):
    (q, amax), s = step(x)
    assert float(amax) == float(jnp.max(jnp.abs(x)))
    want, _ = jax.jit(lambda x, s: fp8_cast.cast_with_amax(x, s, jnp.float8_e4m3fn))(x, s)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), np.asarray(want).view(np.uint8))


def test_delayed_layer_state_after_steps_is_the_xla_paths():
  """Fp8DelayedRsDotGeneral and Fp8DelayedAgDotGeneral on one GPU from a random state (scales and histories that
  make every division of the rule count), three training steps: the six variables equal the XLA path's bit for
  bit at every step, and the step kernel ran (one per forward and one per backward)."""
  from flax.linen import fp8_ops
  from jax_overlap.layers.fp8_delayed import Fp8DelayedAgDotGeneral, Fp8DelayedRsDotGeneral
  owg = fp8_ops.OVERWRITE_WITH_GRADIENT
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((256, 512)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((512, 384)) / 23, jnp.bfloat16)
  dims = (((1,), (0,)), ((), ()))
  for cls in (Fp8DelayedAgDotGeneral, Fp8DelayedRsDotGeneral):
    def steps(algorithm):
      layer = cls(algorithm=algorithm)

      def one(state, x, w):
        loss = lambda s, x, w: jnp.sum(layer.apply({owg: s}, x, w, dims).astype(jnp.float32) ** 2)
        return jax.grad(loss)(state, x, w)
      return jax.jit(one), layer
    auto, layer = steps("auto")
    xla, _ = steps("xla")
    state = dict(layer.init(jax.random.key(0), x, w, dims)[owg])
    for name in state:
      state[name] = jnp.asarray(rng.uniform(0.01, 3.0, state[name].shape) * 10.0 ** rng.uniform(-3, 3),
                                state[name].dtype)
    text = auto.lower(state, x, w).as_text()
    assert len(re.findall(r"custom_call @jax_overlap_fp8_step_scales\(", text)) == 2, cls.__name__
    got, want = state, state
    for i in range(3):
      got, want = auto(got, x, w), xla(want, x, w)
      for name in sorted(got):
        np.testing.assert_array_equal(np.asarray(got[name]).view(np.uint32), np.asarray(want[name]).view(np.uint32),
                                      err_msg=f"{cls.__name__} step {i} {name}")
