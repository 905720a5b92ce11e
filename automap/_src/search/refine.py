"""Refinement: the search's best plans walked downhill by untiling moves.

Propagation carries a tiling across every op its factor reaches, so each
search action tiles a whole connected region. The best plan often stops a
region short: expert-parallel weights beside a router kept whole, whose
small softmax would otherwise pay a collective per reduction. No sequence of
tilings expresses that; moves that leave values whole do.

A move acts on one mesh axis and leaves whole on it either a class of
values (one Weisfeiler-Lehman colour: the same role in every repeated
layer) or the tiled region of values no larger than the class's around it
(the small side of a boundary). Candidates are the classes next to an op
that talks (a collective or a reshard), as that is where a move can save
time; a move is kept when the plan's score improves, and refinement sweeps
until no move helps or its time is up. Moves only take tilings away:
layouts propagation never makes stay out of the plans, as do values by
sealed calls and scanned bodies, whose layouts XLA or the loop decides.

Untiling alone cannot add a tiling: a plan one search action short of a
better one (a layout MCTS's budget did not reach from it, often the memory
a tight limit needs) stays short. So the best few plans are also climbed:
every legal search action is priced one step ahead and the best taken while
it improves the plan's score, alternating with untiling until neither
helps. It runs where the memory limit binds (data parallelism is over it),
and there it is what turns a plan over the limit, or one that fits by a
slower layout, into the fitting fast one (`benchmarks/limits.py`).
"""

from __future__ import annotations

import math
import time

import numpy as np

from automap._src.cost.program import Program
from automap._src.cost.tracker import Tracker
from automap._src.search.actions import ActionSpace
from automap._src.search.mcts import Score, better, score_of
from automap._src.search.tactics import expert_states
from automap._src.sharding.state import UNSHARDED, State

# A region left whole at once has at most this many values per class member.
_REGION = 128


class Refiner:
  """Untiling descent on one program.

  colour: [V] the class of each value (moves act on a class at once).
  """

  def __init__(self, program: Program, colour: np.ndarray, memory_limit: float | None):
    self.program, self.memory_limit = program, memory_limit
    g = program.graph
    # Values a move may touch: ranked, not pinned, and away from sealed
    # calls (whose insides the plan cannot constrain: XLA lays them out
    # after their operands) and scanned bodies (whose layouts the loop's
    # carry ties together); there propagation's layouts stay.
    sealed = np.asarray(g.sealed, bool)
    movable = np.array([g.rank(v) > 0 for v in range(g.num_values)], bool)
    movable &= ~np.asarray(program.fixed, bool) & ~sealed
    for o in range(g.num_ops):
      members = [v for v in g.operands[o] + g.results[o] if v >= 0]
      if (g.trips[o] > 1 or g.prims[o].startswith(("scan_", "while_"))
          or sealed[members].any()):
        movable[members] = False
    self.movable = movable
    # A step's carried state comes back in the layout it came in: an
    # argument's class and its result's move together.
    label = np.asarray(colour, np.int64).copy()
    root = {}

    def find(c: int) -> int:
      while root.get(c, c) != c:
        c = root[c]
      return c

    self.partner: dict[int, int] = {}
    for v, u in program.carried_pairs():
      root[find(int(label[u]))] = find(int(label[v]))
      self.partner[v], self.partner[u] = u, v
      movable[[v, u]] &= movable[v] & movable[u]
    colour = np.array([find(int(c)) for c in label], np.int64)
    order = np.argsort(colour, kind="stable")
    bounds = np.flatnonzero(np.diff(colour[order])) + 1
    self.classes = np.split(order, bounds)
    self.class_of = np.empty(g.num_values, np.int64)
    for i, members in enumerate(self.classes):
      self.class_of[members] = i
    self.axes = [a for a, s in enumerate(program.mesh.axis_sizes) if s > 1]
    self._neighbours: dict[int, list[int]] = {}

  def _classes_by_collectives(self, tracker: Tracker) -> np.ndarray:
    """The classes of the movable values next to an op with collectives."""
    g = self.program.graph
    values = {v for o in tracker.ops_with_collectives().tolist()
              for v in g.operands[o] + g.results[o] if v >= 0}
    values = [v for v in values if self.movable[v]]
    return np.unique(self.class_of[values]) if values else np.zeros(0, np.int64)

  def _region(self, state: State, members: np.ndarray, a: int) -> np.ndarray | None:
    """The values tiled on axis a reachable from the class through values no
    larger than its members: the small side of a boundary (a router's
    softmax beside expert-parallel weights), to be left whole together.
    None when it outgrows `_REGION` values per member (no small side)."""
    g = self.program.graph
    limit, most = g.nbytes[members[0]], _REGION * len(members)
    # Which values the region may take, decided for all at once.
    open_ = (state[:, a] >= 0) & self.movable & (g.nbytes <= limit)
    seen = set(members.tolist())
    todo = [v for v in seen if state[v, a] >= 0]
    while todo:
      for u in self._near(todo.pop()):
        if u not in seen and open_[u]:
          seen.add(u)
          todo.append(u)
      if len(seen) > most:
        return None
    return np.array(sorted(seen), np.int64)

  def _near(self, v: int) -> list[int]:
    """The values an op shares with v, and v's carried partner (cached)."""
    near = self._neighbours.get(v)
    if near is None:
      g = self.program.graph
      near = [u for o in g.ops_of(v) for u in g.operands[o] + g.results[o] if u >= 0]
      if v in self.partner:
        near.append(self.partner[v])
      self._neighbours[v] = near
    return near

  def _moves(self, state: State, members: np.ndarray, a: int):
    """Value sets to leave whole on axis a: the class, and its small region."""
    yield members
    region = self._region(state, members, a)
    if region is not None and len(region) > len(members):
      yield region

  def run(self, state: State, seconds: float,
          tries: int | None = None) -> tuple[State, Score, int]:
    """The refined copy of `state`, its score and the moves kept, within
    `seconds` and `tries` moves tried (None: unbounded); `self.tried`
    counts the moves tried."""
    deadline = time.perf_counter() + seconds
    self.tried = 0
    tries = np.inf if tries is None else tries
    state = state.copy()
    tracker = Tracker(self.program.model, state)
    score = score_of(tracker, self.memory_limit)
    moves = 0
    improved = True
    while improved and time.perf_counter() < deadline and self.tried < tries:
      improved = False
      for c in self._classes_by_collectives(tracker).tolist():
        members = self.classes[c][self.movable[self.classes[c]]]
        for a in self.axes if len(members) else ():
          best, best_move = score, None
          for values in self._moves(state, members, a):
            changed = values[state[values, a] >= 0]
            if not len(changed):
              continue
            self.tried += 1
            before = state[changed, a].copy()
            state[changed, a] = UNSHARDED
            tracker.update(changed)
            new = score_of(tracker, self.memory_limit)
            if better(new, best):
              best, best_move = new, changed
            state[changed, a] = before
            tracker.update(changed)
          if best_move is not None:
            state[best_move, a] = UNSHARDED
            tracker.update(best_move)
            score = score_of(tracker, self.memory_limit)
            moves += 1
            improved = True
          if time.perf_counter() >= deadline or self.tried >= tries:
            return state, score, moves
    return state, score, moves


def climb(program: Program, space: ActionSpace, state: State, memory_limit: float | None,
          tries: float) -> tuple[State, Score, int]:
  """Steepest descent over the search's own actions from `state`: each
  round prices every legal action one step ahead and takes the one of best
  score while it beats the plan's. Returns the climbed copy, its score and
  the actions priced (at most `tries`, rounded up to a whole round)."""
  work = state.copy()
  tracker = Tracker(program.model, work)
  score = score_of(tracker, memory_limit)
  priced = 0
  while priced < tries:
    here = work.copy()
    best, best_action = score, None
    for action in space.legal(here):
      tracker.update(space.apply(work, action))
      priced += 1
      new = score_of(tracker, memory_limit)
      if better(new, best):
        best, best_action = new, action
      tracker.move_to(here)
    if best_action is None:
      break
    tracker.update(space.apply(work, best_action))
    score = best
  return work, score, priced


# Plans refinement climbs (the best distinct ones), and the rounds of
# climbing and untiling each alternates at most.
_CLIMBED = 4
_ROUNDS = 6


def refine_best(program: Program, space: ActionSpace, candidates: list[tuple[State, Score]],
                memory_limit: float | None, seconds: float, tries: int | None = None,
                count: int = 16) -> tuple[State, Score, int]:
  """Refines the best of `candidates` (state, score) of up to `count`
  distinct scores, sharing `tries` moves tried (None: unbounded) and
  `seconds` between them, then, under a memory limit data parallelism does
  not meet, climbs the best `_CLIMBED` plans so far and the expert layouts
  (`climb`, alternating with untiling; as many tries again), and returns
  the best plan found, its score and the moves that made it. Runners-up
  matter: the search's best may sit in another basin (tensor-parallel
  experts) than the one refinement improves most (expert parallel).
  Bounded by tries, the result does not depend on the machine's speed."""
  deadline = time.perf_counter() + seconds
  ranked = _distinct(candidates, count)
  best_state, best_score = ranked[0]
  best_moves = 0
  left_tries = np.inf if tries is None else tries
  refiner = Refiner(program, space.colour, memory_limit)
  refined = []
  for i, (state, score) in enumerate(ranked):
    left = deadline - time.perf_counter()
    if left <= 0 or left_tries <= 0:
      refined.append((state, score))
      continue
    share = len(ranked) - i
    new_state, new_score, moves = refiner.run(
        state, left / share, None if tries is None else math.ceil(left_tries / share))
    left_tries -= refiner.tried
    refined.append((new_state, new_score) if better(new_score, score) else (state, score))
    if better(new_score, best_score):
      best_state, best_score, best_moves = new_state, new_score, moves
  experts = {} if memory_limit is None else expert_states(program, space)
  dp = experts.get("data parallel")
  if not experts or (dp is not None
                     and score_of(Tracker(program.model, dp), memory_limit)[0] == 0):
    # Climbing runs where the limit binds, data parallelism (the layout a
    # user writes first) over it: measured there (`benchmarks/limits.py`),
    # and under a device's capacity that most steps meet with room it
    # would cost seconds per search for gains not measured.
    return best_state, best_score, best_moves
  # The hand-written layouts climb too: a tight limit's best plan is often
  # an expert's with a few tilings added, a basin the search's prior may
  # never have led it to.
  starts = _distinct(refined, _CLIMBED) + [
      (state, score_of(Tracker(program.model, state), memory_limit))
      for state in experts.values()]
  climbing = np.inf if tries is None else tries
  for i, (state, score) in enumerate(starts):
    moves = 0
    for _ in range(_ROUNDS):
      left = deadline - time.perf_counter()
      if left <= 0 or climbing <= 0:
        break
      share = len(starts) - i
      climbed, climbed_score, priced = climb(program, space, state, memory_limit,
                                             climbing / share)
      climbing -= priced
      if not better(climbed_score, score):
        break
      state, score, untiled = refiner.run(climbed, left / share,
                                          None if tries is None else math.ceil(climbing / share))
      climbing -= refiner.tried
      moves += 1 + untiled
    if better(score, best_score):
      best_state, best_score, best_moves = state, score, moves
  return best_state, best_score, best_moves


def _distinct(candidates: list[tuple[State, Score]], count: int) -> list[tuple[State, Score]]:
  """The best `count` of `candidates` of distinct scores, best first."""
  ranked: list[tuple[State, Score]] = []
  for state, score in sorted(candidates, key=lambda c: c[1]):
    if not ranked or better(score, ranked[-1][1]) or better(ranked[-1][1], score):
      ranked.append((state, score))
      if len(ranked) == count:
        break
  return ranked
