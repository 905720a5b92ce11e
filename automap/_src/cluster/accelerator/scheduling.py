"""Operator scheduling: a layer's operators over an accelerator's cores.

Each op runs either on a single core or spread over all of them, at the
latencies `accelerator.latency` gives; precedence edges (i, j) make j start
after i ends.

Scheduling (CP-SAT): per op, either one interval on every core's NoOverlap
(spread) or an optional interval on each core with exactly one present;
start_j >= end_i per edge (i, j); minimise the makespan. Times are integer
ticks of 1 / _RESOLUTION of the shortest positive latency, so rounding moves
no latency by more than 0.05% (unless latencies span a factor over ~10^9, when
the tick coarsens to keep the horizon under _MAX_TICKS); "optimal" is to the
tick. A greedy list schedule seeds the solver (hint and horizon) and stands
when the time limit leaves no better answer; the reported times are the
chosen decisions replayed in seconds, never the ticks.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections.abc import Sequence

from ortools.sat.python import cp_model

from automap._src.cluster.accelerator.chip import (
  Accelerator,
  AcceleratorError,
  Op,
  is_int,
  is_real,
  latency,
)

# Ticks per shortest positive latency in the scheduling ILP.
_RESOLUTION = 1000
# Ticks in the longest schedule at most; wider ranges coarsen the tick.
_MAX_TICKS = 2**40
# The greedy schedules tried, best kept (see _greedy).
_GREEDY_RULES = ("finish", "work", "spread", "single")
# The "work" rule spreads an op when that costs at most this many times its
# core-time on one core.
_SPREAD_WORK = 1.25


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Ops of one layer on the cores of an accelerator."""

  makespan: float           # seconds
  start: tuple[float, ...]  # per op, seconds
  spread: tuple[bool, ...]  # per op: over all cores (True) or on one core
  core: tuple[int, ...]     # per op: its core, -1 when spread
  status: str               # "optimal" | "feasible" (time ran out first)

  def ends(self, single: Sequence[float], spread: Sequence[float]) -> tuple[float, ...]:
    """Per op, when it finishes (seconds), given the latencies it was scheduled with."""
    return tuple(s + (p if on_all else one) for s, on_all, one, p
                 in zip(self.start, self.spread, single, spread))


def schedule_latencies(single: Sequence[float], spread: Sequence[float],
                       edges: Sequence[tuple[int, int]], cores: int,
                       seconds: float = 10.0) -> Schedule:
  """The shortest schedule of ops with these latencies (seconds on one core and
  spread over all `cores`) under precedence `edges` (i, j): j starts after i
  ends. `seconds` bounds the solver's time; past it, the best schedule found."""
  began = time.perf_counter()
  single, spread = _latencies(single, "single"), _latencies(spread, "spread")
  if len(single) != len(spread):
    raise AcceleratorError(
        f"single and spread must give one latency per op each, got {len(single)} and "
        f"{len(spread)}.")
  if not is_int(cores) or cores < 1:
    raise AcceleratorError(f"cores must be a positive int, got {cores!r}.")
  if not is_real(seconds) or not seconds >= 0:
    raise AcceleratorError(f"seconds must be a time limit >= 0, got {seconds!r}.")
  n = len(single)
  preds, order = _predecessors_and_order(edges, n)
  if n == 0:
    return Schedule(0.0, (), (), (), "optimal")
  positive = [x for x in single + spread if x > 0]
  longest = sum(max(a, b) for a, b in zip(single, spread))
  tick = max(min(positive) / _RESOLUTION, longest / _MAX_TICKS) if positive else 1.0
  one = [_ticks(x, tick) for x in single]
  every = [_ticks(x, tick) for x in spread]
  hint = min((_greedy(one, every, preds, order, cores, rule) for rule in _GREEDY_RULES),
             key=lambda decisions: max(e for _, e, _ in decisions))
  best = _replay(hint, single, spread, preds, order, cores)
  horizon = max(e for _, e, _ in hint)
  if horizon <= _lower_bound(one, every, preds, order, cores):
    return dataclasses.replace(best, status="optimal")
  found = _solve(one, every, preds, cores, hint, horizon, began + seconds)
  if found is None:
    return best
  decisions, status = found
  solved = dataclasses.replace(_replay(decisions, single, spread, preds, order, cores),
                               status=status)
  return solved if solved.makespan <= best.makespan else dataclasses.replace(best, status=status)


def schedule(ops: Sequence[Op], edges: Sequence[tuple[int, int]], acc: Accelerator,
             seconds: float = 10.0) -> Schedule:
  """The shortest schedule of `ops` on `acc`'s cores (see `schedule_latencies`)."""
  if not isinstance(acc, Accelerator):
    raise AcceleratorError(f"acc must be an automap Accelerator, got {type(acc).__name__}.")
  ops = list(ops)
  single = [latency(op, acc, 1) for op in ops]
  spread = [latency(op, acc, acc.tensor_units) for op in ops]
  return schedule_latencies(single, spread, edges, acc.tensor_units, seconds)


def schedule_layers(layers: Sequence[tuple[Sequence[Op], Sequence[tuple[int, int]]]],
                    acc: Accelerator, seconds: float = 10.0) -> tuple[Schedule, ...]:
  """A schedule per layer (ops, edges), solving each distinct layer once: layers
  whose ops match but for their names, with the same edges, share a schedule.
  `seconds` bounds each distinct solve."""
  solved: dict[tuple, Schedule] = {}
  out = []
  for ops, edges in layers:
    key = (tuple(dataclasses.astuple(op)[1:] for op in ops),
           tuple(sorted({(int(i), int(j)) for i, j in edges})))
    if key not in solved:
      solved[key] = schedule(ops, edges, acc, seconds)
    out.append(solved[key])
  return tuple(out)


# One op's decision: (start, end) in ticks and its core, -1 when spread. In the
# functions below one[i] and every[i] are op i's latency in ticks on one core
# and spread over every core.
_Decision = tuple[int, int, int]


def _solve(one: list[int], every: list[int], preds: list[list[int]], cores: int,
           hint: list[_Decision], horizon: int,
           deadline: float) -> tuple[list[_Decision], str] | None:
  """The CP-SAT model of the module docstring; None when no solution by
  `deadline` (time.perf_counter)."""
  if time.perf_counter() >= deadline:
    return None
  n = len(one)
  m = cp_model.CpModel()
  start = [m.new_int_var(0, horizon, f"start{i}") for i in range(n)]
  end = [m.new_int_var(0, horizon, f"end{i}") for i in range(n)]
  spread = [m.new_bool_var(f"spread{i}") for i in range(n)]
  on = [[m.new_bool_var(f"on{i}_{c}") for c in range(cores)] for i in range(n)]
  lanes: list[list] = [[] for _ in range(cores)]
  # Redundant with the lanes, but its energy reasoning bounds the makespan
  # far sooner: a spread op holds every core, a single one core.
  held, demands = [], []
  for i in range(n):
    m.add_exactly_one([spread[i], *on[i]])
    both = m.new_optional_interval_var(start[i], every[i], end[i], spread[i], f"all{i}")
    held.append(both)
    demands.append(cores)
    for c in range(cores):
      alone = m.new_optional_interval_var(start[i], one[i], end[i], on[i][c], f"one{i}_{c}")
      lanes[c] += [both, alone]
      held.append(alone)
      demands.append(1)
    for p in preds[i]:
      m.add(start[i] >= end[p])
  for lane in lanes:
    m.add_no_overlap(lane)
  m.add_cumulative(held, demands, cores)
  # The cores are identical: number them by first use in op order. used[i][c]
  # may be true only if some op <= i runs on core c; op i takes core c > 0
  # only once an earlier op has taken core c - 1.
  used = [[m.new_bool_var(f"used{i}_{c}") for c in range(cores)] for i in range(n)]
  for i in range(n):
    for c in range(cores):
      m.add(used[i][c] <= on[i][c] + (used[i - 1][c] if i else 0))
      if c:
        m.add(on[i][c] <= (used[i - 1][c - 1] if i else 0))
  makespan = m.new_int_var(0, horizon, "makespan")
  m.add_max_equality(makespan, end)
  # The core-time the ops take fits in the cores by the makespan: the linear
  # relaxation then sees the work bound the cumulative alone leaves to search.
  m.add(cores * makespan >= sum(one[i] + (cores * every[i] - one[i]) * spread[i]
                                for i in range(n)))
  m.minimize(makespan)
  relabel = _first_use(hint)
  seen: set[int] = set()
  for i, (s, e, c) in enumerate(hint):
    c = relabel.get(c, -1)
    m.add_hint(start[i], s)
    m.add_hint(end[i], e)
    m.add_hint(spread[i], int(c < 0))
    seen.add(c)
    for k in range(cores):
      m.add_hint(on[i][k], int(c == k))
      m.add_hint(used[i][k], int(k in seen))
  # Building a large model may spend the budget: then the greedy stands.
  left = deadline - time.perf_counter()
  if left <= 0:
    return None
  solver = cp_model.CpSolver()
  solver.parameters.max_time_in_seconds = left
  solver.parameters.random_seed = 0
  # One worker: CP-SAT 9.15's parallel portfolio can abort the process
  # mid-solve (google/or-tools#5025), and these models are small enough
  # that one worker solves them within the budget.
  solver.parameters.num_workers = 1
  code = solver.solve(m)
  if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
    return None
  decisions = [(solver.value(start[i]), solver.value(end[i]),
                -1 if solver.boolean_value(spread[i])
                else next(c for c in range(cores) if solver.boolean_value(on[i][c])))
               for i in range(n)]
  return decisions, "optimal" if code == cp_model.OPTIMAL else "feasible"


def _greedy(one: list[int], every: list[int], preds: list[list[int]], order: list[int],
            cores: int, rule: str) -> list[_Decision]:
  """A list schedule: the ready op with the longest path still after it goes
  spread or on the core free first, as `rule` says: "finish" where it ends
  first (one core on ties, as that leaves the others free), "work" spread when
  that costs at most _SPREAD_WORK times its core-time on one core, "spread" or
  "single" always."""
  n = len(one)
  succs: list[list[int]] = [[] for _ in range(n)]
  for i in range(n):
    for p in preds[i]:
      succs[p].append(i)
  tail = [0] * n
  for i in reversed(order):
    tail[i] = min(one[i], every[i]) + max((tail[j] for j in succs[i]), default=0)
  waiting = [len(preds[i]) for i in range(n)]
  ready = [(-tail[i], i) for i in range(n) if not waiting[i]]
  heapq.heapify(ready)
  free = [0] * cores
  end = [0] * n
  out: list[_Decision] = [(0, 0, -1)] * n
  while ready:
    _, i = heapq.heappop(ready)
    after = max((end[p] for p in preds[i]), default=0)
    c = min(range(cores), key=lambda c: max(after, free[c]))
    s = max(after, free[c])
    s_all = max(after, *free)
    if (rule == "spread" or rule == "finish" and s_all + every[i] < s + one[i]
        or rule == "work" and every[i] * cores <= _SPREAD_WORK * one[i]):
      s, c = s_all, -1
      free = [s + every[i]] * cores
    else:
      free[c] = s + one[i]
    end[i] = s + (every[i] if c < 0 else one[i])
    out[i] = (s, end[i], c)
    for j in succs[i]:
      waiting[j] -= 1
      if not waiting[j]:
        heapq.heappush(ready, (-tail[j], j))
  return out


def _replay(decisions: list[_Decision], single: list[float], spread: list[float],
            preds: list[list[int]], order: list[int], cores: int) -> Schedule:
  """The decisions (placements, and the order their tick starts imply on each
  core) timed in seconds, every op as early as they allow."""
  n = len(single)
  rank = {i: r for r, i in enumerate(order)}
  # In this order every edge and every core's intervals go forward: an op
  # starting when another does is the zero-length one, or both are and the
  # topological rank decides.
  sequence = sorted(range(n), key=lambda i: (decisions[i][0], decisions[i][1], rank[i]))
  free = [0.0] * cores
  start = [0.0] * n
  end = [0.0] * n
  for i in sequence:
    c = decisions[i][2]
    used = range(cores) if c < 0 else (c,)
    start[i] = max([end[p] for p in preds[i]] + [free[k] for k in used], default=0.0)
    end[i] = start[i] + (spread[i] if c < 0 else single[i])
    for k in used:
      free[k] = end[i]
  relabel = _first_use(decisions)
  core = tuple(relabel.get(c, -1) for _, _, c in decisions)
  return Schedule(max(end), tuple(start), tuple(c < 0 for c in core), core, "feasible")


def _first_use(decisions: list[_Decision]) -> dict[int, int]:
  """Core numbers renumbered by first use in op order."""
  out: dict[int, int] = {}
  for *_, c in decisions:
    if c >= 0 and c not in out:
      out[c] = len(out)
  return out


def _lower_bound(one: list[int], every: list[int], preds: list[list[int]], order: list[int],
                 cores: int) -> int:
  """No schedule is shorter: the critical path at each op's best latency, and
  the work (core-ticks) over every core."""
  finish = [0] * len(one)
  for i in order:
    finish[i] = min(one[i], every[i]) + max((finish[p] for p in preds[i]), default=0)
  work = sum(min(a, b * cores) for a, b in zip(one, every))
  return max(max(finish), -(-work // cores))


def _predecessors_and_order(edges: Sequence[tuple[int, int]],
                            n: int) -> tuple[list[list[int]], list[int]]:
  """Per op its predecessors, and a topological order (Kahn, stable in op order)."""
  preds: list[set[int]] = [set() for _ in range(n)]
  for edge in edges:
    if (len(edge) != 2 or not all(is_int(x) and 0 <= x < n for x in edge)
        or edge[0] == edge[1]):
      raise AcceleratorError(
          f"edge {tuple(edge)!r} must be (i, j) with i != j, both op indices in [0, {n}).")
    preds[int(edge[1])].add(int(edge[0]))
  order: list[int] = []
  waiting = [len(p) for p in preds]
  succs: list[list[int]] = [[] for _ in range(n)]
  for j, ps in enumerate(preds):
    for i in ps:
      succs[i].append(j)
  ready = [i for i in range(n) if not waiting[i]]
  heapq.heapify(ready)
  while ready:
    i = heapq.heappop(ready)
    order.append(i)
    for j in succs[i]:
      waiting[j] -= 1
      if not waiting[j]:
        heapq.heappush(ready, j)
  if len(order) < n:
    cycle = sorted(set(range(n)) - set(order))
    raise AcceleratorError(
        f"edges form a cycle among ops {cycle}; scheduling needs a DAG. Drop the edge that "
        f"closes it.")
  return [sorted(p) for p in preds], order


def _latencies(values: Sequence[float], name: str) -> list[float]:
  out = [float(x) if is_real(x) else math.nan for x in values]
  bad = [(i, values[i]) for i, x in enumerate(out) if not math.isfinite(x) or x < 0]
  if bad:
    raise AcceleratorError(
        f"{name} latencies must be finite seconds >= 0; bad (index, value): {bad[:5]}.")
  return out


def _ticks(seconds: float, tick: float) -> int:
  # A positive latency stays positive, so an op never vanishes from the model.
  return max(1, round(seconds / tick)) if seconds > 0 else 0


__all__ = ["Schedule", "schedule", "schedule_latencies", "schedule_layers"]
