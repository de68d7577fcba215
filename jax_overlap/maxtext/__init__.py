"""jax_overlap in MaxText: enable() makes MaxText's dense layers run jax_overlap's ops (the top of the package).

  choice.py    which op a dense layer takes, from the shardings its kernel and activation resolve to
  hook.py      MaxText's quantization hook: the objects configure_quantization returns, the linen modules the
               dense layers build from them, and the census of the ops they took
  patches.py   enable(): what it replaces in MaxText, and the checks of the MaxText release and the options
  __main__.py  python -m jax_overlap.maxtext CONFIG.yml key=value ...: MaxText's pre-training with enable()
  settings.py  the JAX_OVERLAP_MAXTEXT_* settings (checked at import, as the runtime's are at jax_overlap's)

MaxText is imported by enable() and the entry point only: importing this package needs flax, not MaxText.
Documentation: docs/maxtext.md.

  import jax_overlap.maxtext
  jax_overlap.maxtext.enable()   # before MaxText builds its model; then MaxText's train.main(argv)
"""

from jax_overlap.maxtext import settings as _settings
from jax_overlap.maxtext.patches import TESTED_MAXTEXT, enable

_settings.check_all()

__all__ = ["enable", "TESTED_MAXTEXT"]
