"""enable(): the MaxText functions the integration wraps, once each however often it runs.
  quantizations.configure_quantization  hook.py's object for a training run (read at call time: the next model)
  nnx_wrappers.ToNNX.__init__  no rngs for OverlapDotGeneral: forking them would shift every later kernel's key
      and so the initial weights (the fp8 modules fork, as Flax's do)
  moe.RoutedMoE.__init__  MaxText's own quantization object: experts keep MaxText's einsums
  models.Transformer.__call__  logs the census after the first trace under a mesh
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect

from jax_overlap import api, planning
from jax_overlap.maxtext import hook, settings

# The hook and the functions above change between releases.
TESTED_MAXTEXT = ("0.2.5",)
RECIPES = ("", "fp8", "nanoo_fp8")
_options = {}


def _maxtext_version() -> str:
  try:
    return importlib.metadata.version("maxtext")
  except importlib.metadata.PackageNotFoundError:
    raise ImportError(f"jax_overlap.maxtext needs MaxText, which this Python does not have: pip install "
                      f"maxtext=={TESTED_MAXTEXT[-1]} (its import needs: tests/maxtext/requirements.txt)") from None


def check_version(version: str) -> None:
  if version not in TESTED_MAXTEXT:
    raise RuntimeError(f"jax_overlap.maxtext supports MaxText {', '.join(TESTED_MAXTEXT)} (the release it is tested "
                       f"with: the dense layers' quantization hook it plugs into changes between releases), and this "
                       f"Python has MaxText {version}: pip install maxtext=={TESTED_MAXTEXT[-1]}")


def _once(owner, name: str, make) -> None:
  current = getattr(owner, name)
  if not getattr(current, "_jax_overlap", False):
    wrapped = make(current)
    wrapped._jax_overlap = True
    setattr(owner, name, wrapped)


def check_options(algorithm: str, fp8: str, fp8_cast: str) -> None:
  if algorithm not in api.ALGORITHMS:
    raise ValueError(f"jax_overlap.maxtext: algorithm must be one of {api.ALGORITHMS}, got {algorithm!r}")
  if fp8 not in settings.FP8_CHOICES:
    raise ValueError(f"jax_overlap.maxtext: fp8 must be one of {settings.FP8_CHOICES} ('': MaxText's "
                     f"quantization decides), got {fp8!r}")
  if fp8_cast not in settings.FP8_CAST_CHOICES:
    raise ValueError(f"jax_overlap.maxtext: fp8_cast must be one of {settings.FP8_CAST_CHOICES} (the float8 "
                     f"layers' casts: 'auto' or 'xla', XLA's; 'kernels', the cast kernels), got {fp8_cast!r}")


def quantization(config, quant_mode_str: str, original):
  stock = original(config, quant_mode_str=quant_mode_str)
  if quant_mode_str != "train":
    return stock
  algorithm, fp8, fp8_cast = _options["algorithm"], _options["fp8"], _options["fp8_cast"]
  recipe = str(getattr(config.quantization, "value", config.quantization) or "")  # MaxText's enum, or its text
  if recipe not in RECIPES:
    raise ValueError(f"jax_overlap.maxtext: quantization={recipe!r} is not a recipe jax_overlap runs (it takes "
                     f"{', '.join(repr(r) for r in RECIPES)}); run MaxText's own entry point for it")
  if recipe and getattr(config, "use_qwix_quantization", False):
    raise ValueError(f"jax_overlap.maxtext: quantization={recipe!r} with use_qwix_quantization=true runs Qwix's "
                     f"rewrite, not the dense layers' hook; set use_qwix_quantization=false")
  rules = tuple((name, tuple(axes) if isinstance(axes, (list, tuple)) else axes)
                for name, axes in config.logical_axis_rules)
  if not recipe:
    return hook.OverlapQuantization(rules=rules, algorithm=algorithm, fp8=fp8, fp8_cast=fp8_cast,
                                    matmul_precision=config.matmul_precision)
  if fp8:
    raise ValueError(f"jax_overlap.maxtext: fp8={fp8!r} (jax_overlap's own fp8 layers) is for 16-bit runs, and "
                     f"MaxText's quantization={recipe!r} is set too; choose one")
  if algorithm == "fused":
    raise ValueError(f"jax_overlap.maxtext: algorithm='fused' is 16-bit only, and quantization={recipe!r} computes in "
                     f"float8; use jax_overlap_algorithm=auto or pipelined")
  e4m3, e5m2 = hook.fp8_formats(recipe)
  declined = planning.fp8_declined(e4m3, e5m2)
  if declined:
    other = {"fp8": "nanoo_fp8", "nanoo_fp8": "fp8"}[recipe]
    raise ValueError(f"jax_overlap.maxtext: quantization={recipe!r} computes in {e4m3} and {e5m2}, and this process "
                     f"cannot run {declined}; use quantization={other!r}")
  return hook.fp8_quantization(recipe)(rules=rules, algorithm=algorithm, fp8_cast=fp8_cast)


def _configure_quantization(original):
  @functools.wraps(original)
  def configure_quantization(config, quant_mode_str: str = "train"):
    return quantization(config, quant_mode_str, original)
  return configure_quantization


def _tonnx_init(original):
  @functools.wraps(original)
  def __init__(self, module, rngs=None):
    original(self, module, None if isinstance(module, hook.OverlapDotGeneral) else rngs)
  return __init__


def _moe_init(original):
  signature = inspect.signature(original)

  @functools.wraps(original)
  def __init__(*args, **kwargs):
    bound = signature.bind(*args, **kwargs)
    quant = bound.arguments.get("quant")
    if quant is not None and hasattr(quant, "stock"):
      bound.arguments["quant"] = quant.stock()
    return original(*bound.args, **bound.kwargs)
  return __init__


def _transformer_call(original):
  @functools.wraps(original)
  def __call__(*args, **kwargs):
    out = original(*args, **kwargs)
    hook.CENSUS.report()
    return out
  return __call__


def enable(*, algorithm: str | None = None, fp8: str | None = None, fp8_cast: str | None = None) -> None:
  """Make MaxText's dense layers run jax_overlap's ops; call before MaxText builds its model. Takes quantization "",
  "fp8" and "nanoo_fp8"; weights, state names and checkpoints stay stock MaxText's. algorithm: "auto", "xla",
  "pipelined" or "fused". fp8: "", "tensor" or "block" (a 16-bit run's dense layers in float8). fp8_cast: "auto"
  (hook.AUTO_FP8_CAST), "xla" or "kernels". Each defaults to its JAX_OVERLAP_MAXTEXT_* setting. Raises ImportError
  without MaxText, RuntimeError for an untested release."""
  algorithm = settings.algorithm() if algorithm is None else algorithm
  fp8 = settings.fp8() if fp8 is None else fp8
  fp8_cast = settings.fp8_cast() if fp8_cast is None else fp8_cast
  check_options(algorithm, fp8, fp8_cast)
  check_version(_maxtext_version())
  # pylint: disable=import-outside-toplevel
  from maxtext.layers import moe, nnx_wrappers, quantizations
  from maxtext.models import models
  _options.update(algorithm=algorithm, fp8=fp8, fp8_cast=fp8_cast)
  _once(quantizations, "configure_quantization", _configure_quantization)
  _once(nnx_wrappers.ToNNX, "__init__", _tonnx_init)
  _once(moe.RoutedMoE, "__init__", _moe_init)
  _once(models.Transformer, "__call__", _transformer_call)
