"""Accelerator design points: area, operator latency, and operator scheduling per layer.

The hardware half of PHAZE (Wang et al., ICML 2024): an accelerator is a few
counts and sizes (cores with one systolic array each, vector units, on-chip
buffer, HBM); an operator's latency follows from the rules below; and a layer's
operators are scheduled over the cores by an ILP that runs each one either on
a single core or spread over all of them. Units: seconds, bytes, Hz, mm^2.

Latency of an op on `cores` of the accelerator's `tensor_units` cores. The op
owns that share (`cores / tensor_units`) of the vector lanes, the buffer and
the HBM bandwidth, so single-core ops running side by side never oversubscribe
the chip.

  - Tensor op, `batch` x [M, K] @ [K, N]: the output is cut into array x array
    tiles, ceil(M / array) * ceil(N / array) * batch of them; a tile streams its
    K rows through the array, plus 2 * array cycles to fill and drain it; the
    cores share the tiles, ceil(tiles / cores) each.
  - Vector op: elements / lanes cycles (one 16-bit op per lane per cycle).
  - Memory: the op's HBM traffic over its share of the bandwidth. A vector op
    streams, so its traffic is its bytes. A tensor op moves its bytes once when
    one instance fits in its share of the buffer, or when its smaller input
    fits in half of it (held resident while the rest streams through the other
    half). Otherwise it is blocked output-stationary, with a t x t block each of
    A, B and C on chip (t = floor(sqrt(buffer / (3 * itemsize)))): A is read
    ceil(N / t) times, B ceil(M / t) times, C written once.
  - latency = max(compute, memory) + DISPATCH_CYCLES, plus SYNC_CYCLES when the
    op spans more than one core.

Hence at a given core count more vector units, bandwidth or buffer never slow
an op; more tensor units never slow an op spread over two or more of them (at
a fixed core count a core is a smaller share of the chip, by design); a larger
array never slows an op whose M and N are multiples of it and that gives each
core at least one of its tiles; and spreading never slows the compute part.

Scheduling (CP-SAT): per op, either one interval on every core's NoOverlap
(spread) or an optional interval on each core with exactly one present;
start_j >= end_i per edge (i, j); minimise the makespan. Times are integer
ticks of 1 / _RESOLUTION of the shortest positive latency, so rounding moves
no latency by more than 0.05% (unless latencies span a factor over ~10^9, when
the tick coarsens to keep the horizon under _MAX_TICKS); "optimal" is to the
tick. A greedy list schedule seeds the solver (hint
and horizon) and stands when the time limit leaves no better answer; the
reported times are the chosen decisions replayed in seconds, never the ticks.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import numbers
import time
from collections.abc import Sequence

import numpy as np
from ortools.sat.python import cp_model

# Issuing an op (descriptors, DMA setup), cycles.
DISPATCH_CYCLES = 300
# A barrier across the cores after a spread op, cycles.
SYNC_CYCLES = 500
# Ticks per shortest positive latency in the scheduling ILP.
_RESOLUTION = 1000
# Ticks in the longest schedule at most; wider ranges coarsen the tick.
_MAX_TICKS = 2**40
# The greedy schedules tried, best kept (see _greedy).
_RULES = ("finish", "work", "spread", "single")
_SPREAD_WORK = 1.25


class AcceleratorError(ValueError):
  """An invalid accelerator, operator or scheduling problem."""


def _is_int(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Accelerator:
  """A parameterised accelerator chip.

  Vector units are spread evenly over the cores (a core may hold a fraction);
  the buffer is on-chip SRAM shared by the cores.
  """

  tensor_units: int = 8             # cores, each with one systolic array
  array: int = 128                  # the systolic array is array x array MACs
  vector_units: int = 2             # over all cores
  vector_width: int = 128           # lanes per vector unit, one 16-bit op per lane per cycle
  buffer: float = 128 * 2**20       # on-chip SRAM, bytes
  hbm_capacity: float = 32 * 2**30  # bytes
  hbm_bandwidth: float = 1.2e12     # bytes/s
  clock: float = 1.05e9             # Hz

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.type == "int":
        if not _is_int(value) or value < 1:
          raise AcceleratorError(
              f"Accelerator.{field.name} must be a positive int, got {value!r}.")
      elif not _is_real(value) or not math.isfinite(value) or value <= 0:
        raise AcceleratorError(
            f"Accelerator.{field.name} must be a positive finite number (units: bytes, "
            f"bytes/s, Hz), got {value!r}.")
    if self.array & (self.array - 1):
      raise AcceleratorError(
          f"Accelerator.array must be a power of two (the systolic array is array x array "
          f"MACs), got {self.array}; try {1 << (self.array.bit_length() - 1)} or "
          f"{1 << self.array.bit_length()}.")

  def area(self, model: AreaModel | None = None) -> float:
    """Die area, mm^2, under `model` (default: AREA, calibrated on TPU_V4_LIKE)."""
    return (model or AREA).area(self)

  @property
  def peak_flops(self) -> float:
    """Dense matmul FLOP/s over every core (a MAC is two FLOPs)."""
    return 2 * self.tensor_units * self.array**2 * self.clock

  @property
  def lanes(self) -> int:
    """Vector lanes over every core."""
    return self.vector_units * self.vector_width


@dataclasses.dataclass(frozen=True)
class AreaModel:
  """Die area as a linear function of the resources, mm^2.

  AREA calibrates it so that TPU_V4_LIKE has BASELINE_AREA with the shares in
  BASELINE_SHARES: tensor units 40%, vector units 5%, SRAM 30%, HBM interface
  (PHYs and controllers) 10%, the rest (interconnect, host interface, control)
  15%. These shares and the total are assumptions, in line with published die
  shots of TPU-class chips, not measurements; pass another model to
  `Accelerator.area` to try others.
  """

  mac: float    # mm^2 per MAC of a systolic array
  lane: float   # mm^2 per vector lane
  sram: float   # mm^2 per byte of buffer
  hbm: float    # mm^2 per byte/s of HBM bandwidth
  fixed: float  # mm^2 whatever the design point

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if not _is_real(value) or not math.isfinite(value) or value < 0:
        raise AcceleratorError(
            f"AreaModel.{field.name} must be a finite number >= 0 (mm^2 per unit), "
            f"got {value!r}.")

  @classmethod
  def calibrated(cls, acc: Accelerator, total: float, shares: dict[str, float]) -> AreaModel:
    """The model under which `acc` has area `total`, split as `shares` (by field name)."""
    if set(shares) != {f.name for f in dataclasses.fields(cls)} or not math.isclose(
        sum(shares.values()), 1.0):
      raise AcceleratorError(
          f"shares must give each of mac, lane, sram, hbm, fixed a fraction of the area, "
          f"summing to 1; got {shares}.")
    amounts = _amounts(acc)
    return cls(**{name: total * share / amounts[name] for name, share in shares.items()})

  def area(self, acc: Accelerator) -> float:
    amounts = _amounts(acc)
    return sum(getattr(self, name) * amount for name, amount in amounts.items())


def _amounts(acc: Accelerator) -> dict[str, float]:
  """How much of each resource `acc` has, in AreaModel's units."""
  return {"mac": acc.tensor_units * acc.array**2, "lane": acc.lanes,
          "sram": acc.buffer, "hbm": acc.hbm_bandwidth, "fixed": 1.0}


TPU_V4_LIKE = Accelerator()
BASELINE_AREA = 400.0  # mm^2
BASELINE_SHARES = {"mac": 0.40, "lane": 0.05, "sram": 0.30, "hbm": 0.10, "fixed": 0.15}
AREA = AreaModel.calibrated(TPU_V4_LIKE, BASELINE_AREA, BASELINE_SHARES)
AREA_BUDGET: float = TPU_V4_LIKE.area()


@dataclasses.dataclass(frozen=True)
class Op:
  """One operator of a layer, as the accelerator sees it.

  kind "tensor": `batch` matmuls [m, k] @ [k, n]. kind "vector": `elements`
  element operations (elementwise or reduction). `bytes` is the HBM traffic if
  nothing stays on chip: inputs read once plus outputs written once.
  """

  name: str
  kind: str
  m: int = 1
  n: int = 1
  k: int = 1
  batch: int = 1
  elements: float = 0  # element operations (vector ops)
  bytes: float = 0     # bytes

  def __post_init__(self):
    if self.kind not in ("tensor", "vector"):
      raise AcceleratorError(
          f"Op {self.name!r}: kind must be 'tensor' (a matmul) or 'vector', got {self.kind!r}.")
    for name in ("m", "n", "k", "batch"):
      value = getattr(self, name)
      if not _is_int(value) or value < 1:
        raise AcceleratorError(f"Op {self.name!r}: {name} must be a positive int, got {value!r}.")
    for name in ("elements", "bytes"):
      value = getattr(self, name)
      if not _is_real(value) or not math.isfinite(value) or value < 0:
        raise AcceleratorError(
            f"Op {self.name!r}: {name} must be a finite number >= 0, got {value!r}.")
    if self.kind == "tensor" and self.elements:
      raise AcceleratorError(
          f"Op {self.name!r}: a tensor op's work is its m, n, k and batch; leave elements 0 "
          f"(got {self.elements!r}) or make it a vector op.")
    if self.kind == "vector" and (self.m, self.n, self.k, self.batch) != (1, 1, 1, 1):
      raise AcceleratorError(
          f"Op {self.name!r}: a vector op's work is its elements; leave m, n, k, batch at 1 "
          f"(got {(self.m, self.n, self.k, self.batch)}) or make it a tensor op.")

  @classmethod
  def matmul(cls, name: str, *, m: int, n: int, k: int, batch: int = 1,
             itemsize: int = 2) -> Op:
    """A tensor op whose bytes are its operands and result at `itemsize` bytes each."""
    return cls(name, "tensor", m=m, n=n, k=k, batch=batch,
               bytes=float(itemsize * batch * (m * k + k * n + m * n)))

  @property
  def flops(self) -> float:
    return 2.0 * self.m * self.n * self.k * self.batch if self.kind == "tensor" else self.elements


@dataclasses.dataclass(frozen=True)
class Latency:
  """An op's latency and its parts, seconds."""

  compute: float
  memory: float
  overhead: float  # dispatch, plus synchronisation when spread

  @property
  def total(self) -> float:
    return max(self.compute, self.memory) + self.overhead


def hbm_traffic(op: Op, buffer: float) -> float:
  """Bytes `op` moves to and from HBM with `buffer` bytes on chip (module docstring)."""
  if op.kind == "vector" or op.bytes == 0:
    return float(op.bytes)
  a, b, c = op.m * op.k, op.k * op.n, op.m * op.n  # elements per instance
  itemsize = op.bytes / (op.batch * (a + b + c))
  if itemsize * (a + b + c) <= buffer or itemsize * min(a, b) <= buffer / 2:
    return float(op.bytes)
  t = max(1, math.isqrt(int(buffer / (3 * itemsize))))
  return itemsize * op.batch * (a * -(-op.n // t) + b * -(-op.m // t) + c)


def latency_breakdown(op: Op, acc: Accelerator, cores: int) -> Latency:
  """`op`'s latency on `cores` of `acc`'s cores, in parts (module docstring)."""
  if not isinstance(op, Op):
    raise AcceleratorError(f"op must be an automap Op, got {type(op).__name__}.")
  if not _is_int(cores) or not 1 <= cores <= acc.tensor_units:
    raise AcceleratorError(
        f"cores must be an int from 1 (one core) to acc.tensor_units = {acc.tensor_units} "
        f"(spread over all), got {cores!r}.")
  share = cores / acc.tensor_units
  if op.kind == "tensor":
    tiles = -(-op.m // acc.array) * -(-op.n // acc.array) * op.batch
    cycles = -(-tiles // cores) * (op.k + 2 * acc.array)
  else:
    cycles = op.elements / (acc.lanes * share)
  memory = hbm_traffic(op, acc.buffer * share) / (acc.hbm_bandwidth * share)
  overhead = DISPATCH_CYCLES + (SYNC_CYCLES if cores > 1 else 0)
  return Latency(cycles / acc.clock, memory, overhead / acc.clock)


def latency(op: Op, acc: Accelerator, cores: int) -> float:
  """Seconds `op` takes on `cores` cores (1: one core; acc.tensor_units: spread)."""
  return latency_breakdown(op, acc, cores).total


class OpTable:
  """Ops as arrays, priced on one accelerator after another: `latency` for
  all of them at once, by the same rules and in the same arithmetic."""

  def __init__(self, ops: Sequence[Op]):
    ops = list(ops)
    if not all(isinstance(op, Op) for op in ops):
      raise AcceleratorError("OpTable takes automap Ops.")
    col = lambda f, dtype: np.array([f(op) for op in ops], dtype)  # noqa: E731
    self.tensor = col(lambda op: op.kind == "tensor", bool)
    self.m, self.n, self.k, self.batch = (col(lambda op, f=f: getattr(op, f), np.int64)
                                          for f in ("m", "n", "k", "batch"))
    self.elements, self.bytes = col(lambda op: op.elements, float), col(lambda op: op.bytes, float)
    # hbm_traffic's per-instance elements and bytes per element (tensor ops with bytes).
    self.a, self.b, self.c = self.m * self.k, self.k * self.n, self.m * self.n
    self.blocked = self.tensor & (self.bytes > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
      self.itemsize = np.where(self.blocked,
                               self.bytes / (self.batch * (self.a + self.b + self.c)), 0.0)

  def __len__(self) -> int:
    return len(self.tensor)

  def hbm_traffic(self, buffer: float) -> np.ndarray:
    """`hbm_traffic` of every op."""
    a, b, c, itemsize = self.a, self.b, self.c, self.itemsize
    once = ~self.blocked | (itemsize * (a + b + c) <= buffer) | (
        itemsize * np.minimum(a, b) <= buffer / 2)
    out = self.bytes.copy()
    if once.all():
      return out
    i = ~once
    cells = np.floor(buffer / (3 * itemsize[i])).astype(np.int64)
    t = np.floor(np.sqrt(cells)).astype(np.int64)
    t -= t * t > cells  # math.isqrt: floor(sqrt) can round either way
    t += (t + 1) * (t + 1) <= cells
    t = np.maximum(t, 1)
    out[i] = itemsize[i] * self.batch[i] * (a[i] * -(-self.n[i] // t) + b[i] * -(-self.m[i] // t)
                                            + c[i])
    return out

  def latency(self, acc: Accelerator, cores: int) -> np.ndarray:
    """`latency(op, acc, cores)` of every op, seconds."""
    if not _is_int(cores) or not 1 <= cores <= acc.tensor_units:
      raise AcceleratorError(
          f"cores must be an int from 1 to acc.tensor_units = {acc.tensor_units}, "
          f"got {cores!r}.")
    share = cores / acc.tensor_units
    tiles = -(-self.m // acc.array) * -(-self.n // acc.array) * self.batch
    cycles = np.where(self.tensor, -(-tiles // cores) * (self.k + 2 * acc.array),
                      self.elements / (acc.lanes * share))
    memory = self.hbm_traffic(acc.buffer * share) / (acc.hbm_bandwidth * share)
    overhead = DISPATCH_CYCLES + (SYNC_CYCLES if cores > 1 else 0)
    return np.maximum(cycles / acc.clock, memory) + overhead / acc.clock


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
  if not _is_int(cores) or cores < 1:
    raise AcceleratorError(f"cores must be a positive int, got {cores!r}.")
  if not _is_real(seconds) or not seconds >= 0:
    raise AcceleratorError(f"seconds must be a time limit >= 0, got {seconds!r}.")
  n = len(single)
  preds, order = _graph(edges, n)
  if n == 0:
    return Schedule(0.0, (), (), (), "optimal")
  positive = [x for x in single + spread if x > 0]
  longest = sum(max(a, b) for a, b in zip(single, spread))
  tick = max(min(positive) / _RESOLUTION, longest / _MAX_TICKS) if positive else 1.0
  one = [_ticks(x, tick) for x in single]
  every = [_ticks(x, tick) for x in spread]
  hint = min((_greedy(one, every, preds, order, cores, rule) for rule in _RULES),
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


# One op's decision: (start, end) in ticks and its core, -1 when spread.
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


def _graph(edges: Sequence[tuple[int, int]], n: int) -> tuple[list[list[int]], list[int]]:
  """Per op its predecessors, and a topological order (Kahn, stable in op order)."""
  preds: list[set[int]] = [set() for _ in range(n)]
  for edge in edges:
    if (len(edge) != 2 or not all(_is_int(x) and 0 <= x < n for x in edge)
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
  out = [float(x) if _is_real(x) else math.nan for x in values]
  bad = [(i, values[i]) for i, x in enumerate(out) if not math.isfinite(x) or x < 0]
  if bad:
    raise AcceleratorError(
        f"{name} latencies must be finite seconds >= 0; bad (index, value): {bad[:5]}.")
  return out


def _ticks(seconds: float, tick: float) -> int:
  # A positive latency stays positive, so an op never vanishes from the model.
  return max(1, round(seconds / tick)) if seconds > 0 else 0


__all__ = ["AREA", "AREA_BUDGET", "Accelerator", "AcceleratorError", "AreaModel", "Latency", "Op",
           "OpTable", "Schedule", "TPU_V4_LIKE", "hbm_traffic", "latency", "latency_breakdown",
           "schedule", "schedule_latencies", "schedule_layers"]
