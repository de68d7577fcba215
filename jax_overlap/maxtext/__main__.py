"""python -m jax_overlap.maxtext CONFIG.yml key=value ...: MaxText's pre-training with jax_overlap's ops.

MaxText's pre-training arguments, plus these, taken out first (MaxText's config rejects keys it does not know);
each wins over its setting:
  jax_overlap_algorithm=auto|xla|pipelined|fused   JAX_OVERLAP_MAXTEXT_ALGORITHM
  jax_overlap_fp8=tensor|block                     JAX_OVERLAP_MAXTEXT_FP8: a 16-bit run's dense layers in float8
  jax_overlap_fp8_cast=auto|kernels|xla            JAX_OVERLAP_MAXTEXT_FP8_CAST
"""

from __future__ import annotations

import logging
import sys

from jax_overlap.maxtext import patches

OPTIONS = {"jax_overlap_algorithm": "algorithm", "jax_overlap_fp8": "fp8", "jax_overlap_fp8_cast": "fp8_cast"}


def take_options(argv: list) -> tuple[list, dict]:
  """(the rest of argv, enable()'s keyword arguments)."""
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
  # pylint: disable=import-outside-toplevel
  from absl import app
  from maxtext.trainers.pre_train import train
  app.run(train.main, argv=argv)


if __name__ == "__main__":
  main()
