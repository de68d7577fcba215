"""jax_overlap.maxtext without MaxText: the op each dense layer takes from the shardings MaxText's logical axis rules
give on a mesh (choice.py), the hook's modules under a mesh and while the model is built (hook.py), the census
line and its warning, and the options and version checks (patches.py, __main__.py). MaxText itself:
tests/maxtext/ (its own environment; skipped here without MaxText).
"""

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import fp8_ops
from jax.sharding import AbstractMesh

from jax_overlap.maxtext import __main__ as entry, choice, hook, patches

# MaxText 0.2.5's rules for the names below (configs/base.yml, in its order: a name's first rule whose mesh axes are
# free wins, as flax resolves them).
RULES = (
    ("activation_batch", ("data", "fsdp", "fsdp_transpose", "expert")),
    ("activation_length", ("context", "context_usp_ulysses")),
    ("activation_norm_length", ("tensor_sequence", "context", "context_usp_ulysses")),
    ("activation_embed", ("tensor",)),
    ("heads", ("tensor", "tensor_sequence", "autoregressive")),
    ("q_heads", ("tensor", "tensor_sequence", "autoregressive")),
    ("kv_heads", ("tensor", "tensor_sequence", "autoregressive")),
    ("kv", ()),
    ("kv_head_dim", ()),
    ("embed_router", ("fsdp", "fsdp_transpose", "context", "context_usp_ulysses")),
    ("mlp", ("fsdp_transpose", "tensor", "tensor_sequence", "autoregressive")),
    ("embed", ("fsdp", "fsdp_transpose", "context", "context_usp_ulysses", "expert")),
    ("embed", ("fsdp", "context", "context_usp_ulysses", "expert")),
)
AXES = ("data", "stage", "fsdp", "fsdp_transpose", "context", "context_usp_ulysses", "tensor", "tensor_sequence",
        "expert", "autoregressive")
# A llama2 decoder layer's dense kernels (attentions.py, linears.py) and how many dims each contracts.
KERNELS = {"query": (("embed", "q_heads", "kv"), 1), "key": (("embed", "kv_heads", "kv_head_dim"), 1),
           "value": (("embed", "kv_heads", "kv_head_dim"), 1), "out": (("heads", "kv", "embed"), 2),
           "wi_0": (("embed", "mlp"), 1), "wi_1": (("embed", "mlp"), 1), "wo": (("mlp", "embed"), 1),
           "router": (("embed_router", None), 1)}


def mesh_shape(**sizes) -> dict:
  return {a: sizes.get(a, 1) for a in AXES}


def ops(shape: dict) -> dict:
  return {name: choice.choose(axes, n, RULES, shape).op for name, (axes, n) in KERNELS.items()}


def test_tensor_sequence_parallelism_gathers_and_scatters():
  """ici_tensor_sequence_parallelism=4 x data 2 (the CI config): QKV and the up projections all-gather the rows,
  the attention output and the down projection reduce-scatter them; the MoE router stays a dot."""
  assert ops(mesh_shape(data=2, tensor_sequence=4)) == {
      "query": "ag_matmul", "key": "ag_matmul", "value": "ag_matmul", "out": "matmul_rs", "wi_0": "ag_matmul",
      "wi_1": "ag_matmul", "wo": "matmul_rs", "router": "dot"}
  picked = choice.choose(*KERNELS["query"], RULES, mesh_shape(data=2, tensor_sequence=4))
  assert picked.group == ("tensor_sequence",) and picked.group_size == 4 and picked.model_parallel


def test_fsdp_with_tensor_sequence_keeps_the_ops():
  """fsdp 2 x tensor_sequence 4: the kernels' embed dims on fsdp (gathered for the dot, as MaxText does) leave the
  choice as it was."""
  assert ops(mesh_shape(fsdp=2, tensor_sequence=4)) == ops(mesh_shape(data=2, tensor_sequence=4))


@pytest.mark.parametrize("sizes", [{"tensor": 4, "data": 2}, {"fsdp": 8}, {"tensor": 2, "tensor_sequence": 2},
                                   {"context": 2, "tensor_sequence": 2}])
def test_other_shardings_keep_the_dot(sizes):
  """Tensor parallelism alone (rows not sharded), FSDP alone, the rows on tensor_sequence with the kernels on tensor
  too, the rows on context and tensor_sequence with the kernels on tensor_sequence only: no layer's layout is the
  ops'."""
  assert set(ops(mesh_shape(**sizes)).values()) == {"dot"}
  tensor_parallel = choice.choose(*KERNELS["query"], RULES, mesh_shape(**sizes)).model_parallel
  assert tensor_parallel == ("tensor" in sizes or "tensor_sequence" in sizes)


def test_one_device():
  picked = choice.choose(*KERNELS["wo"], RULES, mesh_shape())
  assert picked.op == "dot" and picked.one_device


# --- the modules --------------------------------------------------------------------------------------------------

def _dense_call(module, x, w, dims, mesh=None):
  """module applied as DenseGeneral applies it: initialized without a mesh (the model being built), then called
  under the mesh and the logical axis rules."""
  variables = module.init(jax.random.key(0), x, w, dims)
  with nn.logical_axis_rules(RULES):
    if mesh is None:
      return module.apply(variables, x, w, dims), variables
    with jax.sharding.use_abstract_mesh(mesh):
      return jax.eval_shape(lambda: module.apply(variables, x, w, dims)), variables


@pytest.fixture
def census(monkeypatch):
  fresh = hook.Census()
  monkeypatch.setattr(hook, "CENSUS", fresh)
  return fresh


def test_overlap_dot_general_records_its_op_under_a_mesh(census):
  """Building the model (no mesh, initializing) is not counted; a call under the CI's mesh takes ag_matmul for a
  column-parallel kernel and is counted once however often it traces."""
  quant = hook.OverlapQuantization(rules=RULES)
  x, w = jnp.ones((2, 16, 64), jnp.float32), jnp.ones((64, 32), jnp.float32)
  dims = (((2,), (0,)), ((), ()))
  module = quant.dot_general_cls(mesh_axes=("embed", "mlp"))()
  assert isinstance(module, hook.OverlapDotGeneral)
  _dense_call(module, x, w, dims)
  assert census.counts() == {}
  mesh = AbstractMesh((2, 4), ("data", "tensor_sequence"))
  for _ in range(2):
    y, variables = _dense_call(module, x, w, dims, mesh)
  assert census.counts() == {"ag_matmul": 1} and y.shape == (2, 16, 32) and not jax.tree.leaves(variables)


def test_overlap_dot_general_value_is_the_dot(rng):
  """Without a mesh the module is lax.dot_general at the config's precision, bit for bit."""
  quant = hook.OverlapQuantization(rules=RULES, matmul_precision="highest")
  x = jnp.asarray(rng.standard_normal((2, 8, 4, 16)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((4, 16, 24)), jnp.float32)
  dims = (((2, 3), (0, 1)), ((), ()))
  y, _ = _dense_call(quant.dot_general_cls(mesh_axes=("heads", "kv", "embed"))(), x, w, dims)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.lax.dot_general(x, w, dims, precision="highest")))


@pytest.mark.parametrize("recipe", ["fp8", "nanoo_fp8"])
def test_fp8_modules_carry_flaxs_names_variables_and_formats(recipe, census):
  """MaxText names a dense layer's state after its module's class: Flax's names, Flax's variables; the nanoo
  recipe's formats are fnuz. Built without a mesh, a call is Flax's own op (its value, bit for bit)."""
  module_cls = hook.FP8_MODULES[recipe]
  flax_cls = {"fp8": nn.Fp8DirectDotGeneralOp, "nanoo_fp8": nn.NANOOFp8DotGeneralOp}[recipe]
  assert module_cls.__name__ == flax_cls.__name__
  assert hook.fp8_formats(recipe) == ((jnp.dtype(flax_cls.e4m3_dtype).name, jnp.dtype(flax_cls.e5m2_dtype).name)
                                      if recipe == "nanoo_fp8" else ("float8_e4m3fn", "float8_e5m2"))
  x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 64)), jnp.bfloat16)
  w = jnp.asarray(np.random.default_rng(2).standard_normal((64, 32)), jnp.bfloat16)
  dims = (((1,), (0,)), ((), ()))
  ours = module_cls(kernel_axes=("embed", "mlp"), rules=RULES)
  y, variables = _dense_call(ours, x, w, dims)
  flax_variables = flax_cls().init(jax.random.key(0), x, w, dims)
  for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(flax_variables)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(y, np.float32),
                                np.asarray(flax_cls().apply(flax_variables, x, w, dims), np.float32))
  assert census.counts() == {}


def test_fp8_module_on_one_device_is_the_group_of_one(census):
  module = hook.Fp8DirectDotGeneralOp(kernel_axes=("embed", "mlp"), rules=RULES)
  x, w = jnp.ones((4, 64), jnp.bfloat16), jnp.ones((64, 32), jnp.bfloat16)
  _dense_call(module, x, w, (((1,), (0,)), ((), ())), AbstractMesh((1, 1), ("data", "tensor_sequence")))
  assert census.counts() == {hook.LOCAL: 1}


@pytest.mark.parametrize("fp8_cast,kernel_casts", [("auto", 0), ("kernels", 4), ("xla", 0)])
def test_fp8_modules_cast_as_the_fp8_cast_option_says(fp8_cast, kernel_casts, census, monkeypatch):
  """The option fp8_cast reaches the fp8 recipe's layers as their cast_algorithm: on one GPU (the stand-in
  runtime's), x, the kernel and the cotangent cast by the cast kernels ("kernels") or by XLA ("xla", and "auto"
  in MaxText)."""
  from fake_gpu import FakeNative, cuda_text, custom_calls, install
  install(monkeypatch.setattr, FakeNative())
  module = hook.Fp8DirectDotGeneralOp(kernel_axes=("embed", "mlp"), rules=RULES,
                                      cast_algorithm=hook.layer_cast_algorithm(fp8_cast))
  x, w = jnp.ones((64, 128), jnp.bfloat16), jnp.ones((128, 256), jnp.bfloat16)
  dims = (((1,), (0,)), ((), ()))
  variables = module.init(jax.random.key(0), x, w, dims)

  def loss(variables, x, w):
    with nn.logical_axis_rules(RULES), jax.sharding.use_abstract_mesh(AbstractMesh((1, 1), ("data", "tensor"))):
      return jnp.sum(module.apply(variables, x, w, dims).astype(jnp.float32))
  calls = custom_calls(cuda_text(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), variables, x, w))
  casts = [c for c in calls if "@jax_overlap_fp8_cast" in c]
  assert census.counts() == {hook.LOCAL: 1} and any("@jax_overlap_vendor_gemm" in c for c in calls)
  assert len(casts) == kernel_casts, casts


@pytest.mark.parametrize("fp8_cast,layer_cast", [("auto", "xla"), ("kernels", "kernels"), ("xla", "xla")])
def test_a_16_bit_runs_fp8_layers_cast_as_the_option_says(fp8_cast, layer_cast, census, monkeypatch):
  """OverlapDotGeneral with fp8="tensor" builds its float8 layer with the option's cast_algorithm ("auto": XLA's)."""
  built = []
  real = hook.Fp8AgDotGeneral
  monkeypatch.setattr(hook, "Fp8AgDotGeneral",
                      lambda **fields: built.append(fields["cast_algorithm"]) or real(**fields))
  quant = hook.OverlapQuantization(rules=RULES, fp8="tensor", fp8_cast=fp8_cast)
  module = quant.dot_general_cls(mesh_axes=("embed", "mlp"))()
  x, w = jnp.ones((2, 16, 64), jnp.bfloat16), jnp.ones((64, 32), jnp.bfloat16)
  _dense_call(module, x, w, (((2,), (0,)), ((), ())), AbstractMesh((2, 4), ("data", "tensor_sequence")))
  assert census.counts() == {"ag_matmul": 1} and set(built) == {layer_cast}


def test_a_gpu_algorithm_refuses_a_group_larger_than_it_takes(census):
  quant = hook.OverlapQuantization(rules=RULES, algorithm="pipelined")
  module = quant.dot_general_cls(mesh_axes=("embed", "mlp"))()
  x, w = jnp.ones((2, 32, 64), jnp.float32), jnp.ones((64, 32), jnp.float32)
  with pytest.raises(ValueError, match=r"algorithm='pipelined' takes groups of at most 8 ranks, and MaxText's mesh "
                                       r"shards the activation's rows over \('tensor_sequence',\) \(16 ranks\)"):
    _dense_call(module, x, w, (((2,), (0,)), ((), ())), AbstractMesh((16,), ("tensor_sequence",)))


# --- the census -------------------------------------------------------------------------------------------------

def _record(census, shape: dict):
  for site, (axes, n) in enumerate(KERNELS.values()):
    picked = choice.choose(axes, n, RULES, shape)
    census.record(site, picked.op, picked)


def test_census_logs_the_counts_once(census, caplog):
  _record(census, mesh_shape(data=2, tensor_sequence=4))
  with caplog.at_level(logging.INFO, logger="jax_overlap.maxtext"):
    census.report()
    census.report()
  lines = [r for r in caplog.records if r.name == "jax_overlap.maxtext"]
  assert len(lines) == 1 and lines[0].levelno == logging.INFO
  assert "dense layers by op: ag_matmul 5, matmul_rs 2, local 0, dot 1" in lines[0].getMessage()


def test_census_warns_once_when_tensor_parallelism_gathers_nothing(census, caplog):
  _record(census, mesh_shape(data=2, tensor=4))
  with caplog.at_level(logging.INFO, logger="jax_overlap.maxtext"):
    census.report()
  warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warnings) == 1 and "ici_tensor_sequence_parallelism" in warnings[0].getMessage()
  assert "ag_matmul 0, matmul_rs 0, local 0, dot 8" in caplog.records[0].getMessage()


def test_census_does_not_warn_without_model_parallelism(census, caplog):
  _record(census, mesh_shape(fsdp=8))
  with caplog.at_level(logging.INFO, logger="jax_overlap.maxtext"):
    census.report()
  assert not [r for r in caplog.records if r.levelno == logging.WARNING]


# --- options, versions, the entry point's arguments ---------------------------------------------------------------

@pytest.mark.parametrize("algorithm,fp8,fp8_cast,match", [("fastest", "", "auto", "algorithm must be one of"),
                                                          ("auto", "delayed", "auto", "fp8 must be one of"),
                                                          ("auto", "", "kernel", "fp8_cast must be one of")])
def test_bad_options_are_errors(algorithm, fp8, fp8_cast, match):
  with pytest.raises(ValueError, match=f"jax_overlap.maxtext: {match}"):
    patches.check_options(algorithm, fp8, fp8_cast)


def test_an_untested_maxtext_release_is_an_error_naming_the_tested_one():
  patches.check_version("0.2.5")
  with pytest.raises(RuntimeError, match=r"supports MaxText 0\.2\.5 .* has MaxText 0\.3\.0: pip install "
                                         r"maxtext==0\.2\.5"):
    patches.check_version("0.3.0")


def test_enable_without_maxtext_says_what_to_install(monkeypatch):
  import importlib.metadata
  def missing(name):
    raise importlib.metadata.PackageNotFoundError(name)
  monkeypatch.setattr(importlib.metadata, "version", missing)
  with pytest.raises(ImportError,
                     match=r"needs MaxText, which this Python does not have: pip install maxtext==0\.2\.5"):
    patches.enable()


def test_the_entry_point_takes_its_options_out_of_maxtexts_arguments():
  argv = ["prog", "base.yml", "steps=3", "jax_overlap_algorithm=xla", "jax_overlap_fp8=tensor", "run_name=a=b",
          "jax_overlap_fp8_cast=xla"]
  rest, options = entry.take_options(argv)
  assert rest == ["prog", "base.yml", "steps=3", "run_name=a=b"]
  assert options == {"algorithm": "xla", "fp8": "tensor", "fp8_cast": "xla"}


def test_flax_ops_are_the_stock_modules():
  assert hook.Fp8DirectDotGeneralOp.stock is fp8_ops.Fp8DirectDotGeneralOp
  assert hook.NANOOFp8DotGeneralOp.stock is fp8_ops.NANOOFp8DotGeneralOp


# --- what configure_quantization returns, and the recipes it refuses ---------------------------------------------

class _Config:
  """The fields of MaxText's config that patches.quantization reads."""

  def __init__(self, quantization="", **fields):
    self.quantization, self.logical_axis_rules, self.matmul_precision = quantization, [list(r) for r in RULES], "high"
    self.use_qwix_quantization = fields.get("use_qwix_quantization", False)


@pytest.fixture
def options(monkeypatch):
  def set_options(algorithm="auto", fp8="", fp8_cast="auto"):
    monkeypatch.setattr(patches, "_options", {"algorithm": algorithm, "fp8": fp8, "fp8_cast": fp8_cast})
  set_options()
  return set_options


def _quantization(config, mode="train"):
  return patches.quantization(config, mode, lambda config, quant_mode_str: f"maxtext's {quant_mode_str}")


def test_a_16_bit_run_gets_the_overlap_object(options):
  options(algorithm="xla", fp8="tensor", fp8_cast="xla")
  quant = _quantization(_Config(""))
  assert isinstance(quant, hook.OverlapQuantization) and quant.stock() is None
  assert (quant.algorithm, quant.fp8, quant.fp8_cast, quant.matmul_precision, quant.rules) == \
      ("xla", "tensor", "xla", "high", RULES)
  module = quant.dot_general_cls(mesh_axes=("embed", "mlp"))()
  assert (module.fp8, module.fp8_cast) == ("tensor", "xla")
  assert _quantization(_Config(""), "serve") == "maxtext's serve"  # serving keeps MaxText's objects


@pytest.mark.parametrize("config,algorithm,fp8,match", [
    (_Config("int8"), "auto", "", "quantization='int8' is not a recipe jax_overlap runs"),
    (_Config("fp8", use_qwix_quantization=True), "auto", "", "quantization='fp8' with use_qwix_quantization=true"),
    (_Config("fp8"), "auto", "block", "fp8='block' .* is for 16-bit runs, and MaxText's quantization='fp8' is set"),
    (_Config("fp8"), "fused", "", "algorithm='fused' is 16-bit only"),
])
def test_what_the_integration_does_not_take_is_an_error(options, config, algorithm, fp8, match):
  options(algorithm=algorithm, fp8=fp8)
  with pytest.raises(ValueError, match=f"jax_overlap.maxtext: {match}"):
    _quantization(config)


def test_a_recipe_the_gpu_cannot_run_is_an_error_naming_the_other(options, monkeypatch):
  """nanoo_fp8 (fnuz) on an sm_90 (the stand-in runtime's GPUs): refused before the model is built."""
  from fake_gpu import FakeNative, install
  install(monkeypatch.setattr, FakeNative())
  with pytest.raises(ValueError, match=r"quantization='nanoo_fp8' computes in float8_e4m3fnuz and float8_e5m2fnuz, "
                                       r"and this process cannot run float8_e\w+ on this device .*sm_90.*gfx942; use "
                                       r"quantization='fp8'"):
    _quantization(_Config("nanoo_fp8"))
