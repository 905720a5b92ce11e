"""What a policy does to the search: episodes to a target plan, against
uniform priors on the same program, seeds and budget.

A search is summarised by its trail: the episode, wall second and step
time of every new best plan. `Run` measures one seed against a target fixed
in advance (a best-known plan): the episodes and wall seconds until the
search's best plan is within 1% of it (censored at a cap), and the plan it
ends with after a fixed number of episodes and refinement.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from automap._src.cost.program import Program
from automap._src.search import mcts, refine
from automap._src.search.actions import ActionSpace

TOLERANCE = 0.01  # a plan within this of a target has reached it


def trail(program: Program, space: ActionSpace, policy: mcts.Policy | None, seed: int,
          episodes: int) -> np.ndarray:
  """[improvements + 1, 3]: (episode, seconds, step seconds) of the root
  and of each new best plan of one search."""
  search = mcts.Search(program, space, None, seed, policy=policy)
  out = [(0.0, 0.0, search.best.score[1])]

  def watch(s: mcts.Search) -> None:
    if s.best.score[1] < out[-1][2]:
      out.append((s.episodes, time.perf_counter() - s.t0, s.best.score[1]))

  search.run(episodes, float("inf"), watch)
  return np.array(out)


def reach(path: np.ndarray, target: float) -> tuple[float, float]:
  """(episodes, seconds) until a trail's best plan is within TOLERANCE of
  `target` step seconds; (inf, inf) when never."""
  hit = np.flatnonzero(path[:, 2] <= target * (1 + TOLERANCE))
  return (np.inf, np.inf) if not len(hit) else (path[hit[0], 0], path[hit[0], 1])


def medians(trails: Sequence[np.ndarray], target: float) -> tuple[float, float]:
  """(episodes, seconds) to `target`, medians over the seeds' trails."""
  reached = np.array([reach(t, target) for t in trails])
  return float(np.median(reached[:, 0])), float(np.median(reached[:, 1]))


def final(trails: Sequence[np.ndarray]) -> float:
  """The final plan's step seconds, the median over the seeds' trails."""
  return float(np.median([t[-1, 2] for t in trails]))


def worse(trails: dict[str, list[np.ndarray]]) -> bool:
  """Whether the policy's final plan (the median over seeds) is slower than
  uniform's beyond float noise."""
  return mcts.better((0.0, final(trails["uniform"])), (0.0, final(trails["policy"])))


def speedup(uniform: float, policy: float) -> float:
  """Episodes uniform / policy: 1 when both take the same (neither
  reaches, or both start there), 0 when only uniform reaches."""
  return 1.0 if uniform == policy else uniform / policy


def compare(program: Program, space: ActionSpace, policy: mcts.Policy,
            seeds: Sequence[int], episodes: int) -> dict[str, list[np.ndarray]]:
  """Trails of uniform priors and of `policy`, one per seed."""
  return {label: [trail(program, space, p, s, episodes) for s in seeds]
          for label, p in (("uniform", None), ("policy", policy))}


def best_found(trails: dict[str, list[np.ndarray]]) -> float:
  """The best step seconds any of the trails reached."""
  return min(t[-1, 2] for ts in trails.values() for t in ts)


def within(score: mcts.Score, target: mcts.Score) -> bool:
  """Whether a plan of `score` has reached `target` (a plan within the
  memory limit): it fits too, and is at most TOLERANCE slower."""
  return score[0] <= target[0] and score[1] <= target[1] * (1 + TOLERANCE)


@dataclasses.dataclass(frozen=True)
class Run:
  """One seed's search measured against a target.

  episodes, seconds: until its best plan reached the target (inf: not
    within the cap); seconds are the search's wall clock since it was
    made, priors and their features included.
  final: the score after `final_episodes` episodes and refinement of the
    plans seen by then.
  """

  episodes: float
  seconds: float
  final: mcts.Score

  def to_json(self) -> list:
    return [self.episodes if np.isfinite(self.episodes) else None,
            self.seconds if np.isfinite(self.seconds) else None, list(self.final)]

  @classmethod
  def from_json(cls, d: list) -> Run:
    inf = float("inf")
    return cls(inf if d[0] is None else d[0], inf if d[1] is None else d[1],
               (float(d[2][0]), float(d[2][1])))


# Refinement of a final plan tries at most this many moves per episode run.
_REFINE_TRIES = 10


def run(program: Program, space: ActionSpace, policy: mcts.Policy | None, seed: int,
        target: mcts.Score, memory_limit: float | None, *, cap: int = 1000,
        final_episodes: int = 200,
        settings: mcts.MCTSSettings | None = None) -> Run:
  """Searches until the target is reached and `final_episodes` have run,
  or `cap` episodes have."""
  search = mcts.Search(program, space, memory_limit, seed, policy=policy,
                       settings=settings or mcts.MCTSSettings())
  hit = (float("inf"), float("inf"))
  if within(search.best.score, target):
    hit = (0.0, time.perf_counter() - search.t0)
  final = None
  while search.episodes < max(cap, final_episodes):
    if search.episodes == final_episodes:
      final = _refined(program, space, search, memory_limit, final_episodes)
      if np.isfinite(hit[0]):
        break
    if search.episodes >= cap:
      break
    search.episode()
    if not np.isfinite(hit[0]) and within(search.best.score, target):
      hit = (float(search.episodes), time.perf_counter() - search.t0)
  if final is None:
    final = _refined(program, space, search, memory_limit, final_episodes)
  return Run(hit[0], hit[1], final)


def _refined(program, space, search: mcts.Search, memory_limit, episodes: int) -> mcts.Score:
  seen = [(n.state, n.score) for n in search.table.values()]
  _, score, _ = refine.refine_best(program, space.colour, seen, memory_limit, float("inf"),
                                   _REFINE_TRIES * episodes)
  return score
