"""The flag protocol's value rules as the kernels apply them (csrc/kernels/region_layout.h match,
csrc/kernels/pipeline_kernels.h pipe_state, csrc/kernels/params.h EpochCounter), through the native
module's host copies: no GPU needed, only a GPU build of the extension."""

from __future__ import annotations

import pytest

import native_testing

pytestmark = pytest.mark.skipif(native_testing.module() is None, reason="no native extension (pure-Python install)")

WRAP32 = 2 ** 32


def _nat():
  return native_testing.module()


@pytest.mark.parametrize("epoch", [1, 2, 0xFFFF, 0x10000, 0x10001, WRAP32 - 1, WRAP32, WRAP32 + 1])
def test_fused_flag_matches_only_its_exact_epoch(epoch):
  """16 bits of epoch: a value one or two calls stale never matches, across the wrap too."""
  site = 3
  low = epoch % WRAP32
  want = _nat().flag_value(low, site)
  assert _nat().flag_match(_nat().flag_value(low, site), want) == "yes"
  for stale in (1, 2):
    assert _nat().flag_match(_nat().flag_value((epoch - stale) % WRAP32, site), want) == "no"
  assert _nat().flag_match(_nat().flag_value(low, 4), want) == "other site"
  # Done and staged flags are waited for with site 0: any site.
  assert _nat().flag_match(_nat().flag_value(low, 9), _nat().flag_value(low, 0)) == "yes"


@pytest.mark.parametrize("epoch", [0x10000, 0x20000, WRAP32])
def test_fused_zero_flag_is_never_a_release(epoch):
  """An epoch whose low 16 bits are 0 expects the low bits a zeroed flag has: the site (never 0 in a release)
  tells them apart, for site-checked and any-site waits alike."""
  low = epoch % WRAP32
  assert _nat().flag_match(0, _nat().flag_value(low, 0)) == "no"
  assert _nat().flag_match(0, _nat().flag_value(low, 1)) == "no"


@pytest.mark.parametrize("epoch", [1, 2, WRAP32 - 1, WRAP32, WRAP32 + 1])
def test_pipelined_flag_states(epoch):
  low, site = epoch % WRAP32, 7
  state = _nat().pipelined_flag_state
  assert state(low, site, low, site) == "released"
  assert state(low, site, low, 0) == "released"  # a done flag: any site
  assert state(low, 8, low, site) == "other site"
  assert state((epoch - 2) % WRAP32, site, low, site) == "pending"  # two calls stale
  assert state((epoch + 2) % WRAP32, site, low, site) == "pending"  # the writer ran ahead: never a pass


def test_pipelined_zero_flag_is_never_a_release():
  """Epoch 2^32 has low bits 0, as a zeroed flag: the zero site says it was never released."""
  assert _nat().pipelined_flag_state(0, 0, 0, 0) == "pending"
  assert _nat().pipelined_flag_state(0, 0, 0, 5) == "pending"


def test_pipelined_rewriting_and_abandoned_flags():
  """A flag its writer marked rewriting (site 0) is no release, whichever epoch it holds (the writer's next release
  writes the epoch before the site); one it abandoned (site 0xFFFFFFFF) is neither a release nor a wait."""
  state = _nat().pipelined_flag_state
  for epoch in (7, 9):  # the mark on the old release, then the new epoch with the site still to come
    assert state(epoch, 0, 9, 3) == "pending"
    assert state(epoch, 0, 9, 0) == "pending"
  assert state(9, 0xFFFFFFFF, 9, 3) == "abandoned"
  assert state(7, 0xFFFFFFFF, 9, 3) == "pending"


@pytest.mark.parametrize("origin", [0, 2 ** 16 - 1, WRAP32 - 2, WRAP32 - 1, 2 ** 63])
def test_a_slot_is_used_from_the_third_call_after_the_origin(origin):
  """The readers-done wait runs from the third call after the flags were zeroed, wherever the low bits are."""
  used = [_nat().epoch_slot_used(origin, origin + i) for i in range(1, 7)]
  assert used == [False, False, True, True, True, True]
