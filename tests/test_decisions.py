"""Deciding a call's path: alike on every process, XLA on a failed resource, call sites named by where they sit.

The real runtime and lowering run over a stand-in native module (fake_gpu.py)
that takes CPU devices for GPUs; lowering for "cuda" shows what a GPU would get.
Several processes: two jax.distributed processes on this machine, as two hosts
(two_hosts.py), each with 4 devices, figures and failures of its own.
"""

import logging
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_overlap
from jax_overlap import planning
from jax_overlap.runtime import processes
from jax_overlap.ops import OPS
from jax_overlap.planning import pipelined
from jax_overlap.runtime import errors
from jax_overlap.planning import agreement

import fake_gpu
import two_processes

# The calls' per-rank GEMM: with the model GPU of fake_gpu, overlapping the gather pays (pipelined).
ROWS, K, N = 4096, 8192, 2048


def _ag(mesh, algorithm, name="layer"):
  def body(x, w):
    return jax_overlap.ag_matmul(x, w, axis_name="tp", algorithm=algorithm)

  body.__name__ = body.__qualname__ = name  # its module: jit_<name>
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")))


def _operands(mesh, sharded=True):
  world = mesh.shape["tp"]
  specs, shapes = (P("tp"), P(None, "tp")), ((world * ROWS, K), (K, world * N))
  return [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec) if sharded else None)
          for shape, spec in zip(shapes, specs)]


def _calls(f, *args):
  text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  return [line for line in text.splitlines() if "stablehlo.custom_call @jax_overlap" in line]


def _site(line) -> int:
  return int(re.search(r"site = (\d+)", line).group(1))


# --- several processes ------------------------------------------------------------

@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
  """Both processes' records of every scenario of two_hosts.py."""
  return two_processes.run("two_hosts.py", tmp_path_factory.mktemp("two_hosts"))


def _scenario(two_hosts, name):
  records = [two_hosts[r][name] for r in range(2)]
  for r, record in enumerate(records):
    # A collective step one process skipped would stall the other for the 20 s key-value timeout.
    assert record["seconds"] < 10, f"process {r} took {record['seconds']:.1f} s in {name}"
  return records


def test_processes_with_different_timings_decide_alike(two_hosts):
  # Process 1's GEMMs time 100 times slower; alone it would take the XLA path. Both take process 0's figures.
  first, second = _scenario(two_hosts, "figures")
  assert first["errors"] == second["errors"] == {}
  for op in ("ag_matmul", "matmul_rs"):
    assert len(first["calls"][op]) == 1 and f"@jax_overlap_{op}_pipelined(" in first["calls"][op][0]
    assert first["calls"][op] == second["calls"][op]


def test_a_group_across_hosts_takes_xla_without_setting_anything_up(two_hosts):
  for record in _scenario(two_hosts, "hosts"):
    assert record["calls"] == {"auto": []} and record["active"] is False
    assert "cannot take this call: the group (0, 1, 2, 3, " in record["errors"]["pipelined"]
    assert "spans hosts ['host-0', 'host-1']" in record["errors"]["pipelined"]


@pytest.mark.parametrize("failure,what", [("blas", "process 1: prepare_vendor_blas: out of memory"),
                                          ("blas_leader", "process 0: prepare_vendor_blas: out of memory"),
                                          ("oom", "could not be set up: process 1: allocate_workspace: out of memory"),
                                          ("oom_leader", "could not be set up: process 0: allocate_workspace: out of")])
def test_a_step_that_fails_on_one_process_sends_every_process_to_xla(two_hosts, failure, what):
  for record in _scenario(two_hosts, failure):
    assert record["calls"] == {"auto": []} and record["active"] is False
    error = record["errors"]["pipelined"]
    assert error.startswith("ValueError: jax_overlap.ag_matmul: algorithm='pipelined' cannot take this call")
    assert what in error, error
  if failure.startswith("oom"):  # the set-up failed on both, and is not tried again until shutdown()
    assert all("out of memory" in record["setup_failed"] for record in _scenario(two_hosts, failure))


def test_every_process_runs_process_0s_gemm_algorithms(two_hosts):
  """Issue 39: the GEMMs' algorithms are timed on process 0's first GPU alone and installed on every GPU of both
  processes (process 1, left to itself, would choose others: FakeNative.choice_salt)."""
  first, second = _scenario(two_hosts, "tuning")
  assert first["errors"] == second["errors"] == {} and len(first["calls"]["auto"]) == 1
  assert second["tuned"] == [] and {ordinal for ordinal, *_ in first["tuned"]} == {0}
  chosen = {pid: choice for _, pid, choice in first["installed"]}
  assert chosen and len(chosen) == len(first["tuned"])
  for record in (first, second):
    assert sorted({ordinal for ordinal, *_ in record["installed"]}) == [0, 1, 2, 3]
    assert all(chosen[pid] == choice for _, pid, choice in record["installed"])


def test_a_process_that_lowers_a_program_once_more_keeps_its_site_numbers(two_hosts):
  first, second = _scenario(two_hosts, "inspect")  # process 0 lowered "layer" an extra time first
  assert first["errors"] == second["errors"] == {}
  assert first["calls"]["layer"] == second["calls"]["layer"] and len(first["calls"]["layer"]) == 1
  assert first["calls"]["other"] == second["calls"]["other"]
  assert _site(first["calls"]["inspected"][0]) == _site(first["calls"]["layer"][0])
  assert _site(first["calls"]["other"][0]) != _site(first["calls"]["layer"][0])  # another program, another site


def test_two_programs_of_one_name_lowered_in_opposite_orders_keep_sites_of_their_own(two_hosts):
  """Issue 52.9: process 0 lowers program A then B, process 1 B then A (one jit name, calls of one shape): each
  program's call has one site on both processes, and the two programs' sites differ."""
  first, second = _scenario(two_hosts, "programs")
  assert first["errors"] == second["errors"] == {}
  for program in ("times 2.0", "times 3.0"):
    assert len(first["calls"][program]) == 1 and first["calls"][program] == second["calls"][program]
  for record in (first, second):
    assert _site(record["calls"]["times 2.0"][0]) != _site(record["calls"]["times 3.0"][0])


# --- the agreement itself ----------------------------------------------------------

@pytest.fixture
def gathered(monkeypatch):
  """agreement._decided over proposals given per process (a stand-in for processes.gather)."""
  def decide(*proposals):
    monkeypatch.setattr(processes, "gather", lambda name, mine: list(proposals))
    return agreement._decided("decide/x/final", proposals[0])
  return decide


def test_the_agreed_choice_is_one_every_process_proposed(gathered):
  take = {"choice": ["pipelined", [1, 1, 2], "key", 4096], "why": None}
  assert gathered(take, take, take) == (["pipelined", [1, 1, 2], "key", 4096], None)
  other = {"choice": ["pipelined", [1, 3], "key", 4096], "why": None}
  choice, why = gathered(take, other)
  assert choice is None and why.startswith("the processes chose differently: process 0: ['pipelined', [1, 1, 2]")
  choice, why = gathered(take, {"choice": None, "why": "no vendor BLAS"}, take)
  assert choice is None and why == "process 1: no vendor BLAS"
  assert gathered({"choice": None, "why": "k=100"}, {"choice": None, "why": "k=100"}) == (None, "k=100")


def test_a_process_missing_at_a_step_fails_it_for_all(monkeypatch):
  def missing(name, mine):
    raise errors.SetupError("jax_overlap: not every process reached decide/x/final within 120 s")
  monkeypatch.setattr(processes, "gather", missing)
  choice, why = agreement._decided("decide/x/final", {"choice": ["pipelined"], "why": None})
  assert choice is None and "not every process reached" in why


# --- planning (one process) -------------------------------------------------------------

@pytest.fixture
def planned(monkeypatch):
  """The links each pipelined plan of the calls that follow was made with."""
  links, plan = [], pipelined.plan
  def counted(op, world, figures, stages=None):
    links.append(figures.link_bytes_per_us)
    return plan(op, world, figures, stages)
  monkeypatch.setattr(pipelined, "plan", counted)
  return links


def test_an_auto_call_is_planned_once_from_the_figures_at_hand(fake, make_mesh, planned):
  """Before the workspace exists, with the link guessed (a quarter of the local copy rate) and once more with
  the measured one; after, once."""
  mesh = make_mesh((8,), ("tp",))
  assert len(_calls(_ag(mesh, "auto"), *_operands(mesh))) == 1
  assert planned == [0.25 * fake_gpu.LOCAL_BYTES_PER_US, fake_gpu.LINK_BYTES_PER_US]
  planned.clear()
  assert len(_calls(_ag(mesh, "auto", name="again"), *_operands(mesh))) == 1
  assert planned == [fake_gpu.LINK_BYTES_PER_US]


def test_eligibility_is_judged_before_anything_is_measured(fake):
  """A call no algorithm takes measures nothing (the figures are a collective step with several processes)."""
  problem = planning.Problem("ag_matmul", "float32", 1, ROWS, K, N, 8, (tuple(range(8)),), False)
  with pytest.raises(planning.Declined, match=r"^pipelined: dtype float32 \(.*\); fused: dtype float32 \("):
    planning.decide(problem, OPS["ag_matmul"], "auto")
  assert fake.calls == []


# --- resource failures (one process) ------------------------------------------------

@pytest.mark.parametrize("failing,why", [("allocate_workspace", "could not be set up: allocate_workspace: out of"),
                                         ("map_local_peer", "could not be set up: map_local"),
                                         ("time_copy", "local_copy: time_copy: out of memory"),
                                         ("time_gemms", "time_gemms: out of memory"),
                                         ("init_device", "device state of GPU 0 could not be made")])
def test_a_resource_failure_takes_the_xla_path_under_auto_and_raises_when_asked(fake, make_mesh, caplog, failing,
                                                                               why):
  fake.fail = {failing}
  mesh = make_mesh((8,), ("tp",))
  with caplog.at_level(logging.DEBUG, logger="jax_overlap"):
    assert _calls(_ag(mesh, "auto"), *_operands(mesh)) == []
  assert re.search(rf"jax_overlap.ag_matmul: XLA path \(.*{why}", caplog.text), caplog.text
  with pytest.raises(ValueError, match=rf"algorithm='pipelined' cannot take this call: .*{why}"):
    _calls(_ag(mesh, "pipelined", name="explicit"), *_operands(mesh))


def test_a_failed_set_up_is_not_tried_again_until_shutdown(fake, make_mesh):
  fake.fail = {"allocate_workspace"}
  mesh = make_mesh((8,), ("tp",))
  assert _calls(_ag(mesh, "auto"), *_operands(mesh)) == []
  tries = sum(1 for name, _ in fake.calls if name == "allocate_workspace")
  assert _calls(_ag(mesh, "auto", name="again"), *_operands(mesh)) == []
  assert sum(1 for name, _ in fake.calls if name == "allocate_workspace") == tries
  with pytest.raises(errors.SetupError, match=r"out of memory .*call jax_overlap.shutdown\(\) on every process"):
    jax_overlap.initialize()
  fake.fail = set()
  jax_overlap.shutdown()
  assert jax_overlap.initialize()["active"] is True
  assert len(_calls(_ag(mesh, "auto", name="after"), *_operands(mesh))) == 1


def test_a_full_workspace_is_said_once_at_info(fake, monkeypatch, make_mesh, caplog):
  monkeypatch.setenv("JAX_OVERLAP_WORKSPACE_BYTES", str(1 << 20))  # too small for any of these calls
  mesh = make_mesh((8,), ("tp",))
  with caplog.at_level(logging.DEBUG, logger="jax_overlap"):
    for name in ("first", "second"):
      assert _calls(_ag(mesh, "auto", name=name), *_operands(mesh)) == []
  info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
  assert len(info) == 1 and "bytes of symmetric workspace" in info[0] and "take the XLA path" in info[0]
  assert "JAX_OVERLAP_WORKSPACE_BYTES" in info[0] and "shutdown() then initialize()" in info[0]
  assert sum("XLA path (jax_overlap ag_matmul/pipelined: the call needs" in r.getMessage()
             for r in caplog.records if r.levelno == logging.DEBUG) == 2


# --- call sites ------------------------------------------------------------------

def test_lowering_a_program_again_keeps_its_site_numbers(fake, make_mesh):
  mesh = make_mesh((8,), ("tp",))
  layer = _ag(mesh, "pipelined")
  inspected = _calls(layer, *_operands(mesh, sharded=False))  # as when looking at the HLO: another lowering
  (first,) = _calls(layer, *_operands(mesh))
  jax.clear_caches()
  (again,) = _calls(layer, *_operands(mesh))
  (other,) = _calls(_ag(mesh, "pipelined", name="other"), *_operands(mesh))
  assert _site(inspected[0]) == _site(first) == _site(again) == 1
  assert _site(other) == 2  # another program's call of the same region


def test_two_programs_of_one_name_get_sites_of_their_own(fake, make_mesh):
  """Issue 52.9: a site is named by its program, not by the jit's name alone: two lambdas (both jit__lambda_) and a
  retrace with other static arguments, calls of one shape and region, get different sites; each keeps its own when
  lowered again."""
  mesh = make_mesh((8,), ("tp",))

  def program(f):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")))

  x, w = _operands(mesh)
  first = program(lambda x, w: jax_overlap.ag_matmul(x * 2, w, axis_name="tp", algorithm="pipelined"))
  second = program(lambda x, w: jax_overlap.ag_matmul(x + 1, w, axis_name="tp", algorithm="pipelined"))
  sites = [_site(c) for f in (first, second, first) for c in _calls(f, x, w)]
  assert sites[0] != sites[1] and sites[2] == sites[0], sites

  def scaled(x, w, scale):
    return jax.shard_map(lambda x, w: jax_overlap.ag_matmul(x * scale, w, axis_name="tp", algorithm="pipelined"),
                         mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"))(x, w)

  retraced = jax.jit(scaled, static_argnums=2)
  (two,), (three,) = (_calls(retraced, x, w, s) for s in (2.0, 3.0))
  assert len({_site(two), _site(three), *sites}) == 4


def test_call_sites_of_one_program_sharing_a_region_are_numbered_in_order(fake, make_mesh):
  mesh = make_mesh((8,), ("tp",))

  def two_layers(x, w1, w2, b):  # one with a bias: JAX lowers identical calls of one module once
    y = jax_overlap.ag_matmul(x, w1, axis_name="tp", algorithm="pipelined")
    return y + jax_overlap.ag_matmul(x, w2, b, axis_name="tp", algorithm="pipelined")

  f = jax.jit(jax.shard_map(two_layers, mesh=mesh, in_specs=(P("tp"), P(None, "tp"), P(None, "tp"), P("tp")),
                            out_specs=P(None, "tp")))
  x, w = _operands(mesh)
  b = jax.ShapeDtypeStruct((8 * N,), jnp.bfloat16)
  assert [_site(c) for c in _calls(f, x, w, w, b)] == [1, 2]
  jax.clear_caches()
  assert [_site(c) for c in _calls(f, x, w, w, b)] == [1, 2]


def test_the_runtime_all_gather_takes_its_region_and_site(fake, make_mesh):
  mesh = make_mesh((8,), ("tp",))
  gather = jax.jit(jax.shard_map(lambda x: jax_overlap.all_gather(x, axis_name="tp")[None], mesh=mesh,
                                 in_specs=P("tp"), out_specs=P("tp")))
  (call,) = _calls(gather, jax.ShapeDtypeStruct((8 * 64, 128), jnp.float32))
  assert "@jax_overlap_all_gather(" in call and _site(call) == 1
  assert f"region_bytes = {fake.all_gather_region_bytes(8, 64, 512)}" in call
  assert _calls(gather, jax.ShapeDtypeStruct((8 * 64, 6), jnp.float16)) == []  # 12-byte rows: XLA's all_gather
