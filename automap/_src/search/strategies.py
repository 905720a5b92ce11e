"""Per-op strategies for the exact search, priced by the cost model.

A strategy is which factor of an op's rule each mesh axis tiles (and where a
reduction factor is tiled, whether the partial result is all-reduced or
reduce-scattered); it fixes the layouts the op wants its operands in and
makes its results in. `StrategyPricer` enumerates an op's strategies and
prices each, and the reshards between layouts, with `CostModel`.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import numpy as np

from automap._src.cost.memo import OpCost
from automap._src.cost.model import CostModel
from automap._src.cost.program import Program
from automap._src.sharding.state import UNSHARDED

Layout = tuple[int, ...]  # per mesh axis, the dim it tiles or UNSHARDED


class Strategy(NamedTuple):
  """How one op computes.

  factors: per mesh axis, the factor of the op's rule it tiles (UNSHARDED: none).
  wants: per operand, the layout the op reads it in (None: a literal).
  makes: per result, the layout the op makes it in.
  seconds: compute plus result collectives, the latency of combinable
    (late) collectives left out.
  late: (kind, axes mask) of the combinable collectives it emits.
  compute: of seconds, the op's compute.
  hidden: of seconds, the collectives of a late op (`analysis.late_ops`:
    gradient reductions), which compute not waiting on them can hide.
  """

  factors: Layout
  wants: tuple[Layout | None, ...]
  makes: tuple[Layout, ...]
  seconds: float
  late: tuple[tuple[int, int], ...]
  compute: float = 0.0
  hidden: float = 0.0


def layouts(shape: tuple[int, ...], sizes: tuple[int, ...]) -> list[Layout]:
  """Every layout of an array of `shape`: per axis a dim or none, each dim
  divisible by the tiles it is cut into."""
  real = [a for a, s in enumerate(sizes) if s > 1]
  out = []
  for dims in itertools.product(range(-1, len(shape)), repeat=len(real)):
    row = [UNSHARDED] * len(sizes)
    tiles = [1] * len(shape)
    for a, d in zip(real, dims):
      row[a] = d
      if d >= 0:
        tiles[d] *= sizes[a]
    if all(n % t == 0 for n, t in zip(shape, tiles)):
      out.append(tuple(row))
  return out


class StrategyPricer:
  """Prices strategies of ops and reshards of values with `CostModel`."""

  def __init__(self, program: Program):
    self.program = program
    self.model: CostModel = program.model
    self.graph = program.graph
    self.sizes = program.mesh.axis_sizes
    self.scratch = np.full((self.graph.num_values, len(self.sizes)), UNSHARDED, np.int8)
    self.reshard_steps: dict[tuple, tuple] = {}
    self.costs: dict[tuple, OpCost] = {}  # (op class, member layouts) -> cost

  def strategies(self, o: int) -> list[Strategy]:
    """The strategies of op o that `CostModel` prices as they are (its
    derived layout is the strategy's, no operand resharded within)."""
    g, sizes = self.graph, self.sizes
    rule = g.rules[o]
    real = [a for a, s in enumerate(sizes) if s > 1]
    choices = [range(-1, len(rule.sizes))] * len(real)
    if rule.replicated or not rule.sizes:
      choices = [[-1]] * len(real)
    results = g.results[o]
    out = []
    for picks in itertools.product(*choices):
      factors = [UNSHARDED] * len(sizes)
      tiles = [1] * len(rule.sizes)
      for a, f in zip(real, picks):
        factors[a] = f
        if f >= 0:
          tiles[f] *= sizes[a]
      if any(n % t for n, t in zip(rule.sizes, tiles)):
        continue
      reducing = [a for a in real if factors[a] >= 0 and rule.reduction[factors[a]]]
      # Each reducing axis all-reduces (-1) or scatters into a result dim.
      options = [[-1] for _ in reducing]
      if len(results) == 1 and results[0] >= 0:
        dims = rule.results[0]
        # Any dim with a factor, even one another axis tiles too (the
        # cost model checks the nesting).
        free = [d for d in range(len(dims)) if dims[d] >= 0]
        options = [[-1] + free for _ in reducing]
      for scatter in itertools.product(*options):
        s = self._price(o, tuple(factors), dict(zip(reducing, scatter)))
        if s is not None:
          out.append(s)
    return out

  def _price(self, o: int, factors: Layout, scatter: dict[int, int]) -> Strategy | None:
    g, model, state = self.graph, self.model, self.scratch
    rule = g.rules[o]
    wants: list[Layout | None] = []
    for p, (v, dims) in enumerate(zip(g.operands[o], rule.operands)):
      if v < 0 or dims is None:
        wants.append(None)
        continue
      wants.append(tuple(rule.dim_of(p, f) if f >= 0 else UNSHARDED for f in factors))
    makes = []
    for r in range(len(g.results[o])):
      member = len(rule.operands) + r
      makes.append(tuple(scatter.get(a, -1) if f >= 0 and rule.reduction[f] else
                         (rule.dim_of(member, f) if f >= 0 else UNSHARDED)
                         for a, f in enumerate(factors)))
    members = [(v, w) for v, w in zip(g.operands[o], wants) if w is not None]
    members += [(v, m) for v, m in zip(g.results[o], makes) if v >= 0]
    layout: dict[int, Layout] = {}
    for v, row in members:
      if layout.setdefault(v, row) != row:
        return None  # one value read in two layouts at once
    for v, row in layout.items():
      tiles = [1] * g.rank(v)
      for a, d in enumerate(row):
        if d >= 0:
          tiles[d] *= self.sizes[a]
      if any(n % t for n, t in zip(g.shapes[v], tiles)):
        return None
      state[v] = row
    try:
      derived = model.layout(state, o)[0]
      key = (int(model.op_class[o]), tuple(row for _, row in members))
      cost = self.costs.get(key)
      if cost is None:
        cost = self.costs[key] = model.price(state, o)
    finally:
      state[list(layout)] = UNSHARDED
    if tuple(derived) != factors or cost.reshards:
      return None
    seconds, late = cost.time, []
    for kind, mask, _, sec, position, *_ in cost.comms:
      if position >= 0:
        return None  # a result the op cannot make in its own layout
      if model.combined(o, kind):  # with its kind's other late collectives
        sec -= model.latency[kind, mask]
        late.append((kind, mask))
      seconds += sec
    hidden = seconds - cost.time if model.late[o] else 0.0
    return Strategy(factors, tuple(wants), tuple(makes), seconds, tuple(late), cost.time, hidden)

  def steps(self, nbytes: int, have: Layout, want: Layout, shape: tuple[int, ...],
            fused: tuple[bool, bool]) -> tuple:
    """The collectives that reshard an array of `nbytes` and `shape` from
    `have` to `want`: ((kind, axes mask, layout after), seconds) each, one
    run, the copies laying its buffers out included (`fused` as
    `CostModel.transition` takes it). Readers of one value whose reshards
    pass through the same step share it."""
    key = (nbytes, have, want, shape, fused)
    steps = self.reshard_steps.get(key)
    if steps is None:
      tiles = math.prod(s for s, d in zip(self.sizes, have) if d >= 0)
      comms: list = []
      self.model.transition(comms, have, want, nbytes / tiles, 0, shape, fused)
      steps = self.reshard_steps[key] = tuple(
          ((k, m, t), sec + self.model.relayout_time(r)) for k, m, _, sec, _, t, r in comms)
    return steps


def op_classes(program: Program, colour: np.ndarray | None) -> np.ndarray:
  """[O] class of each op: ops of a class share one strategy (each its own
  without value colours)."""
  g = program.graph
  if colour is None:
    return np.arange(g.num_ops)
  index: dict = {}
  return np.array([index.setdefault(
      (int(program.model.op_class[o]), tuple(int(colour[v]) if v >= 0 else -1
                                             for v in g.operands[o] + g.results[o])),
      len(index)) for o in range(g.num_ops)], np.int64)
