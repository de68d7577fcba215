"""ROCm's hardware queues (issue 52.10; docs/rocm.md): the rule that says when a pipelined call's streams may share
a queue, and the INFO line set-up gives on ROCm."""

import logging

import jax
import pytest

from jax_overlap.runtime import backend, workspace


@pytest.mark.parametrize("queues, shares", [
    (1, "run at once"), (3, "run at once"),  # fewer queues than the call's 4 busy streams
    (4, "exceed"), (5, "exceed"),  # ROCm's default: XLA's 3 and our 3 do not all fit
    (6, None), (8, None), (16, None),
])
def test_the_streams_of_a_pipelined_call_against_the_queues(queues, shares):
  why = workspace.hw_queue_sharing(queues)
  assert (why is None) == (shares is None), why
  if shares:
    assert shares in why and str(queues) in why


def test_more_streams_of_xla_need_more_queues():
  assert workspace.hw_queue_sharing(8, xla_streams=6) is not None
  assert workspace.hw_queue_sharing(9, xla_streams=6) is None
  assert "2 streams run at once" in workspace.hw_queue_sharing(1, side_streams=1)


@pytest.mark.parametrize("env, said", [(None, "GPU_MAX_HW_QUEUES=4, ROCm's default"), ("2", "GPU_MAX_HW_QUEUES=2"),
                                       ("8", None)])
def test_set_up_on_rocm_says_so_at_info(monkeypatch, caplog, env, said):
  if env is None:
    monkeypatch.delenv(workspace.HW_QUEUES, raising=False)
  else:
    monkeypatch.setenv(workspace.HW_QUEUES, env)
  with caplog.at_level(logging.INFO, logger="jax_overlap"):
    workspace._note_hw_queues()
  lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
  if said is None:
    assert not lines, lines
  else:
    assert len(lines) == 1 and said in lines[0] and "GPU_MAX_HW_QUEUES=6 gives each its own" in lines[0], lines


def test_set_up_counts_the_queues_on_rocm_only(monkeypatch, caplog):
  from fake_gpu import FakeNative
  monkeypatch.delenv(workspace.HW_QUEUES, raising=False)
  for platform, want in (("cuda", 0), ("rocm", 1)):
    monkeypatch.setattr(backend, "_current", backend.Backend(FakeNative(), platform, gpus=jax.local_devices))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jax_overlap"):
      assert workspace.prepare_devices()
    said = [r.getMessage() for r in caplog.records if "hardware queues" in r.getMessage()]
    assert len(said) == want, (platform, said)
