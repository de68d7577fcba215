"""planning.decide() with the workspace it needs, and with several processes agreed: the set-up and the region are
collective steps, so a call takes a path only when every process proposes the same one (algorithm, plan, region),
else the XLA path everywhere. A choice made on a guessed link is judged again once the link is measured."""

from __future__ import annotations

import dataclasses
import threading

import jax

from jax_overlap.planning.decision import decide
from jax_overlap.planning.problem import Choice, Declined, Problem
from jax_overlap.runtime import processes, settings, workspace
from jax_overlap.runtime.errors import SetupError, WorkspaceFullError

# What a call that cannot take a GPU path raises: Declined, a full workspace, or a set-up that failed (out of
# memory, no answer from another process in time). Once a choice is made (and agreed), emitting it never falls back.
DECLINED = (Declined, WorkspaceFullError, SetupError)


def _set_up() -> None:
  """Sets the workspace up (collective; a failure is every process's)."""
  try:
    workspace.initialize()
  except SetupError as e:
    raise Declined(str(e)) from e
  if not workspace.is_active():
    raise Declined("no GPU workspace")


def _reachable(problem: Problem) -> None:
  """Only the groups this process's devices are in must be reachable (others may be on other hosts)."""
  local = workspace.local_device_ids()
  ids = {i for g in problem.groups if local & set(g) for i in g}
  if not workspace.reachable(ids):
    raise Declined("the group spans devices this process cannot reach (another host)")


def _placed(choice: Choice) -> Choice:
  """The choice with its region's offset, not yet recorded: every process must agree on it first."""
  return choice if choice.region is None else dataclasses.replace(choice, offset=workspace.placement(*choice.region))


def choose(problem: Problem, op, algorithm: str) -> Choice:
  """The algorithm, plan and placed region that take the call, or Declined saying why none does."""
  if problem.world > 1 and jax.process_count() > 1:
    return _agreed_choice(problem, op, algorithm)
  measured = workspace.is_active()  # else the link is guessed until the set-up measures it
  choice = decide(problem, op, algorithm)
  if problem.world > 1:
    _set_up()
    _reachable(problem)
    if not measured:
      choice = decide(problem, op, algorithm, again=choice.algorithm if algorithm == "auto" else None)
  return choice if choice.region is None else dataclasses.replace(choice, offset=workspace.claim(*choice.region))


# (call, algorithm, plan settings, runtime generation) -> (Choice, None) or (None, why not)
_decisions: dict = {}

# One decision at a time in a process: each is a collective step, which one process must not enter twice.
_deciding = threading.Lock()


def _agreed_choice(problem: Problem, op, algorithm: str) -> Choice:
  key = (problem, algorithm, settings.plan_settings(), workspace.generation())
  with _deciding:
    if key not in _decisions:
      _decisions[key] = _agree(problem, op, algorithm, f"decide/{processes.digest(key)}")
  choice, why = _decisions[key]
  if choice is None:
    raise Declined(why)
  return choice


def _agree(problem: Problem, op, algorithm: str, name: str) -> tuple:

  if not workspace.is_active() and workspace.setup_failed() is None:
    # The set-up is collective: first agree that every process wants it for this call.
    wanted, why = _decided(f"{name}/setup", _proposal(algorithm, lambda: _setup_proposal(problem, op, algorithm)))
    if wanted is None:
      return None, why
  choice = None

  def final():
    nonlocal choice
    choice = _final_choice(problem, op, algorithm)
    return choice.fingerprint()

  agreed, why = _decided(f"{name}/final", _proposal(algorithm, final))
  if agreed is None:
    return None, why
  workspace.place(*choice.region, choice.offset)
  return choice, None


def _within_hosts(problem: Problem) -> None:
  hosts = processes.hosts()
  for group in problem.groups:
    names = sorted({hosts.get(i, "a process without GPUs") for i in group})
    if len(names) > 1:
      raise Declined(f"the group {group} spans hosts {names}")


def _setup_proposal(problem: Problem, op, algorithm: str) -> str:
  _within_hosts(problem)
  return decide(problem, op, algorithm).algorithm


def _final_choice(problem: Problem, op, algorithm: str) -> Choice:
  # The collective steps (host map, set-up, figures) first, then what this process alone can refuse.
  _within_hosts(problem)
  _set_up()
  choice = decide(problem, op, algorithm)
  _reachable(problem)
  return _placed(choice)


def _proposal(algorithm: str, propose) -> dict:
  """This process's proposal (JSON): what propose() returns, or why it cannot take the call."""
  try:
    return {"choice": propose(), "why": None}
  except WorkspaceFullError as e:
    if algorithm == "auto":
      workspace.note_workspace_full(e)
    return {"choice": None, "why": str(e)}
  except (Declined, SetupError) as e:
    return {"choice": None, "why": str(e)}


def _decided(name: str, proposal: dict) -> tuple:
  """(the choice every process proposed, None), or (None, why not)."""

  try:
    proposals = processes.gather(name, proposal)
  except SetupError as e:
    return None, str(e)
  declined = [(p, q["why"]) for p, q in enumerate(proposals) if q["choice"] is None]
  if declined:
    reasons = {why for _, why in declined}
    if len(declined) == len(proposals) and len(reasons) == 1:
      return None, reasons.pop()
    return None, "; ".join(f"process {p}: {why}" for p, why in declined)
  choices = [q["choice"] for q in proposals]
  if any(c != choices[0] for c in choices):
    return None, "the processes chose differently: " + "; ".join(f"process {p}: {c}" for p, c in enumerate(choices))
  return choices[0], None
