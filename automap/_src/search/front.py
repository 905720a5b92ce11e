"""Memory in the objective: the time/memory front of the plans a search saw,
and, among those within a tolerance of the fastest, the one of least peak.

Step time alone picks, of two plans a hair apart in time, the one that may
hold twice the memory (a replicated optimizer state costs no time). Here the
fastest feasible plan's time sets a band, `(1 + tolerance)` times it, and
the plan is the band's lowest peak; ties go to the faster.
"""

from __future__ import annotations

import numpy as np

from automap._src.cost.tracker import Tracker
from automap._src.search import mcts
from automap._src.sharding.state import State

# Candidates priced for the front beyond the band: the fastest few.
_PRICED = 16
# The front reported reaches this factor of the fastest time.
_REACH = 2.0


def choose(program, candidates: list[tuple[State, mcts.Score]], best: tuple[State, mcts.Score],
           tolerance: float) -> tuple[State, mcts.Score, list[tuple[float, float]]]:
  """(state, score) of the plan to keep and the time/memory front (step
  seconds, peak bytes), fastest first, of the feasible candidates and
  `best`. Infeasible plans (over the memory limit) never enter the band."""
  state, score = best
  if score[0] > 0:
    return state, score, []
  seen: dict[bytes, tuple[State, mcts.Score]] = {state.tobytes(): (state, score)}
  for s, sc in sorted(candidates, key=lambda c: c[1]):
    if sc[0] > 0 or sc[1] > score[1] * _REACH:
      continue
    seen.setdefault(s.tobytes(), (s, sc))
    if len(seen) >= _PRICED:
      break
  priced = []
  for s, sc in seen.values():
    tracker = Tracker(program.model, s)
    priced.append((tracker.step_time, tracker.peak_memory, s, sc))
  fastest = min(t for t, *_ in priced)
  band = [p for p in priced if p[0] <= fastest * (1 + tolerance)]
  _, _, state, score = min(band, key=lambda p: (p[1], p[0]))
  front, low = [], np.inf
  for t, peak, *_ in sorted(priced, key=lambda p: (p[0], p[1])):
    if peak < low:
      front.append((t, peak))
      low = peak
  return state, score, front
