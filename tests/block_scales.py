"""The float64 oracle of float8 block scales, shared by the CPU tests, the GPU tests and the multi-process
scenarios."""

import numpy as np


def dequantized(q, scale):
  """q in float64, each element times its block's scale: scale has q's rank, each dim q's or a 128th of it."""
  v = np.asarray(np.asarray(q).astype(np.float32), np.float64)
  s = np.asarray(scale, np.float64)
  for d in range(s.ndim):
    if s.shape[d] != v.shape[d]:
      s = np.repeat(s, v.shape[d] // s.shape[d], axis=d)
  return v * s
