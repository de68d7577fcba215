"""python -m jax_overlap.maxtext CONFIG.yml key=value ...: MaxText's pre-training with jax_overlap's ops.

The arguments are those of `python -m maxtext.trainers.pre_train.train`, plus jax_overlap's own options as
key=value, taken out before MaxText reads the rest (its config rejects keys it does not know):
  jax_overlap_algorithm=auto|xla|pipelined|fused   the ops' algorithm (setting JAX_OVERLAP_MAXTEXT_ALGORITHM)
  jax_overlap_fp8=tensor|block                     a 16-bit run's dense layers in jax_overlap's float8
                                                   (setting JAX_OVERLAP_MAXTEXT_FP8)
  jax_overlap_fp8_cast=auto|kernels|xla            the float8 layers' casts: XLA's ("auto" too), or the cast
                                                   kernels (setting JAX_OVERLAP_MAXTEXT_FP8_CAST)
A key=value wins over its setting. The census of the ops the layers took is logged at INFO to stderr.
"""

from __future__ import annotations

import logging
import sys

from jax_overlap.maxtext import patches

OPTIONS = {"jax_overlap_algorithm": "algorithm", "jax_overlap_fp8": "fp8", "jax_overlap_fp8_cast": "fp8_cast"}


def take_options(argv: list) -> tuple[list, dict]:
  """(argv without jax_overlap's key=value arguments, enable()'s keyword arguments from them)."""
  rest, options = [], {}
  for arg in argv:
    key, sep, value = arg.partition("=")
    if sep and key in OPTIONS:
      options[OPTIONS[key]] = value
    else:
      rest.append(arg)
  return rest, options


def main(argv: list | None = None) -> None:
  argv, options = take_options(list(sys.argv if argv is None else argv))
  logger = logging.getLogger("jax_overlap.maxtext")
  if not logger.handlers:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
  patches.enable(**options)
  # pylint: disable=import-outside-toplevel  (MaxText is optional: imported only here)
  from absl import app
  from maxtext.trainers.pre_train import train
  app.run(train.main, argv=argv)


if __name__ == "__main__":
  main()
