"""The runtime's public functions on a machine without a GPU: harmless, and they say what they would do."""

import json
import logging
import math
import re

import jax
import pytest

import jax_overlap
from jax_overlap import tracing
from jax_overlap.runtime import errors, native, processes, settings, workspace

WORKSPACE_KEYS = {"active", "workspace_bytes", "used_bytes", "regions", "watchdog_seconds", "on_timeout",
                  "sync_after_launch", "trace", "devices", "reachable_devices", "link_gbps"}


def test_public_names():
  for name in jax_overlap.__all__:
    assert hasattr(jax_overlap, name), name
  assert isinstance(jax_overlap.__version__, str)


def test_initialize_is_inactive_with_a_reason():
  info = jax_overlap.initialize()
  assert info["active"] is False
  assert isinstance(info["reason"], str) and info["reason"]
  assert WORKSPACE_KEYS <= set(info)
  assert info["devices"] == [] and info["reachable_devices"] == []


def test_initialize_says_what_it_would_do(caplog, monkeypatch):
  monkeypatch.setenv("JAX_OVERLAP_WORKSPACE_BYTES", str(3 << 28))
  with caplog.at_level(logging.INFO, logger="jax_overlap"):
    info = jax_overlap.initialize(watchdog_seconds=2.5)
  assert info["active"] is False
  text = caplog.text
  assert "nothing to do" in text and info["reason"] in text
  assert f"would allocate {3 << 28} bytes per GPU" in text and "2.5 s" in text


def test_default_watchdog_is_minutes_and_has_one_source(monkeypatch):
  monkeypatch.delenv("JAX_OVERLAP_WATCHDOG_SECONDS", raising=False)
  assert workspace.default_watchdog_seconds() >= 60
  if native.module() is not None:  # the native runtime's constant is the only one
    assert workspace.default_watchdog_seconds() == native.module().DEFAULT_WATCHDOG_SECONDS
  assert jax_overlap.workspace_info()["watchdog_seconds"] == workspace.default_watchdog_seconds()


def test_infinite_watchdog_is_accepted():
  assert jax_overlap.initialize(watchdog_seconds=float("inf"))["active"] is False


def test_initialize_is_idempotent():
  first = jax_overlap.initialize(trace=True, sync_after_launch=True)
  assert jax_overlap.initialize() == first


@pytest.mark.parametrize("kwargs,match", [
    (dict(workspace_bytes=0), r"initialize: workspace_bytes must be positive, got 0"),
    (dict(watchdog_seconds=0), r"initialize: watchdog_seconds must be positive \(math.inf for none\), got 0"),
    (dict(watchdog_seconds=-1.0), r"initialize: watchdog_seconds must be positive \(math.inf for none\), got -1.0"),
    (dict(watchdog_seconds=float("nan")), r"initialize: watchdog_seconds must be positive .*got nan"),
    (dict(on_timeout="exit"), r"initialize: on_timeout must be one of \('abort', 'raise'\), got 'exit'"),
])
def test_initialize_rejects_bad_settings(kwargs, match):
  with pytest.raises(ValueError, match=match):
    jax_overlap.initialize(**kwargs)


@pytest.mark.parametrize("name,value,expected", [
    ("JAX_OVERLAP_WATCHDOG_SECONDS", "ten", "is not a number; expected a positive number of seconds (inf for none)"),
    ("JAX_OVERLAP_WATCHDOG_SECONDS", "-5", "; expected a positive number of seconds (inf for none)"),
    ("JAX_OVERLAP_WORKSPACE_BYTES", "1GiB", "is not a number; expected a positive number of bytes, such as 1073741824"),
    ("JAX_OVERLAP_WORKSPACE_BYTES", "0", "; expected a positive number of bytes"),
    ("JAX_OVERLAP_ON_TIMEOUT", "exit", "; expected one of abort, raise"),
    ("JAX_OVERLAP_SYNC", "maybe", "is not a switch; expected 1 or 0 (or true/false, yes/no, on/off)"),
    ("JAX_OVERLAP_TRACE", "2", "is not a switch; expected 1 or 0"),
])
def test_a_bad_setting_in_the_environment_names_the_variable_and_what_it_takes(monkeypatch, name, value, expected):
  monkeypatch.setenv(name, value)
  with pytest.raises(ValueError, match="^" + re.escape(f"jax_overlap: {name}={value!r}") + ".*" + re.escape(expected)):
    jax_overlap.initialize()


def test_settings_read_from_the_environment(monkeypatch):
  monkeypatch.setenv("JAX_OVERLAP_WATCHDOG_SECONDS", "inf")
  assert jax_overlap.workspace_info()["watchdog_seconds"] == math.inf
  for text, on in (("1", True), ("TRUE", True), ("on", True), ("", False), ("0", False), ("False", False),
                   ("no", False)):
    monkeypatch.setenv(settings.DISABLE, text)
    assert settings.disabled() is on
  monkeypatch.setenv(settings.DISABLE, "disabled")
  with pytest.raises(ValueError, match="jax_overlap: JAX_OVERLAP_DISABLE='disabled' is not a switch"):
    settings.disabled()


def test_workspace_info():
  info = jax_overlap.workspace_info()
  assert set(info) == WORKSPACE_KEYS
  assert info["active"] is False and info["used_bytes"] == 0 and info["regions"] == 0


def test_errors_and_shutdown_are_harmless():
  jax_overlap.check_errors()
  jax_overlap.clear_errors()
  jax_overlap.shutdown()
  assert jax_overlap.initialize()["active"] is False


def test_build_info():
  info = jax_overlap.build_info()
  assert {"jax", "platform", "archs", "compiler", "ffi_api", "fused_kernels"} <= set(info)
  assert info["jax"] == jax.__version__
  assert info["platform"] in (None, "cuda", "rocm")
  assert isinstance(info["fused_kernels"], bool)
  if info["platform"] is None:
    assert "XLA reference path" in info["note"]
  assert native.platform() == info["platform"]


def test_error_types():
  record = {"message": "ag_matmul: rank 1 waited 5.0 s for rank 3 (flag 7, epoch 12)", "rank": 1, "peer": 3}
  err = jax_overlap.PeerTimeoutError(record)
  assert isinstance(err, RuntimeError) and str(err) == record["message"] and err.record is record
  assert issubclass(jax_overlap.WorkspaceFullError, RuntimeError)


def test_trace_export_without_gpus(tmp_path):
  path = tmp_path / "trace.json"
  split = tracing.export(str(path))
  assert split == {kind: 0.0 for kind in tracing.KINDS}
  assert json.loads(path.read_text())["traceEvents"] == []


def test_no_gpu_means_no_workspace():
  """The fused lowering's gate: without a GPU the runtime never becomes active."""
  jax_overlap.initialize()
  assert workspace.is_active() is False


class _FailingStore:
  """A key-value client whose store is gone, as jax's raises it (RuntimeError)."""

  def key_value_set(self, key, value):
    raise RuntimeError(f"UNAVAILABLE: the coordination service is gone (setting {key})\nmore detail")

  def blocking_key_value_get(self, key, timeout_ms):
    raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")


@pytest.mark.parametrize("step", [lambda: processes.barrier("shutdown"), lambda: processes.gather("hosts", {})],
                         ids=["barrier", "gather"])
def test_a_failing_key_value_store_is_a_setup_error_at_every_step(monkeypatch, step):
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: 0)
  monkeypatch.setattr(processes, "client", _FailingStore)
  monkeypatch.setattr(processes, "prefix", lambda: "jax_overlap/1")
  with pytest.raises(errors.SetupError, match=r"could not publish jax_overlap/1/\S+: UNAVAILABLE: the coordination"):
    step()
