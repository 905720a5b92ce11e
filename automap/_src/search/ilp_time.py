"""The exact search's objective (`ilp`): the step time of its decisions.

`StepTime` collects it as (variable, integer picoseconds) terms, in the
order the formulation makes the variables they read: the ops' strategies
and the late collectives' latencies (`add_ops`), the values' reshards
(`add_reshards`), then the overlap (`objective`). It reads the
formulation through its public surface: `program`, `graph`, `model` (the
CP-SAT model), `cls`, `x`, `strategies`, `derived`, `made`, `made_key`,
`layout_lit` and `any_of`.
"""

from __future__ import annotations

import numpy as np
from ortools.sat.python import cp_model

from automap._src.search.strategies import Layout, StrategyPricer

PICOSECONDS = 1e12


class StepTime:
  """The step time of a formulation's decisions, as (variable, picoseconds)
  terms: in all (`terms`), of which compute (`compute`), of which
  communication that compute can hide (`hidden`). Terms are added in the
  order the formulation makes its variables (`add_ops`, `add_reshards`),
  then `objective` gives the time to minimise."""

  def __init__(self, form):
    self.form = form
    self.terms: list[tuple[cp_model.IntVar, int]] = []
    self.compute: list[tuple[cp_model.IntVar, int]] = []
    self.hidden: list[tuple[cp_model.IntVar, int]] = []

  def add_ops(self, count: np.ndarray) -> None:
    """Each op class's strategies, `count` [classes] ops each: their
    seconds, and per kind and axes of their late collectives one latency,
    paid where any strategy with one is chosen."""
    form = self.form
    late: dict[tuple[int, int], list] = {}
    for c, xs in form.x.items():
      for x, s in zip(xs, form.strategies[c]):
        self.terms.append((x, picoseconds(s.seconds * count[c])))
        self.compute.append((x, picoseconds(s.compute * count[c])))
        self.hidden.append((x, picoseconds(s.hidden * count[c])))
        for key in s.late:
          late.setdefault(key, []).append(x)
    for (kind, mask), xs in late.items():
      self.terms.append((form.any_of(xs, f"latency{kind}_{mask}"),
                         picoseconds(form.program.model.latency[kind, mask])))
      self.hidden.append(self.terms[-1])

  def add_reshards(self, pricer: StrategyPricer) -> None:
    """Reshards: per value (deduplicated over values in like positions) and
    per layout its readers want, one copy."""
    g, cls = self.form.graph, self.form.cls
    alike: dict[tuple, list[int]] = {}  # position -> [a value there, count]
    for v in range(g.num_values):
      if g.uses[v]:
        key = (self.form.made_key(v), tuple(sorted((int(cls[o]), p) for o, p in g.uses[v])))
        alike.setdefault(key, [v, 0])[1] += 1
    for v, n in alike.values():
      copies: list[tuple[cp_model.IntVar, int]] = []
      self._reshards(v, n, pricer, copies)
      self.terms += copies
      if g.producer[v] < 0:  # an argument's reshard can start with the step
        self.hidden += copies

  def _reshards(self, v: int, n: int, pricer: StrategyPricer, terms: list) -> None:
    """Adds to `terms` the reshards of value v, `n` values alike: per
    layout its readers want, the copy from the layout it is made in, a
    step several of them pass through made once."""
    form = self.form
    if form.program.model.free[v]:
      return  # XLA makes it anew in each layout its readers want
    g, m = form.graph, form.model
    made = list(form.made(v))
    wanted: dict[Layout, list] = {}
    trips: dict[Layout, int] = {}
    for o, p in g.uses[v]:
      if form.program.model.dead[o]:
        continue  # XLA removes it; what it reads needs no copy
      c = int(form.cls[o])
      for x, s in zip(form.x[c], form.strategies[c]):
        w = s.wants[p]
        if w is None:
          continue
        wanted.setdefault(w, []).append(x)
        trips[w] = max(trips.get(w, 1), int(g.trips[o]))
    nbytes, n_made = int(g.nbytes[v]), len(made)
    a = form.program.model.analysis
    fused = (bool(a.loop_made[v]), bool(a.loop_read[v]))
    steps = {(row, w): pricer.steps(nbytes, row, w, g.shapes[v], fused)
             for row in made for w in wanted}
    # A step (from a layout, a collective, the layout after) that the
    # reshards to several wanted layouts pass through is made once.
    sharing: dict[tuple, list[Layout]] = {}
    for (row, w), ss in steps.items():
      for step, _ in ss:
        sharing.setdefault((row, step), []).append(w)
    shared = {key: ws for key, ws in sharing.items() if len(ws) > 1}
    for (row, step), ws in shared.items():
      sec = dict(steps[(row, ws[0])])[step]
      k = picoseconds(sec * max(trips[w] for w in ws) * n)
      if not k:
        continue
      want = form.any_of([x for w in ws for x in wanted[w]], f"v{v}want")
      if n_made == 1:
        terms.append((want, k))
        continue
      paid, y = m.NewBoolVar(f"v{v}copy"), form.layout_lit(v, row)
      m.AddBoolOr([want.Not(), y.Not(), paid])
      form.derived.append((paid, lambda h, want=want, y=y: h[want.Index()] * h[y.Index()]))
      terms.append((paid, k))
    for w, readers in wanted.items():
      price = [(row, picoseconds(sum(sec for step, sec in steps[(row, w)]
                            if (row, step) not in shared) * trips[w] * n))
               for row in made]
      price = [(row, k) for row, k in price if k]
      if not price:
        continue
      want = form.any_of(readers, f"v{v}want")
      if n_made == 1:  # the value's layout is known: the copy is the readers'
        terms.append((want, price[0][1]))
        continue
      costly = [(form.layout_lit(v, row), k) for row, k in price]
      paid = m.NewIntVar(0, max(k for _, k in costly), f"v{v}copy")
      m.Add(paid >= sum(k * y for y, k in costly)).OnlyEnforceIf(want)
      form.derived.append((paid, lambda h, want=want, costly=costly: h[want.Index()] * sum(
          k * h[y.Index()] for y, k in costly)))
      terms.append((paid, 1))

  def objective(self) -> list[tuple[cp_model.IntVar, int]]:
    """The step time to minimise, as (variable, picoseconds) terms.

    Where collectives run in place, the serial sum. Where XLA runs them
    asynchronously, a linear model of the schedule in `cost.overlap`:
    collectives whose inputs are ready early (an argument's reshard, such
    as FSDP's gathers) or whose results are read late (gradient
    reductions) run beside compute, the rest wait on it, so

      step = compute + blocking + max(0, hideable - compute),

    the exposed part an integer variable bounded below by both. It drops
    the schedule's order (hideable communication hides behind any compute,
    not only the compute after it is ready); the plan the solver returns
    is priced by `Tracker` on the schedule itself, and the driver keeps
    its warm start when that is faster (checked against the schedule in
    `tests/search/test_ilp.py`)."""
    self.terms = [(x, k) for x, k in self.terms if k]
    self.compute = [(x, k) for x, k in self.compute if k]
    self.hidden = [(x, k) for x, k in self.hidden if k]
    form = self.form
    if not form.program.model.compiler.async_collectives or not self.hidden:
      return self.terms
    exposed = form.model.NewIntVar(0, sum(k for _, k in self.hidden), "exposed")
    form.model.Add(exposed >= linear_of(self.hidden) - linear_of(self.compute))
    form.derived.append((exposed, lambda h: max(
        0, value_of(self.hidden, h) - value_of(self.compute, h))))
    return self.terms + [(x, -k) for x, k in self.hidden] + [(exposed, 1)]


def linear_of(terms: list) -> cp_model.LinearExpr:
  """The linear expression of (variable, coefficient) terms."""
  return sum(x * k for x, k in terms)


def value_of(terms: list, h: dict[int, int]) -> int:
  """The value of (variable, coefficient) terms for variable values `h`."""
  return sum(k * h[x.Index()] for x, k in terms)


def picoseconds(seconds: float) -> int:
  return int(round(seconds * PICOSECONDS))


__all__ = ["PICOSECONDS", "StepTime", "linear_of", "picoseconds", "value_of"]
