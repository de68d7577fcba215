"""The runtime's errors."""

from __future__ import annotations


class PeerTimeoutError(RuntimeError):
  """A kernel gave up waiting for a peer. `record` holds op, rank, peer, epoch, flag."""

  def __init__(self, record: dict):
    super().__init__(record["message"])
    self.record = record


class WorkspaceFullError(RuntimeError):
  """A call needs more symmetric workspace than is left."""


class SetupError(RuntimeError):
  """A call's setup failed (GPU memory, a measurement, the vendor BLAS, a peer): `auto` takes the XLA path."""
