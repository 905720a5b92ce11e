"""What a policy does to the search: episodes to a target plan, against
uniform priors on the same program, seeds and budget.

A search is summarised by its trail: the episode, wall second and step
time of every new best plan. The targets are the best expert's plan (given
by the caller) and the best plan any of the compared searches found, each
within 1%.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from automap._src.cost.program import Program
from automap._src.search import mcts
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
