"""Priors that learn nothing, for measuring one that does.

- `LookaheadPolicy`: one step of lookahead on the cost model. Each action is
  applied, the tracker prices the result, and the prior is a softmax of
  minus the change in log step time (plus, under a memory limit, the change
  in log excess over it). Cheap to state, dear to run: a node's priors cost
  one tracker update per action, so they are cached per state.
- `OraclePolicy`: the actions of a known best plan first, in its order. The
  ceiling any prior can reach on a program whose best plan is known.

- `ProductPolicy`: two priors' product, for the learned filter with the
  lookahead beside it.

All mix in a uniform share, as a learned policy must: every action stays
reachable whatever the prior says.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from automap._src.cost.program import Program
from automap._src.cost.tracker import Tracker
from automap._src.search.actions import Action, ActionSpace
from automap._src.sharding.state import State

# Share of every prior kept uniform.
EPSILON = 0.1


def mix(p: np.ndarray, epsilon: float = EPSILON) -> np.ndarray:
  """(1 - epsilon) * p / sum(p) + epsilon * uniform, over p's entries."""
  p = np.asarray(p, float)
  return (1 - epsilon) * p / max(p.sum(), 1e-300) + epsilon / len(p)


def softmax(x: np.ndarray) -> np.ndarray:
  e = np.exp(x - x.max())
  return e / e.sum()


class LookaheadPolicy:
  """Priors from each action's effect on the priced plan, one step ahead.

  The cost of a state is log(step seconds), plus log(peak / limit) where
  the peak is over `memory_limit`; an action's prior is softmax(-change / T)
  over the node's actions and "stop" (change 0), with T the spread of the
  changes (so the prior does not depend on the program's scale), mixed
  with `EPSILON` uniform. States are valued by the cost model.
  """

  name = "lookahead"
  # Priced at the root and its children: deeper, pricing every action costs
  # more than the episodes it saves (benchmarks/policy.py measures depth 1).
  depth = 1

  def __init__(self, program: Program, memory_limit: float | None = None):
    self.program, self.memory_limit = program, memory_limit
    self.state = program.initial_state()
    self.tracker = Tracker(program.model, self.state)
    self.cache: dict[bytes, np.ndarray] = {}  # state bytes -> [K + 1] changes
    self.priced = 0  # actions priced (cache misses)

  def _cost(self) -> float:
    cost = float(np.log(self.tracker.step_time))
    if self.memory_limit is not None and self.tracker.peak_bound() > self.memory_limit:
      cost += max(0.0, float(np.log(self.tracker.peak_memory / self.memory_limit)))
    return cost

  def changes(self, space: ActionSpace, state: State,
              actions: Sequence[Action]) -> np.ndarray:
    """[len(actions) + 1] the change in cost each action makes ("stop": 0)."""
    key = state.tobytes()
    hit = self.cache.get(key)
    if hit is not None and len(hit) == len(actions) + 1:
      return hit
    self.tracker.move_to(state)
    base = self._cost()
    out = np.zeros(len(actions) + 1)
    for i, action in enumerate(actions):
      changed = space.apply(self.state, action)
      self.tracker.update(changed)
      out[i] = self._cost() - base
      self.tracker.move_to(state)
    self.priced += len(actions)
    self.cache[key] = out
    return out

  def priors(self, space: ActionSpace, state: State,
             actions: Sequence[Action]) -> np.ndarray:
    change = self.changes(space, state, actions)
    spread = float(change.std())
    if not spread > 0:
      return np.full(len(change), 1.0 / len(change))
    return mix(softmax(-change / spread))

  def value(self, space: ActionSpace, state: State) -> None:
    return None


class OraclePolicy:
  """The actions of a known plan's path first, in the path's order, then
  the rest uniformly (`EPSILON` of the mass), "stop" among the rest."""

  def __init__(self, path: Sequence[Action]):
    self.rank = {a: i for i, a in reversed(list(enumerate(path)))}

  def priors(self, space: ActionSpace, state: State,
             actions: Sequence[Action]) -> np.ndarray:
    k = len(actions)
    p = np.zeros(k + 1)
    for i, action in enumerate(actions):
      r = self.rank.get(action)
      if r is not None:
        p[i] = 2.0 ** -r  # the path's first action far ahead of its second
    if not p.any():
      return np.full(k + 1, 1.0 / (k + 1))
    return mix(p)

  def value(self, space: ActionSpace, state: State) -> None:
    return None


class ProductPolicy:
  """Two priors' agreement: their product over the node's actions,
  renormalised and mixed with `EPSILON` uniform ("stop" at its uniform
  share). With the learned filter and the lookahead, the filter's scores
  reweighed by each action's priced step where the lookahead runs."""

  def __init__(self, first, second, name: str = "product"):
    self.first, self.second, self.name = first, second, name

  def priors(self, space: ActionSpace, state: State,
             actions: Sequence[Action]) -> np.ndarray:
    k = len(actions)
    if k == 0:
      return np.ones(1)
    a = np.asarray(self.first.priors(space, state, actions), float)[:k]
    b = np.asarray(self.second.priors(space, state, actions), float)[:k]
    stop = 1.0 / (k + 1)
    return np.append((1 - stop) * mix(a * b), stop)

  def value(self, space: ActionSpace, state: State) -> None:
    return None


__all__ = ["EPSILON", "LookaheadPolicy", "OraclePolicy", "ProductPolicy", "mix", "softmax"]
