"""Exact search: Alpa's intra-operator ILP, priced by the same cost model.

Every op picks one *strategy* (which factor of its rule each mesh axis
tiles; where an axis tiles a reduction factor, whether the partial result
is all-reduced or reduce-scattered into one of its dims), every argument a
layout. The objective is the step time: per op its compute and result
collectives, priced by `CostModel` on a state in which its members sit in
the strategy's layouts (late collectives pay their latency once per kind
and axes, as XLA combines them); per value and layout its readers want,
one reshard (`CostModel.transition`); overlapped where XLA overlaps
(`ilp_time.StepTime.objective`). An op may take only the strategy `CostModel`
derives from its operands' stored layouts, so the objective is the plan's
step time as `Tracker` prices it, except at gathers and scatters, whose
route XLA picks by the layouts their operands arrive in (`layouts.derive`).

A memory limit bounds the bytes alive at the program points where the
solution peaks, added lazily (solve, measure with `Tracker`, bound the
peak, solve again). Ops with equal Weisfeiler-Lehman colours share a
strategy, values in like positions their reshard terms; carried state
comes back in the layout it came in. The solution is a state like any
other: `plan.build.make_plan` prices it with `Tracker`, never with the
solver's model. Solved with OR-Tools CP-SAT; costs in integer picoseconds
and bytes.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import numpy as np
from ortools.sat.python import cp_model

from automap._src.cost.program import Program
from automap._src.cost.tracker import Tracker
from automap._src.ir import rules
from automap._src.ir.groups import colours
from automap._src.search.ilp_time import PICOSECONDS, StepTime, value_of
from automap._src.search.strategies import Layout, StrategyPricer, layouts, op_classes
from automap._src.sharding.state import UNSHARDED, State, empty_state

# Lazy memory rounds: a point is added per round where the solution peaks
# above the limit.
_MEMORY_ROUNDS = 8
# Points where the unsharded program peaks, bounded from the first round.
_FIRST_POINTS = 4

@dataclasses.dataclass(frozen=True)
class SolverSettings:
  seconds: float = 60.0
  share: bool = True  # ops with identical neighbourhoods share a strategy
  memory_limit: float | None = None
  seed: int = 0
  workers: int = 0  # CP-SAT search workers (0: one per core)


@dataclasses.dataclass
class Solution:
  """state: the solution (None when the solver found none in time).
  status: "optimal", "feasible" (time ran out first), "infeasible" or
    "unknown" (time ran out before any solution).
  objective / bound: the step time of the solution in the solver's model
    (which `Tracker` agrees with) and the solver's lower bound on any
    solution, seconds.
  least_memory: when infeasible, the least peak any strategy reaches at the
    bounded points (bytes per device), and the op where it peaks.
  """

  state: State | None
  status: str
  objective: float
  bound: float
  seconds: float
  rounds: int
  ops: int  # strategy choices (ops, or op classes when shared)
  variables: int
  least_memory: tuple[float, int] | None = None


class _Formulation:
  """The CP-SAT model of one program; memory points are added by `bound`.

  Decisions are one-hot strategy variables per op class and layout
  variables per argument class; every other variable is derived from them
  (recorded in `derived`, so a hint can set it too).
  """

  def __init__(self, program: Program, settings: SolverSettings):
    self.program, self.settings = program, settings
    g = program.graph
    self.graph = g
    self.real = [a for a, size in enumerate(program.mesh.axis_sizes) if size > 1]
    pricer = StrategyPricer(program)
    colour = colours(g) if settings.share else None
    self.cls = op_classes(program, colour)
    reps = {}
    for o in range(g.num_ops):
      reps.setdefault(int(self.cls[o]), o)
    self.strategies = {c: pricer.strategies(o) for c, o in reps.items()}
    m = self.model = cp_model.CpModel()
    # (variable, its value given the decisions' values by index), in order.
    self.derived: list[tuple[cp_model.IntVar, Callable[[dict], int]]] = []
    self.x = {c: [m.NewBoolVar(f"op{o}s{i}") for i in range(len(self.strategies[c]))]
              for c, o in reps.items()}
    for xs in self.x.values():
      m.AddExactlyOne(xs)
    # Seconds by variable (`ilp_time`), added as the variables they read are made.
    self.step_time = StepTime(self)
    self.step_time.add_ops(np.bincount(self.cls, minlength=len(reps)))
    self.inputs = self._arguments(np.arange(g.num_values) if colour is None else colour)
    self._lits: dict[tuple, cp_model.IntVar] = {}
    self._consistent()
    self._tie_carried()
    self.step_time.add_reshards(pricer)
    self.objective = self.step_time.objective()
    self.time = sum(x * k for x, k in self.objective)
    # Ties (equal step times) go to the plan holding fewer bytes of
    # arguments and results per device: 1 ps per KiB, far below any step.
    held = self.memory(None)
    self.tie_max = sum(k for _, k in held.values()) // 1024
    m.Minimize(self.time + sum(x * (k // 1024) for x, k in held.values()))
    self.points: list[int] = []
    self.variables = len(m.Proto().variables)

  def _arguments(self, colour: np.ndarray) -> dict[int, tuple[list[Layout], list]]:
    """Arguments (and constants): a layout each, shared by equal colours
    [V]; a pinned one a constant. {value: (its layouts, their variables)}."""
    g, program, m = self.graph, self.program, self.model
    inputs: dict[int, tuple[list[Layout], list]] = {}
    by_colour: dict[int, tuple[list[Layout], list]] = {}
    for v in range(g.num_values):
      if g.producer[v] >= 0:
        continue
      if program.fixed[v]:
        rows = [tuple(int(d) for d in program.pinned[v])]
        xs = [m.NewConstant(1)]
      else:
        key = int(colour[v])
        if key not in by_colour:
          rows = layouts(g.shapes[v], program.mesh.axis_sizes)
          xs = [m.NewBoolVar(f"in{v}l{i}") for i in range(len(rows))]
          m.AddExactlyOne(xs)
          by_colour[key] = (rows, xs)
        rows, xs = by_colour[key]
      inputs[v] = (rows, xs)
    return inputs

  def _tie_carried(self) -> None:
    """Carried state (parameters, optimizer moments) comes back in the
    layout it came in, as the next step reads it."""
    tied = set()
    for v, u in self.program.carried_pairs():
      if (key := (self.made_key(v), self.made_key(u))) in tied:
        continue
      tied.add(key)
      given, made = self.made(v), self.made(u)
      for row in set(given) | set(made):
        self.model.Add(sum(given.get(row, [])) == sum(made.get(row, [])))

  def any_of(self, xs: list, name: str) -> cp_model.IntVar:
    """A literal implied by each of `xs` (true when one is; the objective
    keeps it false otherwise)."""
    if len(xs) == 1:
      return xs[0]
    lit = self.model.NewBoolVar(name)
    for x in xs:
      self.model.AddImplication(x, lit)
    self.derived.append((lit, lambda h, xs=xs: max(h[x.Index()] for x in xs)))
    return lit

  def _sum(self, xs: list, name: str) -> cp_model.IntVar:
    """A literal equal to the sum of the exclusive `xs`."""
    if len(xs) == 1:
      return xs[0]
    lit = self.model.NewBoolVar(name)
    self.model.Add(lit == sum(xs))
    self.derived.append((lit, lambda h, xs=xs: sum(h[x.Index()] for x in xs)))
    return lit

  def layout_lit(self, v: int, row: Layout) -> cp_model.IntVar | None:
    """A literal true exactly when value v is made in layout `row` (None:
    it never is)."""
    key = (self.made_key(v), row)
    if key not in self._lits:
      xs = self.made(v).get(row)
      self._lits[key] = None if xs is None else self._sum(xs, f"v{v}l")
    return self._lits[key]

  def _tiled_lits(self, v: int, a: int, dims) -> list:
    """Literals, one true exactly when value v is made with axis a on one
    of `dims`."""
    out = []
    for e in dims:
      key = (self.made_key(v), a, e)
      if key not in self._lits:
        lits = [self.layout_lit(v, row) for row in self.made(v) if row[a] == e]
        self._lits[key] = self._sum(lits, f"v{v}a{a}d{e}") if lits else None
      if self._lits[key] is not None:
        out.append(self._lits[key])
    return out

  def _consistent(self) -> None:
    """Each op's strategy is the one `CostModel.layout` derives from the
    layouts its operands are made in: a reduction op's is its operand's;
    elsewhere a reduction factor is tiled on an axis
    only where an operand is stored tiled by it there and none by another
    reduction factor (the others are sliced to match), and a result's factor
    wins over an operand's reduction factor only where an operand is stored
    tiled by that factor too."""
    g, m = self.graph, self.model
    done = set()

    def once(lits: list) -> bool:
      key = tuple(sorted(y.Index() for y in lits))
      if key in done:
        return False
      done.add(key)
      return True

    for o in range(g.num_ops):
      rule = g.rules[o]
      if g.prims[o] in rules.REDUCTIONS and g.operands[o][0] >= 0 and not rule.replicated:
        # A reduction computes in its operand's layout as made, never
        # resharding it (`CostModel.layout`).
        c = int(self.cls[o])
        for x, strategy in zip(self.x[c], self.strategies[c]):
          lit = self.layout_lit(g.operands[o][0], strategy.wants[0])
          if lit is None:
            m.Add(x == 0)
          elif once([x.Not(), lit]):
            m.AddImplication(x, lit)
        continue
      if rule.replicated or not any(rule.reduction):
        continue
      c = int(self.cls[o])
      stored: dict[tuple[int, int], list] = {}  # (axis, factor) -> literals
      for a in self.real:
        for v, dims in zip(g.operands[o], rule.operands):
          if v >= 0 and dims is not None:
            for e, f in enumerate(dims):
              if f >= 0:
                stored.setdefault((a, f), []).extend(self._tiled_lits(v, a, [e]))
      reduced = {a: [y for f in range(len(rule.sizes)) if rule.reduction[f]
                     for y in stored.get((a, f), [])] for a in self.real}
      for x, strategy in zip(self.x[c], self.strategies[c]):
        for a in self.real:
          f = strategy.factors[a]
          forbid = []
          if f >= 0 and rule.reduction[f]:
            if once(clause := [x.Not(), *stored.get((a, f), [])]):
              m.AddBoolOr(clause)
            # No operand reduced over another factor there: which of two
            # would win is the cost model's tie-break, not the solver's.
            forbid = [y for g in range(len(rule.sizes)) if g != f and rule.reduction[g]
                      for y in stored.get((a, g), [])]
            scatter = strategy.makes[0][a] if strategy.makes else -1
            if scatter >= 0:
              forbid += stored.get((a, rule.results[0][scatter]), [])
          elif f >= 0:
            own = stored.get((a, f), [])
            for r in reduced[a]:  # no operand reduced there unless one holds f
              if once(clause := [x.Not(), *own, r.Not()]):
                m.AddBoolOr(clause)
          else:
            forbid = reduced[a]
          for r in forbid:
            if once([x.Not(), r.Not()]):
              m.AddImplication(x, r.Not())

  def made_key(self, v: int) -> tuple:
    """What value v is made by: its argument class, or its producer's class
    and result position (values in like positions share their literals)."""
    g = self.graph
    p = int(g.producer[v])
    if p < 0:
      return ("in", id(self.inputs[v][1]))
    return ("op", int(self.cls[p]), g.results[p].index(v))

  def made(self, v: int) -> dict[Layout, list]:
    """The layouts value v can be made in, each with the variables that
    choose it."""
    g = self.graph
    p = int(g.producer[v])
    out: dict[Layout, list] = {}
    if p < 0:
      rows, xs = self.inputs[v]
      for row, x in zip(rows, xs):
        out.setdefault(row, []).append(x)
      return out
    c, r = int(self.cls[p]), g.results[p].index(v)
    for x, s in zip(self.x[c], self.strategies[c]):
      out.setdefault(s.makes[r], []).append(x)
    return out

  def memory(self, point: int | None) -> dict:
    """Bytes per device alive at op index `point` (None: the resident
    arguments and results only), as {variable: bytes when it is chosen}."""
    g, model = self.graph, self.program.model
    alive = model.resident.copy()
    if point is not None:
      alive |= model.temporary & (model.start <= point) & (model.end >= point)
    coef: dict = {}
    for v in np.flatnonzero(alive):
      for row, xs in self.made(int(v)).items():
        tiles = math.prod(s for s, d in zip(self.program.mesh.axis_sizes, row) if d >= 0)
        b = math.ceil(float(g.nbytes[v]) / tiles)
        for x in xs:
          entry = coef.setdefault(x.Index(), [x, 0])
          entry[1] += b
    return coef

  def bound(self, point: int, limit: float) -> None:
    self.model.Add(_linear(self.memory(point)) <= int(limit))
    self.points.append(point)

  def decisions(self, state: State) -> dict[int, int]:
    """Variable values (by index) expressing `state`: per op class the
    strategy its first op computes in there, per argument its layout, and
    every derived variable to match (where the state is expressible)."""
    g, model = self.graph, self.program.model
    h: dict[int, int] = {}
    for _, xs in self.inputs.values():
      for x in xs:
        h.setdefault(x.Index(), int(len(xs) == 1))  # a pinned layout is a constant
    for v, (rows, xs) in self.inputs.items():
      row = tuple(int(d) for d in state[v])
      if row in rows and len(xs) > 1:
        h[xs[rows.index(row)].Index()] = 1
    done = set()
    for o in range(g.num_ops):
      c = int(self.cls[o])
      if c in done:
        continue
      done.add(c)
      factors = tuple(int(f) for f in model.layout(state, o)[0])
      makes = tuple(tuple(int(d) for d in state[v]) if v >= 0 else None
                    for v in g.results[o])
      options = [i for i, s in enumerate(self.strategies[c]) if s.factors == factors]
      exact = [i for i in options if self.strategies[c][i].makes == makes]
      pick = (exact or options or [0])[0]
      for i, x in enumerate(self.x[c]):
        h[x.Index()] = int(i == pick)
    self._derive(h)
    return h

  def hint(self, state: State) -> None:
    """Starts the solver from `state` (`decisions`)."""
    h = self.decisions(state)
    for var, _ in self.derived:
      self.model.AddHint(var, h[var.Index()])
    for xs in list(self.x.values()) + [xs for _, xs in self.inputs.values()]:
      if len(xs) > 1 and xs[0].Index() in h:
        for x in xs:
          self.model.AddHint(x, h.pop(x.Index()))

  def seconds(self, solver: cp_model.CpSolver) -> float:
    """The step time of the solver's decisions, every derived variable at
    the value the decisions imply (a feasible solution may leave slack in
    them; an optimal one does not)."""
    h = {x.Index(): int(solver.Value(x)) for xs in self.x.values() for x in xs}
    h.update((x.Index(), int(solver.Value(x)))
             for _, xs in self.inputs.values() for x in xs)
    self._derive(h)
    return linear_seconds(self, h)

  def _derive(self, h: dict[int, int]) -> None:
    """Adds to `h` (decision values by variable index) the value every
    derived variable takes, in the order they were made."""
    for var, value in self.derived:
      h[var.Index()] = int(value(h))

  def state(self, solver: cp_model.CpSolver) -> State:
    g, program = self.graph, self.program
    state = np.full((g.num_values, program.mesh.num_axes), UNSHARDED, np.int8)
    for v, (rows, xs) in self.inputs.items():
      state[v] = rows[_chosen(solver, xs)]
    for o in range(g.num_ops):
      c = int(self.cls[o])
      s = self.strategies[c][_chosen(solver, self.x[c])]
      for v, row in zip(g.results[o], s.makes):
        if v >= 0:
          state[v] = row
    return state


def linear_seconds(form: _Formulation, h: dict[int, int]) -> float:
  """The step time of `form`'s objective (`StepTime.objective`), for
  variable values `h` (derived variables included, `_Formulation._derive`)."""
  return value_of(form.objective, h) / PICOSECONDS


def _linear(coef: dict):
  """The linear expression of a {key: (variable, coefficient)} map."""
  return sum(k * x for x, k in coef.values())


def _chosen(solver: cp_model.CpSolver, xs: list) -> int:
  return next(i for i, x in enumerate(xs) if solver.BooleanValue(x))


def solve(program: Program, settings: SolverSettings = SolverSettings(),
          hint: State | None = None) -> Solution:
  """Solves the program's ILP, starting from `hint` if given (a good plan
  found otherwise); see the module docstring."""
  start = time.perf_counter()
  form = _Formulation(program, settings)
  if hint is not None:
    form.hint(hint)
  limit = settings.memory_limit
  replicated = Tracker(program.model, empty_state(program.graph, program.mesh))
  # Bounds seeded where the replicated program peaks, unless even it fits
  # (a device's capacity, the default limit, mostly does): a solution over
  # the limit still adds the bound where it peaks, round by round.
  if limit is not None and replicated.peak_memory > limit:
    live = replicated.live
    for point in np.argsort(-live[:program.graph.num_ops], kind="stable")[:_FIRST_POINTS]:
      form.bound(int(point), limit)
  solver = cp_model.CpSolver()
  solver.parameters.random_seed = settings.seed
  solver.parameters.num_workers = settings.workers
  found = None  # (state, status, objective, bound) of the last solution
  rounds = 0
  while rounds <= _MEMORY_ROUNDS:
    rounds += 1
    left = settings.seconds - (time.perf_counter() - start)
    solver.parameters.max_time_in_seconds = max(left, 0.0)
    # Building the model may spend the budget: then the solver is not run.
    code = solver.Solve(form.model) if left > 0 else cp_model.UNKNOWN
    if code == cp_model.INFEASIBLE:
      return Solution(None, "infeasible", math.nan, math.nan, time.perf_counter() - start,
                    rounds, len(form.x), form.variables, _least_memory(form, settings))
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
      break  # out of time: the last solution stands
    found = (form.state(solver), "optimal" if code == cp_model.OPTIMAL else "feasible",
             form.seconds(solver),
             max(0.0, solver.BestObjectiveBound() - form.tie_max) / PICOSECONDS)
    if limit is None:
      break
    tracker = Tracker(program.model, found[0])
    point = tracker.peak()[1]
    if tracker.peak_memory <= limit or point in form.points:
      break  # within the limit, or over it only by the solver model's error
    form.bound(point, limit)
  seconds = time.perf_counter() - start
  if found is None:
    return Solution(None, "unknown", math.nan, math.nan, seconds, rounds, len(form.x),
                  form.variables)
  return Solution(*found, seconds, rounds, len(form.x), form.variables)


def _least_memory(form: _Formulation, settings: SolverSettings) -> tuple[float, int]:
  """The least peak, over the bounded points, that any choice of strategies
  reaches (bytes per device), and the point where it peaks."""
  probe = _Formulation(form.program, dataclasses.replace(settings, memory_limit=None))
  total = int(form.graph.nbytes.sum())
  peak = probe.model.NewIntVar(0, total, "peak")
  memory = {point: _linear(probe.memory(point)) for point in form.points}
  for expr in memory.values():
    probe.model.Add(expr <= peak)
  probe.model.ClearObjective()
  probe.model.Minimize(peak)
  solver = cp_model.CpSolver()
  solver.parameters.max_time_in_seconds = max(settings.seconds / 4, 1.0)
  found = solver.Solve(probe.model) in (cp_model.OPTIMAL, cp_model.FEASIBLE)
  at = (max(form.points, key=lambda p: solver.Value(memory[p])) if found
        else form.points[0])
  return float(solver.BestObjectiveBound()), at
