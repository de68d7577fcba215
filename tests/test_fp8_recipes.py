"""The fp8 recipes (quantization/recipes.py) and the float8 layers' set-up and mistakes: a recipe is one class and
one registration, the layers hold one and branch on none, tracing a layer sets nothing up on a GPU, and a layer
used wrongly says what to change."""

import ast
import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fake_gpu import FakeNative, cuda_text, install
from flax import linen as nn
from jax.sharding import PartitionSpec as P

import jax_overlap
from jax_overlap.layers import fp8 as fp8_layers
from jax_overlap.quantization import recipes
from jax_overlap.runtime import backend

DN = (((1,), (0,)), ((), ()))
LAYERS = pathlib.Path(jax_overlap.__file__).parent / "layers"


def _vjp(layer, x, w, dy):
  y, pullback = jax.vjp(lambda x, w: layer(x, w, DN), x, w)
  return (y, *pullback(dy))


def test_registry_names_each_recipe_once():
  assert {name: cls.name for name, cls in recipes.RECIPES.items()} == {"tensor": "tensor", "block": "block",
                                                                        "delayed": "delayed"}
  assert recipes.stateless() == ("tensor", "block")
  assert jax_overlap.Fp8AgDotGeneral(scaling="block").recipe == recipes.BlockRecipe()
  with pytest.raises(ValueError, match="needs a name of its own, got 'tensor'"):
    recipes.register(type("Again", (recipes.TensorRecipe,), {}))


@pytest.mark.parametrize("cls", ["Fp8AgDotGeneral", "Fp8RsDotGeneral"])
def test_a_recipe_is_one_class_and_one_registration(cls, monkeypatch, normal):
  """A recipe of its own (here current scaling whose cotangent takes the forward's e4m3 format) runs through both
  layers, forward and backward, once registered: no layer code names it."""
  class E4m3Gradients(recipes.TensorRecipe):
    name = "e4m3_gradients"

    def cotangent(self, d, kept, call):
      return super().cotangent(d, kept, dataclasses.replace(call, e5m2=call.e4m3))

  monkeypatch.setitem(recipes.RECIPES, E4m3Gradients.name, E4m3Gradients)
  x, w, dy = normal((32, 64), "float32"), normal((64, 16), "float32"), normal((32, 16), "float32")
  layer = getattr(jax_overlap, cls)
  y, dx, dw = jax.jit(lambda x, w, dy: _vjp(layer(scaling="e4m3_gradients"), x, w, dy))(x, w, dy)
  ty, tdx, tdw = jax.jit(lambda x, w, dy: _vjp(layer(), x, w, dy))(x, w, dy)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(ty))  # the same forward
  assert not np.array_equal(np.asarray(dx), np.asarray(tdx))  # another cotangent format
  want_dx, want_dw = dy.astype(np.float64) @ w.T.astype(np.float64), x.T.astype(np.float64) @ dy.astype(np.float64)
  for got, want in ((dx, want_dx), (dw, want_dw)):
    assert np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want) < 0.1
  text = str(jax.make_jaxpr(lambda x, w, dy: _vjp(layer(scaling="e4m3_gradients"), x, w, dy))(x, w, dy))
  assert "e5m2" not in text and "e4m3fn" in text


def test_the_layers_branch_on_no_recipe_and_share_only_public_pieces():
  """Issue 53 item 1: no `.blocks` test in the layers, and no layer module reads another's private names."""
  modules = {p.stem: p.read_text() for p in LAYERS.glob("*.py")}
  assert all(".blocks" not in text for text in modules.values())
  for name, text in modules.items():
    private = sorted({f"{node.value.id}.{node.attr}" for node in ast.walk(ast.parse(text))
                      if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                      and node.value.id in modules and node.attr.startswith("_")})
    assert not private, f"layers/{name}.py reads {private}"


def test_stateful_recipe_needs_the_module_that_holds_its_state():
  with pytest.raises(ValueError, match=r"Fp8AgDotGeneral: scaling='delayed' keeps state between steps; use "
                                       r"jax_overlap.Fp8DelayedAgDotGeneral"):
    jax_overlap.Fp8AgDotGeneral(scaling="delayed")


# --- issue 52 item 7: tracing sets nothing up on a GPU -------------------------------------------------------

@pytest.mark.parametrize("cls", ["Fp8AgDotGeneral", "Fp8RsDotGeneral"])
def test_tracing_with_algorithm_xla_sets_up_no_device(cls, monkeypatch, normal):
  """family=None decides the float8 formats from what jax says of its devices: lowering a call for a GPU with
  algorithm="xla" makes no device state (no init_device) and allocates nothing."""
  fake = FakeNative()
  install(monkeypatch.setattr, fake)
  x, w, dy = normal((32, 64), "bfloat16"), normal((64, 16), "bfloat16"), normal((32, 16), "bfloat16")
  text = cuda_text(jax.jit(lambda x, w, dy: _vjp(getattr(jax_overlap, cls)(algorithm="xla"), x, w, dy)), x, w, dy)
  assert "f8E4M3FN" in text
  assert fake.calls == [] and fake.workspaces == {}
  assert not backend.current().state.prepared


class _Gpu:
  """A jax device as ROCm's jax describes one (its gfx arch in compute_capability)."""

  def __init__(self, device, arch):
    self.device, self.compute_capability = device, arch

  def __getattr__(self, name):
    return getattr(self.device, name)


@pytest.mark.parametrize("arch,family", [("gfx942", "fnuz"), ("gfx950", "ocp"), ("9.0", "ocp")])
def test_family_of_the_gpus_without_their_device_state(arch, family, monkeypatch):
  fake = FakeNative()
  install(monkeypatch.setattr, fake, gpus=lambda: [_Gpu(d, arch) for d in jax.local_devices()])
  assert fp8_layers.gpu_family() == family
  assert fake.calls == []


# --- issue 52 item 12: mistakes with clear errors ------------------------------------------------------------

UNBOUND = r"axis_name 'tp' is not bound here \({}\); call it inside jax.shard_map over a mesh with that axis, or " \
          r"pass axis_name=None for global arrays under jit"


@pytest.mark.parametrize("cls", ["AgDotGeneral", "Fp8AgDotGeneral", "Fp8RsDotGeneral"])
def test_axis_name_the_enclosing_shard_map_lacks(cls, make_mesh, normal):
  """A float8 layer given an axis that shard_map does not bind says so as the 16-bit layer does (it raised a bare
  AssertionError from JAX's pcast), and outside shard_map the same (it raised JAX's "please call pvary")."""
  layer = getattr(jax_overlap, cls)(axis_name="tp")
  x, w = normal((16, 32), "float32"), normal((32, 16), "float32")
  mesh = make_mesh((2,), ("dp",))
  inside = jax.shard_map(lambda x, w: layer(x, w, DN), mesh=mesh, in_specs=(P("dp"), P()), out_specs=P("dp"))
  with pytest.raises(ValueError, match=f"{cls}: " + UNBOUND.format(r"the axes bound here are \(.dp.,\)")):
    jax.eval_shape(inside, x, w)
  with pytest.raises(ValueError, match=f"{cls}: " + UNBOUND.format("no axis is bound here")):
    jax.eval_shape(lambda x, w: layer(x, w, DN), x, w)


def test_delayed_layer_axis_name_outside_shard_map(normal):
  x, w = normal((16, 32), "float32"), normal((32, 16), "float32")
  with pytest.raises(ValueError, match="Fp8DelayedAgDotGeneral: " + UNBOUND.format("no axis is bound here")):
    jax_overlap.Fp8DelayedAgDotGeneral(axis_name="tp").init(jax.random.key(0), x, w, DN)


@pytest.mark.parametrize("cls", ["AgDotGeneral", "RsDotGeneral", "Fp8AgDotGeneral", "Fp8RsDotGeneral"])
def test_an_instance_as_dot_general_cls(cls, normal):
  """linen instantiates dot_general_cls with no arguments: an instance there says to pass the class (it raised
  Flax's generic "missing 3 required positional arguments")."""
  dense = nn.Dense(16, dot_general_cls=getattr(jax_overlap, cls)())
  with pytest.raises(TypeError, match=rf"{cls}: an instance was called with no operands, as a layer calls "
                                      rf"dot_general_cls\(\) to make its dot: pass the class, "
                                      rf"dot_general_cls=jax_overlap.{cls} "):
    dense.init(jax.random.key(0), jnp.asarray(normal((8, 32), "float32")))
