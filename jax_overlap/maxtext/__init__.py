"""jax_overlap in MaxText: enable() makes MaxText's dense layers run jax_overlap's ops (docs/maxtext.md). Importing
this package needs flax, not MaxText; its settings (JAX_OVERLAP_MAXTEXT_*) are checked at import.

  import jax_overlap.maxtext
  jax_overlap.maxtext.enable()   # before MaxText builds its model; then MaxText's train.main(argv)
"""

from jax_overlap.maxtext import settings as _settings
from jax_overlap.maxtext.patches import TESTED_MAXTEXT, enable

_settings.check_all()

__all__ = ["enable", "TESTED_MAXTEXT"]
