"""Greedy descent over sharding actions on the cost model.

From each starting state (nothing tiled; data parallelism), repeatedly take
the action whose propagated result most lowers the objective, until none
does or the budget runs out. An action that an earlier trial of the same
round already carried out by propagation is skipped: from the same state it
would mostly repeat that trial.
The objective is lexicographic: bytes over the memory limit first, then
predicted step time, so an infeasible plan never beats a feasible one.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

from automap._src.cost import Tracker
from automap._src.program import Program
from automap._src.search import tactics
from automap._src.sharding import State

Score = tuple[float, float]  # (bytes over the memory limit, step seconds)


@dataclasses.dataclass
class Result:
  state: State
  score: Score
  evaluations: int
  rounds: int
  start: str
  seconds: float


def score_of(tracker: Tracker, memory_limit: float | None) -> Score:
  over = 0.0 if memory_limit is None else max(0.0, tracker.peak_memory - memory_limit)
  return (over, tracker.step_time)


def candidate_actions(program: Program) -> list[tuple[int, int, int]]:
  """(value, dim, axis) for every dim of every argument an axis divides."""
  g, mesh = program.graph, program.mesh
  out = []
  for v in g.inputs:
    if program.fixed[v]:
      continue
    for d, n in enumerate(g.shapes[v]):
      for a, size in enumerate(mesh.axis_sizes):
        if size > 1 and n % size == 0:
          out.append((v, d, a))
  # Largest first: when trials tie, the bigger array is the better decision.
  out.sort(key=lambda x: -int(g.nbytes[x[0]]))
  return out


def descend(program: Program, state: State, memory_limit: float | None,
            deadline: float, max_evaluations: int) -> tuple[State, Score, int, int]:
  prop = program.propagator()
  tracker = Tracker(program.model, state)
  best = score_of(tracker, memory_limit)
  actions = candidate_actions(program)
  evaluations = rounds = 0
  while time.perf_counter() < deadline and evaluations < max_evaluations:
    rounds += 1
    covered: set[tuple[int, int, int]] = set()
    round_best, round_action = best, None
    for v, d, a in actions:
      if (v, d, a) in covered or not prop.can_tile(state, v, d, a):
        continue
      if time.perf_counter() >= deadline or evaluations >= max_evaluations:
        break
      before = state.copy()
      changed = prop.tile(state, v, d, a)
      tracker.update(changed)
      evaluations += 1
      score = score_of(tracker, memory_limit)
      for u in changed:
        covered.update((u, int(state[u, b]), b) for b in range(state.shape[1])
                       if state[u, b] >= 0 and before[u, b] < 0)
      if score < round_best and _better(score, round_best):
        round_best, round_action = score, (v, d, a)
      state[changed] = before[changed]
      tracker.update(changed)
    if round_action is None:
      break
    tracker.update(prop.tile(state, *round_action))
    best = score_of(tracker, memory_limit)
  return state, best, evaluations, rounds


def _better(a: Score, b: Score) -> bool:
  """Strictly better beyond float noise."""
  if a[0] != b[0]:
    return a[0] < b[0] - 1e-6 * max(b[0], 1.0)
  return a[1] < b[1] * (1 - 1e-9)


def search(program: Program, memory_limit: float | None, seconds: float,
           max_evaluations: int) -> Result:
  t0 = time.perf_counter()
  deadline = t0 + seconds
  # Data parallelism over every subset of the mesh axes (the rest left to
  # the descent, e.g. for tensor parallelism), then nothing at all.
  mesh = program.mesh
  real = [a for a in range(mesh.num_axes) if mesh.axis_sizes[a] > 1]
  starts = {}
  for k in range(len(real), 0, -1):
    for axes in itertools.combinations(real, k):
      state = program.initial_state()
      tactics.data_parallel(program.traced, program.graph, mesh,
                            program.propagator(), state, axes)
      name = "data-parallel(" + ",".join(mesh.axis_names[a] for a in axes) + ")"
      starts[name] = state
  starts["replicated"] = program.initial_state()
  best: Result | None = None
  total = 0
  for name, state in starts.items():
    state, score, n, rounds = descend(program, state, memory_limit, deadline,
                                      max_evaluations - total)
    total += n
    if best is None or score < best.score:
      best = Result(state, score, 0, rounds, name, 0.0)
  best.evaluations = total
  best.seconds = time.perf_counter() - t0
  return best
