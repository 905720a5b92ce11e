"""Monte Carlo tree search (PUCT) over sharding actions.

Nodes are sharding states, shared between every action sequence that
reaches them (a transposition table keyed by the state's bytes). An episode
walks down from the root choosing edges by

    Q(s, a) + c * P(s, a) * sqrt(N(s)) / (1 + N(s, a)),

where P comes from a `Policy` (uniform unless a learned one is given), Q is
the best normalised reward found below the edge (single-agent, deterministic:
the best continuation is what counts, not the average), and an unvisited
edge is valued as stopping at its parent. Only the first few actions of a
node in widening order compete (progressive widening: their number grows
with the square root of its visits). The episode ends when it takes the
"stop" edge, reaches the depth bound, or expands a new state; that state is
priced by the cost model (or valued by the policy) and the reward backed up.

Rewards: a plan within the memory limit scores t_root / t (its speed-up
over the root state); one over the limit scores below every feasible plan
(minus its excess over the limit), so it is never preferred. The best plan
seen is always kept.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from automap._src.cost.program import Program
from automap._src.cost.tracker import Tracker
from automap._src.search.actions import Action, ActionSpace
from automap._src.sharding.state import State

Score = tuple[float, float]  # (bytes over the memory limit, step seconds)
_STOP = -1
_UNSEEN = object()


class Policy(Protocol):
  """Guides the search: priors over a node's actions, and optionally a value
  for a state (None: price it with the cost model)."""

  def priors(self, space: ActionSpace, state: State,
             actions: Sequence[Action]) -> np.ndarray:
    """[len(actions) + 1] non-negative weights; the last is "stop"."""
    ...

  def value(self, space: ActionSpace, state: State) -> float | None:
    ...


class UniformPolicy:
  """Equal priors; states valued by the cost model."""

  def priors(self, space, state, actions):
    return np.full(len(actions) + 1, 1.0 / (len(actions) + 1))

  def value(self, space, state):
    return None


_UNIFORM = UniformPolicy()


@dataclasses.dataclass(frozen=True)
class MCTSSettings:
  c_puct: float = 2.5
  noise: float = 0.0  # share of Dirichlet noise in the root's priors
  max_depth: int = 12
  widen: float = 2.0  # actions admitted = widen * sqrt(visits + 1)
  # Nodes at most this deep (actions from the root) take the policy's
  # priors, deeper ones the search's `deep_policy` (uniform unless given;
  # None: every node takes the policy's); for priors that cost more per
  # expansion than the search they save.
  policy_depth: int | None = None


@dataclasses.dataclass(eq=False)
class Node:
  state: State
  score: Score
  path: tuple[Action, ...]  # the first action sequence that reached it
  actions: list[Action] | None = None
  priors: np.ndarray | None = None
  children: dict[int, Node | None] = dataclasses.field(default_factory=dict)
  visits: np.ndarray | None = None  # [K + 1] per edge, last = stop
  best: np.ndarray | None = None  # [K + 1] best reward below each edge
  total: int = 0
  value: float = 0.0  # what an episode ending here backs up


@dataclasses.dataclass
class MCTSResult:
  state: State
  score: Score
  path: tuple[Action, ...]
  episodes: int
  episode_of_best: int
  evaluations: int
  nodes: int
  seconds: float
  seconds_to_best: float


def score_of(tracker: Tracker, memory_limit: float | None) -> Score:
  if memory_limit is None or tracker.peak_bound() <= memory_limit:
    return (0.0, tracker.step_time)  # fits before results' buffers are counted
  return (max(0.0, tracker.peak_memory - memory_limit), tracker.step_time)


class Search:
  """One MCTS over a program's action space."""

  def __init__(self, program: Program, space: ActionSpace,
               memory_limit: float | None, seed: int = 0,
               policy: Policy | None = None, settings: MCTSSettings = MCTSSettings(),
               deep_policy: Policy | None = None):
    self.program, self.space = program, space
    self.memory_limit = memory_limit
    self.policy = policy or UniformPolicy()
    self.deep_policy = deep_policy or _UNIFORM
    self.settings = settings
    self.rng = np.random.default_rng(seed)
    self.state = program.initial_state()
    self.tracker = Tracker(program.model, self.state)
    self.root = Node(self.state.copy(), score_of(self.tracker, memory_limit), ())
    self.table: dict[bytes, Node] = {self.root.state.tobytes(): self.root}
    self.reference = self.root.score[1]
    self.root.value = self.reward(self.root)
    self.low = self.high = self.root.value  # the range of rewards seen
    self.best = self.root
    self.episodes = self.evaluations = self.episode_of_best = 0
    self.improved_at: list[int] = []  # the episodes that found a better plan
    self.t0 = time.perf_counter()
    self.seconds_to_best = 0.0

  def reward(self, node: Node) -> float:
    over, seconds = node.score
    if over > 0:
      return -over / (self.memory_limit or 1.0)
    return self.reference / max(seconds, 1e-30)

  def _expand(self, node: Node) -> None:
    actions = self.space.legal(node.state)
    depth = self.settings.policy_depth
    policy = self.policy if depth is None or len(node.path) <= depth else self.deep_policy
    priors = np.asarray(policy.priors(self.space, node.state, actions), float)
    if priors.shape != (len(actions) + 1,) or (priors < 0).any():
      raise ValueError(
          f"Policy.priors must return {len(actions) + 1} non-negative weights "
          f"(one per action, then stop), got shape {priors.shape}.")
    # Widening admits actions by prior, ties in the space's order.
    order = np.argsort(-priors[:-1], kind="stable")
    actions = [actions[i] for i in order]
    priors = np.append(priors[:-1][order], priors[-1])
    priors = priors / max(priors.sum(), 1e-30)
    if node is self.root and self.settings.noise > 0:
      # Exploration noise, as in AlphaZero (off by default).
      noise = self.rng.dirichlet(np.full(len(priors), 0.3))
      priors = (1 - self.settings.noise) * priors + self.settings.noise * noise
    node.actions, node.priors = actions, priors
    node.visits = np.zeros(len(actions) + 1, np.int64)
    node.best = np.full(len(actions) + 1, -np.inf)

  def _select(self, node: Node, low: float, high: float) -> int:
    """The edge of `node` to follow (`_STOP` for stop)."""
    k = len(node.actions)
    admitted = min(k, max(1, math.ceil(self.settings.widen * math.sqrt(node.total + 1))))
    edges = [i for i in range(admitted) if node.children.get(i, _UNSEEN) is not None]
    edges.append(k)
    edges = np.array(edges)
    priors = node.priors[edges]
    priors = priors / max(priors.sum(), 1e-30)
    span = max(high - low, 1e-12)
    own = (self.reward(node) - low) / span
    q = np.where(node.visits[edges] > 0, (node.best[edges] - low) / span, own)
    u = self.settings.c_puct * priors * math.sqrt(node.total + 1) / (1 + node.visits[edges])
    scores = q + u
    # The seed's say: which of equally promising edges goes first.
    top = np.flatnonzero(scores >= scores.max() - 1e-12)
    edge = int(edges[top[self.rng.integers(len(top))] if len(top) > 1 else top[0]])
    return _STOP if edge == k else edge

  def _evaluate(self, parent: Node, edge: int) -> Node | None:
    """Applies the edge's action to the parent's state; the node reached
    (None when the action changes nothing)."""
    action = parent.actions[edge]
    self.tracker.move_to(parent.state)
    changed = self.space.apply(self.state, action)
    self.tracker.update(changed)
    self.evaluations += 1
    key = self.state.tobytes()
    node = self.table.get(key)
    if node is parent:
      return None
    if node is not None:
      return node
    node = Node(self.state.copy(), score_of(self.tracker, self.memory_limit),
                parent.path + (action,))
    learned = self.policy.value(self.space, self.state)
    node.value = self.reward(node) if learned is None else float(learned)
    self.table[key] = node
    if better(node.score, self.best.score):
      self.best, self.episode_of_best = node, self.episodes + 1
      self.improved_at.append(self.episode_of_best)
      self.seconds_to_best = time.perf_counter() - self.t0
    return node

  def episode(self) -> None:
    """One walk from the root; backs up the value it ends on."""
    node, path = self.root, []
    while True:
      if node.actions is None:
        self._expand(node)
      edge = (_STOP if len(path) >= self.settings.max_depth
              else self._select(node, self.low, self.high))
      if edge == _STOP:
        path.append((node, len(node.actions)))
        value = self.reward(node)
        break
      child = node.children.get(edge, _UNSEEN)
      if child is _UNSEEN:
        child = node.children[edge] = self._evaluate(node, edge)
        if child is None:  # A no-op: pruned; the walk ends at the parent.
          value = self.reward(node)
        else:
          path.append((node, edge))
          value = child.value
        break
      path.append((node, edge))
      node = child
    self.low, self.high = min(self.low, value), max(self.high, value)
    for n, e in path:
      n.visits[e] += 1
      n.best[e] = max(n.best[e], value)
      n.total += 1
    self.episodes += 1

  def run(self, episodes: int, seconds: float,
          progress: Callable[[Search], None] | None = None,
          patience: int | None = None) -> MCTSResult:
    """Runs episodes until `episodes` in all, `seconds` since the search
    was made, or `patience` episodes in a row without a better plan;
    `progress` is called after each."""
    deadline = self.t0 + seconds
    while self.episodes < episodes and time.perf_counter() < deadline:
      if patience is not None and self.episodes - self.episode_of_best >= patience:
        break
      self.episode()
      if progress is not None:
        progress(self)
    return MCTSResult(self.best.state, self.best.score, self.best.path, self.episodes,
                  self.episode_of_best, self.evaluations, len(self.table),
                  time.perf_counter() - self.t0, self.seconds_to_best)


def better(a: Score, b: Score) -> bool:
  """Strictly better beyond float noise."""
  if a[0] != b[0]:
    return a[0] < b[0] - 1e-6 * max(b[0], 1.0)
  return a[1] < b[1] * (1 - 1e-9)
