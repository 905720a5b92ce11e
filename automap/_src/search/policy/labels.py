"""Labels for the learned filter: which decisions the best known plans take.

Teachers search each training program several ways (MCTS with the one-step
lookahead prior over several seeds, uniform MCTS, refinement of every
search's best plans, and the expert layouts). Every distinct plan they saw
that fits the memory limit and is within `NEAR` of the best is a near-best
plan; a decision's label is the share of near-best plans that contain it:
hundreds of labels a program, none of them depending on the order a search
took its actions in.

A plan contains a tiling decision (group, dim, axis size) when an axis of
that size tiles that dim of at least half the group's members; it contains
a tactic decision when, for one of its actions, at least `TACTIC_SHARE` of
the layouts the tactic lays out from the start state are in the plan.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from automap._src.cost.program import Program
from automap._src.cost.tracker import Tracker
from automap._src.search import mcts, refine
from automap._src.search.actions import ActionSpace
from automap._src.search.policy.baselines import LookaheadPolicy
from automap._src.search.policy.decisions import Decisions
from automap._src.search.tactics import expert_states
from automap._src.sharding.state import State

NEAR = 0.01  # a plan within this of the best known step time is near-best
TACTIC_SHARE = 0.9
MAX_PLANS = 512  # near-best plans kept per program (the best first)


@dataclasses.dataclass(frozen=True)
class Teachers:
  seeds: int = 3  # lookahead searches
  episodes: int = 150  # per search
  uniform_seeds: int = 1
  refine_tries: int = 1500


def plans(program: Program, space: ActionSpace, memory_limit: float | None,
          teachers: Teachers = Teachers(), seed: int = 0) -> list[tuple[State, mcts.Score]]:
  """Every distinct plan the teachers saw, (state, score), best first."""
  seen: dict[bytes, tuple[State, mcts.Score]] = {}

  def add(state: State, score: mcts.Score) -> None:
    seen.setdefault(state.tobytes(), (state, score))

  runs = [(LookaheadPolicy(program, memory_limit), LookaheadPolicy.depth)
          for _ in range(teachers.seeds)]  # a fresh cache per seed
  runs += [(None, None)] * teachers.uniform_seeds
  for i, (policy, depth) in enumerate(runs):
    search = mcts.Search(program, space, memory_limit, seed * 1000 + i, policy=policy,
                         settings=mcts.MCTSSettings(policy_depth=depth))
    search.run(teachers.episodes, float("inf"))
    for node in search.table.values():
      add(node.state, node.score)
  for state in expert_states(program, space).values():
    add(state, mcts.score_of(Tracker(program.model, state), memory_limit))
  state, score, _ = refine.refine_best(program, space, list(seen.values()),
                                       memory_limit, float("inf"), teachers.refine_tries)
  add(state, score)
  return sorted(seen.values(), key=lambda c: c[1])


def near_best(found: list[tuple[State, mcts.Score]]) -> list[State]:
  """The plans within `NEAR` of the best (those that fit, where any does;
  else those of the least excess), best first, at most `MAX_PLANS`."""
  best = min(score for _, score in found)
  return [state for state, score in found
          if score[0] <= best[0] and score[1] <= best[1] * (1 + NEAR)][:MAX_PLANS]


def tactic_layouts(space: ActionSpace, decisions: Decisions) -> dict[int, list[State]]:
  """Per tactic decision row, the layout each of its actions makes from
  the start state."""
  start = space.program.initial_state()
  out = {}
  for row, key in enumerate(decisions.keys):
    if key[0] != "tactic":
      continue
    layouts = []
    for action in decisions.actions[row]:
      state = start.copy()
      space.apply(state, action)
      layouts.append(state)
    out[row] = layouts
  return out


def contains(space: ActionSpace, decisions: Decisions, state: State,
             layouts: dict[int, list[State]], start: State) -> np.ndarray:
  """[D] bool: which decisions `state` takes."""
  sizes = np.asarray(space.program.mesh.axis_sizes)
  out = np.zeros(len(decisions.keys), bool)
  for row, key in enumerate(decisions.keys):
    if key[0] == "tile":
      _, group, dim, size = key
      members = list(space.groups[group].members)
      axes = np.flatnonzero(sizes == size)
      out[row] = any((state[members, a] == dim).mean() >= 0.5 for a in axes)
    else:
      for layout in layouts[row]:
        laid = (layout >= 0) & (start < 0)  # what the tactic adds
        if laid.any() and (state[laid] == layout[laid]).mean() >= TACTIC_SHARE:
          out[row] = True
          break
  return out


def labels(space: ActionSpace, decisions: Decisions, best: list[State]) -> np.ndarray:
  """[D] float32: the share of the plans `best` that contain each decision."""
  layouts = tactic_layouts(space, decisions)
  start = space.program.initial_state()
  taken = np.zeros(len(decisions.keys))
  for state in best:
    taken += contains(space, decisions, state, layouts, start)
  return (taken / max(len(best), 1)).astype(np.float32)


__all__ = ["NEAR", "Teachers", "contains", "labels", "near_best", "plans"]
