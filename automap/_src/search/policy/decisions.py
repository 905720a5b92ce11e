"""The decisions the search can take on one program, and what each does.

A decision is an action up to the interchange of equal-size mesh axes:
`Tile(group, dim, axis)` is the decision ("tile", group, dim, size of the
axis), `Tactic(name, axes)` the decision ("tactic", name, sizes of the
axes). Two axes of one size are alike to the search's reward on every
mesh the hardware spec treats as one network (`Hardware.link_bandwidth`
per axis), so a decision is scored once and its score serves each of its
actions.

Each decision is described in terms that recur across model families,
computed once per program from the start state:

- what it lays out: the dim's role for each op that reads the group's
  members (contracted, batch, free or whole, as the factor rules see it),
  the dim's size and position, and the values one tiling lays out
  (the propagation class);
- where it sits: the group's share of FLOPs, of argument bytes and of the
  start state's peak;
- what one step of it does: the cost model's change in log step time,
  compute, communication and peak, the ops it makes communicate (the
  conflicts propagation leaves), and where those changes rank among the
  program's decisions;
- the setting: mesh, the hardware's ratios, and the memory limit against
  data parallelism's peak.

Any change here must bump `features.SCHEMA`: weights trained on one set of
columns are meaningless on another.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from automap._src.cost.tracker import Tracker
from automap._src.search.actions import Action, ActionSpace, Tile
from automap._src.sharding.state import State

TACTICS = ("data-parallel", "megatron", "fsdp", "sequence")
MAX_DIMS = 4  # dim positions one-hot; later dims share the last slot

# Decision key: ("tile", group, dim, axis size) or ("tactic", name, sizes).
Key = tuple

_KIND = 0  # tile, then one column per tactic
_DIM = _KIND + 1 + len(TACTICS)
_SHAPE = _DIM + MAX_DIMS + 1  # last dim, log size, rank
_AXES = _SHAPE + 3  # devices, alternatives
_ROLE = _AXES + 2  # contracted, batch, free, whole
_MEMBERS = _ROLE + 4  # state, data, intermediate
_STEP = _MEMBERS + 3  # propagation class and one-step changes
_STEP_COLS = 10
_GROUP = _STEP + _STEP_COLS  # FLOPs, bytes, peak shares
_RANKS = _GROUP + 3  # percentiles among the program's decisions
_SETTING = _RANKS + 3  # limit, limit vs DP, peak vs limit, hardware, devices
FEATURES = _SETTING + 6


def key_of(space: ActionSpace, action: Action) -> Key:
  sizes = space.program.mesh.axis_sizes
  if isinstance(action, Tile):
    return ("tile", action.group, action.dim, sizes[action.axis])
  return ("tactic", action.name, tuple(sorted(sizes[a] for a in action.axes)))


@dataclasses.dataclass(frozen=True)
class Decisions:
  """The decisions of one program and their features.

  keys: [D] decision keys; features: [D, FEATURES] float32; group: [D] the
  group a tiling acts on (-1 for a tactic); index: key -> row; actions:
  per row, the actions of that decision (its equal-size axes); outcome:
  [D] the id of the layouts its actions make from the start state (two
  decisions of one outcome lay out the same values the same way: a tiling
  of the batch's propagation class and data parallelism on that axis).
  """

  keys: tuple[Key, ...]
  features: np.ndarray
  group: np.ndarray
  index: dict
  actions: tuple[tuple[Action, ...], ...]
  outcome: np.ndarray

  def rows_of(self, space: ActionSpace, actions: list[Action]) -> np.ndarray:
    """[K] the row of each action's decision."""
    return np.array([self.index[key_of(space, a)] for a in actions], np.int64)


def _roles(g, members: tuple[int, ...], dim: int) -> np.ndarray:
  """[4] the share of reads of `dim` of `members` in which the op's factor
  rule contracts it, runs it through every operand (batch), carries it to
  a result from this operand only (free), or keeps it whole."""
  out = np.zeros(4)
  for v in members:
    if dim >= g.rank(v):
      continue
    for o, p in g.uses[v]:
      rule = g.rules[o]
      dims = None if rule.replicated else rule.operands[p]
      f = -1 if dims is None or dim >= len(dims) else dims[dim]
      if f < 0:
        out[3] += 1
      elif rule.reduction[f]:
        out[0] += 1
      else:
        shaped = [d for d in rule.operands if d]
        out[1 if len(shaped) > 1 and all(f in d for d in shaped) else 2] += 1
  return out / max(out.sum(), 1.0)


def _percentile(x: np.ndarray) -> np.ndarray:
  """Each entry's rank among x in [0, 1] (ties share their mean rank)."""
  if len(x) < 2:
    return np.full(len(x), 0.5)
  order = np.argsort(x, kind="stable")
  ranks = np.empty(len(x))
  ranks[order] = np.arange(len(x))
  for value in np.unique(x):  # ties alike
    same = x == value
    ranks[same] = ranks[same].mean()
  return ranks / (len(x) - 1)


class _Stepper:
  """Prices one action from the start state and undoes it. Many actions
  lay out the same values the same way (every tiling of the batch's
  propagation class is data parallelism on that axis): each distinct
  result is priced once."""

  def __init__(self, space: ActionSpace, start: State, memory_limit: float | None):
    self.space, self.start, self.limit = space, start, memory_limit
    self.state = start.copy()
    self.tracker = Tracker(space.program.model, self.state)
    self.base = self._measure()
    # Each distinct result: its number and [after - before] of the measures.
    self.seen: dict[bytes, tuple[int, np.ndarray]] = {}

  def _measure(self) -> np.ndarray:
    t = self.tracker
    peak = t.peak_memory
    excess = 0.0
    if self.limit is not None and peak > self.limit:
      excess = math.log(peak / self.limit)
    return np.array([math.log(max(t.step_time, 1e-30)), t.compute, t.comm_time,
                     math.log(max(peak, 1.0)), excess, len(t.ops_with_collectives())])

  def step(self, action: Action) -> tuple[np.ndarray, int, np.ndarray]:
    """(changed values, the result's number, [after - before] of the
    measures)."""
    self.space.apply(self.state, action)
    changed = np.flatnonzero((self.state != self.start).any(axis=1))
    key = changed.tobytes() + self.state[changed].tobytes()
    if key not in self.seen:
      self.tracker.update(changed)
      self.seen[key] = (len(self.seen), self._measure() - self.base)
      self.state[changed] = self.start[changed]
      self.tracker.update(changed)
    else:
      self.state[changed] = self.start[changed]
    return (changed, *self.seen[key])


def describe(space: ActionSpace, memory_limit: float | None = None,
             dp_peak: float | None = None) -> Decisions:
  """Every decision of `space` and its features, from the start state.
  `dp_peak`: data parallelism's peak in bytes (for the limit's column)."""
  program = space.program
  g, mesh, hw = program.graph, program.mesh, program.hardware
  start = program.initial_state()
  stepper = _Stepper(space, start, memory_limit)
  root_time = max(math.exp(stepper.base[0]), 1e-30)
  total_bytes = max(float(g.nbytes.sum()), 1.0)
  arg_bytes = max(float(g.nbytes[list(g.inputs)].sum()), 1.0)
  total_flops = max(float((g.flops * g.trips).sum()), 1.0)
  start_peak = math.exp(stepper.base[3])
  carried, data = set(space.experts.carried), set(space.data)
  sizes = mesh.axis_sizes

  actions: dict[Key, list[Action]] = {}
  for action in list(space.tactics) + list(space.tiles):
    actions.setdefault(key_of(space, action), []).append(action)
  keys = list(actions)
  outcomes: dict[tuple, int] = {}
  outcome = np.zeros(len(keys), np.int64)
  feats = np.zeros((len(keys), FEATURES))
  group = np.full(len(keys), -1, np.int64)
  for row, key in enumerate(keys):
    f = feats[row]
    members: tuple[int, ...] = ()
    if key[0] == "tile" or key[1] == "expert":
      if key[0] == "tile":
        _, gi, dim, size = key
        group[row] = gi
        members = space.groups[gi].members
      else:
        # Expert parallelism tiles every layer's experts along their expert
        # dim: described as that tiling of one group of them, in the
        # columns the tilings have (no column of its own, so weights
        # trained before it score it as the tiling it is).
        members = tuple(w for w, _ in space.experts.expert_weights)
        dim = int(np.bincount([d for _, d in space.experts.expert_weights]).argmax())
        size = key[2][0]
      f[_KIND] = 1
      f[_DIM + min(dim, MAX_DIMS - 1)] = 1
      ranks = np.array([g.rank(v) for v in members])
      f[_SHAPE] = float((ranks == dim + 1).mean())
      f[_SHAPE + 1] = np.mean([math.log2(g.shapes[v][dim] + 1) / 16 for v in members
                               if dim < g.rank(v)] or [0.0])
      f[_SHAPE + 2] = float(ranks.mean()) / 4
      f[_AXES] = math.log2(size) / 4
      f[_ROLE:_ROLE + 4] = _roles(g, members, dim)
    else:
      _, name, axis_sizes = key
      f[_KIND + 1 + TACTICS.index(name)] = 1
      f[_DIM + MAX_DIMS] = 1
      f[_AXES] = math.log2(math.prod(axis_sizes)) / 4
    f[_AXES + 1] = len(actions[key]) / max(len(sizes), 1)
    if members:
      kinds = np.array([0 if v in carried else 1 if v in data else 2 for v in members])
      f[_MEMBERS:_MEMBERS + 3] = np.bincount(kinds, minlength=3) / len(kinds)
      ops = {o for v in members for o in g.touching[v]}
      f[_GROUP] = sum(float(g.flops[o] * g.trips[o]) for o in ops) / total_flops
      nbytes = float(g.nbytes[list(members)].sum())
      f[_GROUP + 1] = min(nbytes / arg_bytes, 1.0)
      f[_GROUP + 2] = min(nbytes / max(start_peak, 1.0), 4.0)
    # One step from the start, averaged over the decision's actions.
    steps, made = [], []
    for action in actions[key]:
      changed, result, delta = stepper.step(action)
      made.append(result)
      steps.append([math.log2(len(changed) + 1) / 16,
                    float(g.nbytes[changed].sum()) / total_bytes,
                    math.log2(1 + max(delta[5], 0)) / 8,
                    math.log2(1 + max(-delta[5], 0)) / 8,
                    delta[0],
                    delta[1] / root_time,
                    delta[2] / root_time,
                    delta[3],
                    delta[4],
                    float(len(changed) > 0)])
    # Clipped: a program of next to no work makes ratios to it meaningless.
    f[_STEP:_STEP + _STEP_COLS] = np.clip(np.mean(steps, axis=0), -16, 16)
    outcome[row] = outcomes.setdefault(tuple(sorted(made)), len(outcomes))
  # Where each decision's change ranks among the program's.
  f = feats
  f[:, _RANKS] = _percentile(f[:, _STEP + 4])
  f[:, _RANKS + 1] = _percentile(f[:, _STEP + 7])
  f[:, _RANKS + 2] = _percentile(f[:, _STEP + 4] + f[:, _STEP + 8])
  f[:, _SETTING] = memory_limit is not None
  if memory_limit is not None:
    if dp_peak:
      f[:, _SETTING + 1] = min(memory_limit / dp_peak, 2.0)
    f[:, _SETTING + 2] = float(np.clip(math.log(start_peak / memory_limit), -4, 4))
  f[:, _SETTING + 3] = math.log10(hw.flops / hw.link_bandwidth) / 6
  f[:, _SETTING + 4] = math.log10(hw.link_bandwidth / hw.network_bandwidth)
  f[:, _SETTING + 5] = math.log2(mesh.num_devices) / 8
  return Decisions(tuple(keys), feats.astype(np.float32), group,
                   {k: i for i, k in enumerate(keys)},
                   tuple(tuple(actions[k]) for k in keys), outcome)


__all__ = ["FEATURES", "Decisions", "Key", "describe", "key_of"]
