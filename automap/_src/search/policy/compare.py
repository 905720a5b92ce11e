"""What a policy does to the search: episodes to a target plan, against
uniform priors on the same program, seeds and budget.

`Run` measures one seed's search against a target fixed in advance (a
best-known plan): the episodes and wall seconds until the
search's best plan is within 1% of it (censored at a cap), and the plan it
ends with after a fixed number of episodes and refinement.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from automap._src.cost.program import Program
from automap._src.search import driver, mcts
from automap._src.search.actions import ActionSpace

TOLERANCE = 0.01  # a plan within this of a target has reached it


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
  capped: wall seconds of the episodes up to the cap, for a run that did
    not reach the target (a lower bound on its seconds to it); nan else.
  """

  episodes: float
  seconds: float
  final: mcts.Score
  capped: float = float("nan")
  # The final plan's state (not serialised: kept to update a best-known plan).
  final_state: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)

  @property
  def seconds_bound(self) -> float:
    """Seconds to the target, or at least `capped` where censored."""
    return self.seconds if np.isfinite(self.seconds) else self.capped

  def to_json(self) -> list:
    return [self.episodes if np.isfinite(self.episodes) else None,
            self.seconds if np.isfinite(self.seconds) else None, list(self.final),
            None if np.isnan(self.capped) else self.capped]

  @classmethod
  def from_json(cls, d: list) -> Run:
    inf = float("inf")
    capped = float("nan") if len(d) < 4 or d[3] is None else d[3]
    return cls(inf if d[0] is None else d[0], inf if d[1] is None else d[1],
               (float(d[2][0]), float(d[2][1])), capped)


def run(program: Program, space: ActionSpace, policy: mcts.Policy | None, seed: int,
        target: mcts.Score, memory_limit: float | None, *, cap: int = 1000,
        final_episodes: int | None = 200,
        settings: mcts.MCTSSettings | None = None,
        deep_policy: mcts.Policy | None = None) -> Run:
  """Searches until the target is reached and `final_episodes` have run,
  or `cap` episodes have. `final_episodes=None`: no final plan (its score
  is the search's best). `deep_policy`: the priors below
  `settings.policy_depth` (uniform unless given)."""
  search = mcts.Search(program, space, memory_limit, seed, policy=policy,
                       settings=settings or mcts.MCTSSettings(), deep_policy=deep_policy)
  hit = (float("inf"), float("inf"))
  if within(search.best.score, target):
    hit = (0.0, time.perf_counter() - search.t0)
  final, capped, refining = None, float("nan"), 0.0
  if final_episodes is None:
    while search.episodes < cap and not np.isfinite(hit[0]):
      search.episode()
      if within(search.best.score, target):
        hit = (float(search.episodes), time.perf_counter() - search.t0)
    capped = float("nan") if np.isfinite(hit[0]) else time.perf_counter() - search.t0
    return Run(hit[0], hit[1], search.best.score, capped, search.best.state)
  while search.episodes < max(cap, final_episodes):
    if search.episodes == final_episodes:
      start = time.perf_counter()
      final = _refined(program, space, search, memory_limit, final_episodes, seed,
                     policy is not None)
      refining = time.perf_counter() - start  # not the search's own seconds
      if np.isfinite(hit[0]):
        break
    if search.episodes >= cap:
      break
    search.episode()
    if not np.isfinite(hit[0]) and within(search.best.score, target):
      hit = (float(search.episodes), time.perf_counter() - search.t0 - refining)
  if not np.isfinite(hit[0]):
    capped = time.perf_counter() - search.t0 - refining
  if final is None:
    final = _refined(program, space, search, memory_limit, final_episodes, seed,
                     policy is not None)
  return Run(hit[0], hit[1], final[1], capped, final[0])


def _refined(program, space, search: mcts.Search, memory_limit, episodes: int,
             seed: int, retry: bool) -> tuple[np.ndarray, mcts.Score]:
  """The final plan as `automap.search` ends a search (`driver.finish`),
  unbounded in time (bounded by tries)."""
  state, score, _, _ = driver.finish(program, space, search, memory_limit, episodes,
                                     float("inf"), seed, retry=retry)
  return state, score
