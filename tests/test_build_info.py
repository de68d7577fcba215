"""What a newcomer reads first: build_info() on this machine, and the DEBUG log of the path each call took."""

import logging

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap
from jax_overlap import native


def test_build_info_says_what_runs_here():
  """No GPU in this process: whatever was built, the calls take the XLA path, and build_info says so."""
  info = jax_overlap.build_info()
  assert info["runs"].startswith("the XLA path")
  if info["platform"] is None:
    assert info["runs"] == "the XLA path (no native extension in this installation)"
  else:  # a GPU build (CI's CUDA build) on a machine without that GPU
    assert f"built for {info['platform']}, but this process has no {info['platform']} devices" in info["runs"]
    assert "JAX backend: cpu" in info["runs"]


def test_build_info_never_shows_import_machinery():
  """A pure-Python install used to report Python's 'circular import' wording for the missing module."""
  info = jax_overlap.build_info()
  text = " ".join(str(v) for v in info.values())
  assert "circular import" not in text and "partially initialized" not in text
  if native.module() is None:
    assert info["note"].startswith("no native extension in this installation")


def test_debug_log_names_the_path(caplog, make_mesh):
  mesh = make_mesh((4,), ("tp",))
  x, w = np.ones((16, 32), np.float32), np.ones((32, 16), np.float32)
  with caplog.at_level(logging.DEBUG, logger="jax_overlap"):
    jax.jit(jax.shard_map(lambda x, w: jax_overlap.ag_matmul(x, w, axis_name="tp"), mesh=mesh,
                          in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"))).lower(x, w).compile()
    args = (jax.device_put(x, NamedSharding(mesh, P(None, "tp"))), jax.device_put(w, NamedSharding(mesh, P("tp"))))
    jax.jit(jax_overlap.matmul_rs).lower(*args).compile()  # K sharded alike, nothing asks for a scatter
    jax.jit(jax_overlap.ag_matmul).lower(*args).compile()  # w's columns are not sharded
  text = caplog.text
  assert "jax_overlap.ag_matmul: XLA path (lowered for cpu)" in text
  assert "jax_overlap.matmul_rs: global arrays, all-reduce over ('tp',)" in text
  assert "jax_overlap.ag_matmul: global arrays, plain partitioning (" in text
