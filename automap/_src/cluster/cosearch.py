"""search_accelerator: the accelerator architecture and the placement, together.

For each workload (a loss function, its arguments and a global batch) the
gradient program is profiled once per tensor-parallel width and microbatch
size (`layers.measure`): per layer, the ops of its forward and backward
passes with their per-device shapes under that width's sharding, plus the
tensor-parallel collectives, parameters, activations and edges the cost model
reads. An architecture then prices each layer pass by scheduling its ops on
its cores (`accelerator.schedule`, one CP-SAT solve per distinct pass), and
the placement DP finds the best cluster plan on it. Passes are scheduled
lazily: the DP first places every pass at its lower bound, then the passes
of the (microbatch size, width) pairs its plan uses are scheduled and it
places again, until the plan it picks is priced by schedules alone; no plan
then beats it, and most passes never reach the solver.

The architecture space is a grid of powers of two within the area budget.
Every point is first priced optimistically (each layer pass at the larger of
its critical path and its work spread over all cores, both at each op's best
latency). Bounds come in two strengths: a ratio (no pass on the point can
beat its baseline schedule by more than 1/rho, so neither can the training
step), and a placement with every pass at its bound for the points whose
ratio stays promising. A point whose every pass bound is at least another
placed point's, in no more memory, takes that point's placed bound without
placing (a placement only slows as its layers do), and points that read the
same op latencies (vector units and width with one product) are priced once.
Best-first on these bounds, points are list-scheduled (greedy, a floor on
what CP-SAT finds) and placed until no bound beats the best by more than
`gap`: within the area visited that best is that close to the best any list
schedule reaches, without pricing most points. The few best are then
scheduled by CP-SAT, which only shortens their schedules. Area is visited in
buckets from the budget down, and a bucket that improves nothing ends the
search (PHAZE's stopping rule: more area stopped helping, so less will not).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import os
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

from automap._src.cluster import accelerator as acc_lib
from automap._src.cluster import layers as layers_lib
from automap._src.cluster.model import (
  JsonFile,
  Layer,
  LayerCost,
  LayerGraph,
  Placement,
  PlacementError,
)
from automap._src.cluster.options import CoSearchOptions, PlacementOptions, with_keywords
from automap._src.cluster.placement import place_any
from automap._src.cost.hardware import Hardware, get_hardware
from automap._src.plan import report
from automap._src.search.request import Budget

# The grid: each field's candidate values.
SPACE: dict[str, tuple] = {
    "tensor_units": (1, 2, 4, 8, 16, 32),
    "array": (32, 64, 128, 256),
    "vector_units": (1, 2, 4, 8, 16),
    "vector_width": (64, 128, 256),
    "buffer": tuple(m * 2**20 for m in (16, 32, 64, 128, 256)),
}


@dataclasses.dataclass(frozen=True)
class Workload:
  """A model to train: `loss_fn(params, *batch) -> scalar`, `global_batch`
  samples per step (batch leaves may be `jax.ShapeDtypeStruct`s).

  repeat: layer name -> copies, to let a few profiled blocks stand for a deep
    model (see `LayerGraph.repeat`), e.g. {"block_1": 47} for 48 blocks.
  """

  loss_fn: Callable
  params: object
  batch: tuple
  global_batch: int
  name: str = "model"
  repeat: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class _Pass:
  ops: tuple[acc_lib.Op, ...]
  edges: tuple[tuple[int, int], ...]

  def __post_init__(self):
    # Passes key every memo: hash their hundreds of ops once, not per lookup.
    object.__setattr__(self, "_hash", hash((self.ops, self.edges)))

  def __hash__(self) -> int:
    return self._hash


@dataclasses.dataclass(frozen=True)
class _Profiled:
  """A workload's layers per (microbatch size, width): ops per pass, and the
  cost model's layer graph for everything the accelerator does not change."""

  workload: Workload
  graphs: dict[int, dict[int, LayerGraph]]
  # (size, width) -> per layer (forward pass, backward share), backward
  # passes per label with the layers they split over and their shares.
  forward: dict[tuple[int, int], list[_Pass]]
  backward: dict[tuple[int, int], list[tuple[_Pass, list[int]]]]
  comm: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]

  def passes(self, size: int, width: int) -> list[_Pass]:
    """The passes whose times make the layer costs at (size, width)."""
    return self.forward[(size, width)] + [p for p, _ in self.backward[(size, width)]]


def _tiles(state: np.ndarray, sizes: Sequence[int], v: int, dim: int) -> int:
  return int(np.prod([sizes[a] for a in np.flatnonzero(state[v] == dim)] or [1]))


def _op(program, state, o: int) -> acc_lib.Op | None:
  """The accelerator's view of op o under `state` (per device), or None when
  the cost model charges it nothing (fused, free, or a relabel)."""
  g, model = program.graph, program.model
  if model.op_cost(state, o).time <= 0:
    return None
  sizes = program.mesh.axis_sizes
  values = [v for v in g.operands[o] if v >= 0] + list(g.results[o])
  nbytes = sum(model.local_bytes(state, v) for v in values) * g.trips[o]
  prim, rule = g.prims[o], g.rules[o]
  if prim == "dot_general" and not rule.replicated and len(rule.operands) >= 2:
    local: dict[int, int] = {}
    for position in (0, 1):
      v, factors = g.operands[o][position], rule.operands[position]
      for dim, f in enumerate(factors or ()):
        if f >= 0:
          local[f] = max(1, rule.sizes[f] // (_tiles(state, sizes, v, dim) if v >= 0 else 1))
    lhs = {f for f in rule.operands[0] or () if f >= 0}
    rhs = {f for f in rule.operands[1] or () if f >= 0}
    prod = lambda fs: int(np.prod([local[f] for f in fs] or [1]))  # noqa: E731
    return acc_lib.Op(
        prim, "tensor", m=prod(lhs - rhs), n=prod(rhs - lhs),
        k=prod({f for f in lhs & rhs if rule.reduction[f]}),
        batch=prod({f for f in lhs & rhs if not rule.reduction[f]}) * int(g.trips[o]),
        bytes=nbytes)
  if prim.startswith("conv"):
    # A convolution as a square matmul of its FLOPs.
    side = max(1, round((model.op_cost(state, o).flops / 2) ** (1 / 3)))
    return acc_lib.Op(prim, "tensor", m=side, n=side, k=side,
                      batch=int(g.trips[o]), bytes=nbytes)
  elements = max(model.local_bytes(state, v) / g.dtypes[v].itemsize
                 if hasattr(g.dtypes[v], "itemsize") else 0.0 for v in values)
  return acc_lib.Op(prim, "vector", elements=elements * g.trips[o], bytes=nbytes)


def _passes(program, state, group: list[int]) -> _Pass:
  """The ops of `group` (op indices in program order) the accelerator runs,
  with precedence from their data flow (through ops it skips)."""
  g = program.graph
  members = set(group)
  kept: dict[int, int] = {}
  ops = []
  for o in group:
    op = _op(program, state, o)
    if op is not None:
      kept[o] = len(ops)
      ops.append(op)
  # Nearest kept ancestors of each op's operands, within the group.
  near: dict[int, frozenset] = {}
  edges = set()
  for o in group:
    deps: set[int] = set()
    for v in g.operands[o]:
      p = g.producer[v] if v >= 0 else -1
      if p in members:
        deps |= {kept[p]} if p in kept else near.get(p, frozenset())
    near[o] = frozenset(deps)
    if o in kept:
      edges |= {(d, kept[o]) for d in deps}
  return _Pass(tuple(ops), tuple(sorted(edges)))


def _profile(workload: Workload, hardware: Hardware, widths, sizes, search) -> _Profiled:
  profile = layers_lib.measure(workload.loss_fn, workload.params, workload.batch, widths=widths,
                               hardware=hardware, search=search, sizes=sizes)
  forward, backward, comm = {}, {}, {}
  for (size, t), (program, state) in profile.programs.items():
    cut = layers_lib.Cut.of(program.graph)
    fw_ops = [[] for _ in cut.names]
    bw_ops: dict[str, list[int]] = {}
    for o in range(program.graph.num_ops):
      if cut.forward[o]:
        fw_ops[cut.segment[o]].append(o)
      else:
        bw_ops.setdefault(cut.labels[o], []).append(o)
    forward[(size, t)] = [_passes(program, state, ops) for ops in fw_ops]
    backward[(size, t)] = [(_passes(program, state, ops), cut.runs.get(label, [len(cut.names) - 1]))
                           for label, ops in bw_ops.items()]
    comm[(size, t)] = cut.split(report.op_seconds(program.model, state)[1])
  return _Profiled(workload, profile.graphs, forward, backward, comm)


class _Pricer:
  """Layer graphs of profiled workloads on one accelerator.

  Mode "bound" prices each pass at its lower bound. Modes "greedy" (list
  schedules) and "exact" (CP-SAT) price a pass at its schedule once
  `schedule` has made it, and at its bound until then: a placement on those
  times is a lower bound, and `_place` schedules only the passes of the
  (size, width) pairs it picks.
  """

  def __init__(self, acc: acc_lib.Accelerator, seconds: float, mode: str, bounds: _Bounds):
    self.acc, self.seconds, self.mode = acc, seconds, mode
    self.index, self.low = bounds.index, bounds(acc)
    self.cache: dict[_Pass, float] = {}
    self.upper: dict[_Pass, float] = {}

  def makespan(self, p: _Pass) -> float:
    found = self.cache.get(p)
    return self.low[self.index[p]] if found is None else found

  def schedule(self, p: _Pass) -> bool:
    """Schedules the pass (in modes other than "bound"); whether it was not yet."""
    if self.mode == "bound" or p in self.cache:
      return False
    if not p.ops:
      self.cache[p] = 0.0
    else:  # a greedy list schedule starts the solver; without time, it stands
      seconds = self.seconds if self.mode == "exact" else 0.0
      self.cache[p] = acc_lib.schedule(p.ops, p.edges, self.acc, seconds=seconds).makespan
    return True

  def most(self, p: _Pass) -> float:
    """No schedule of the pass the pricer settles on is longer."""
    if p in self.cache:
      return self.cache[p]
    if p not in self.upper:
      self.upper[p] = acc_lib.schedule(p.ops, p.edges, self.acc, seconds=0.0).makespan
    return self.upper[p]

  def graph(self, profiled: _Profiled, size: int) -> LayerGraph:
    widths = sorted(t for s, t in profiled.forward if s == size)
    base = profiled.graphs[size][widths[0]]
    per_width: dict[int, list[LayerCost]] = {}
    for t in widths:
      forward = profiled.forward[(size, t)]
      fw = np.array([self.makespan(p) for p in forward])
      bw = np.zeros(len(fw))
      for p, layers in profiled.backward[(size, t)]:
        if len(layers) == 1:
          bw[layers] += self.makespan(p)
        else:  # shares of bounds need not bound the shares: take the least
          high = np.array([self.most(forward[i]) for i in layers])
          bw[layers] += _least_share(fw[layers], high) * self.makespan(p)
      comm_fw, comm_bw = profiled.comm[(size, t)]
      graph = profiled.graphs[size][t]
      per_width[t] = [
          LayerCost(fw[i] + comm_fw[i], bw[i] + comm_bw[i], c.params, c.activations,
                    comm_fw[i] + comm_bw[i])
          for i, c in enumerate(layer.widths[t] for layer in graph.layers)]
    layers = tuple(Layer(layer.name, {t: per_width[t][i] for t in widths})
                   for i, layer in enumerate(base.layers))
    graph = LayerGraph(layers, base.edges)
    for name, times in profiled.workload.repeat.items():
      graph = graph.repeat(name, times)
    return graph


def _least_share(low: np.ndarray, high: np.ndarray) -> np.ndarray:
  """Per layer, the least share of its label's backward (split as the
  layers' forward seconds are, `layers_lib.backward_share`) over forward
  seconds anywhere in [low, high]; the share itself where low == high."""
  if np.array_equal(low, high):
    return layers_lib.backward_share(low, list(range(len(low))))
  rest = high.sum() - high
  with np.errstate(invalid="ignore", divide="ignore"):
    share = np.where(low > 0, low / (low + rest), 0.0)
  return share if high.sum() > 0 else np.full(len(low), 1 / len(low))


def _all_passes(profiled: _Profiled) -> list[_Pass]:
  return list(dict.fromkeys([p for ps in profiled.forward.values() for p in ps]
                            + [p for ps in profiled.backward.values() for p, _ in ps]))


class _Bounds:
  """Lower bounds on the passes' schedules, all passes of an accelerator at
  once: no schedule of a pass is shorter than its critical path at each op's
  best latency, nor than its work spread over every core."""

  def __init__(self, passes: Sequence[_Pass]):
    self.passes = list(passes)
    self.index = {p: i for i, p in enumerate(self.passes)}
    ops: dict[acc_lib.Op, int] = {}  # passes repeat ops: price each once
    kind, owner, edges, starts = [], [], [], []
    for i, p in enumerate(self.passes):
      starts.append(len(kind))
      edges += [(starts[-1] + a, starts[-1] + b) for a, b in p.edges]
      kind += [ops.setdefault(op, len(ops)) for op in p.ops]
      owner += [i] * len(p.ops)
    self.table = acc_lib.OpTable(list(ops))
    self.kind, self.owner = np.array(kind, np.int64), np.array(owner, np.int64)
    self.starts = np.array(starts, np.int64)
    self.empty = np.array([not p.ops for p in self.passes])
    # Critical paths level by level: an op's level is one past its
    # predecessors', so each level's edges start at finished ops.
    level = np.zeros(len(kind), np.int64)
    for a, b in edges:  # edges go forward in program order, sorted by source within a pass
      level[b] = max(level[b], level[a] + 1)
    edges = sorted(edges, key=lambda e: level[e[1]])
    cuts = np.cumsum(np.bincount([level[b] for _, b in edges], minlength=1))
    src = np.array([a for a, _ in edges], np.int64)
    dst = np.array([b for _, b in edges], np.int64)
    self.levels = [(src[lo:hi], dst[lo:hi]) for lo, hi in zip(np.r_[0, cuts[:-1]], cuts)
                   if hi > lo]
    self.memo: dict[acc_lib.Accelerator, tuple[np.ndarray, tuple]] = {}

  def __call__(self, acc: acc_lib.Accelerator) -> np.ndarray:
    """Per pass (in `passes` order), seconds."""
    return self._priced(acc)[0]

  def twins(self, acc: acc_lib.Accelerator) -> tuple:
    """What pricing `acc` reads of it: every op's latencies on one core and
    on all, the cores and the memory. Points that agree on these (vector
    units and width with one product, a buffer larger than any op needs)
    price alike."""
    return self._priced(acc)[1]

  def _priced(self, acc: acc_lib.Accelerator) -> tuple[np.ndarray, tuple]:
    if acc not in self.memo:
      cores = acc.tensor_units
      one, every = self.table.latency(acc, 1), self.table.latency(acc, cores)
      single, spread = one[self.kind], every[self.kind]
      best = np.minimum(single, spread)
      finish = best.copy()
      for src, dst in self.levels:
        np.maximum.at(finish, dst, finish[src] + best[dst])
      work = np.bincount(self.owner, np.minimum(single, spread * cores),
                         len(self.passes)) / cores
      path = np.zeros(len(self.passes))
      if len(finish):
        path[~self.empty] = np.maximum.reduceat(finish, self.starts[~self.empty])
      self.memo[acc] = (np.maximum(path, work), (cores, acc.hbm_capacity, acc.hbm_bandwidth,
                                                 acc.peak_flops, one.tobytes(), every.tobytes()))
    return self.memo[acc]


def _ratio_bound(acc: acc_lib.Accelerator, passes: list[np.ndarray], bounds: _Bounds,
                 base: acc_lib.Accelerator, high: np.ndarray) -> float:
  """An upper bound on the score without placing: if every pass takes at
  least rho times its baseline schedule (rho <= 1), every placement takes at
  least rho times as long as on the baseline (its other terms do not
  change), so a workload runs at most 1/rho times faster.

  passes: per workload, the indices of its passes in `bounds`. high: per pass,
  the baseline's schedule or a longer one (its list schedule where CP-SAT
  was not run)."""
  if acc.hbm_capacity > base.hbm_capacity:
    return math.inf  # more memory can enable placements the baseline has not
  low = bounds(acc)
  logs = []
  for ps in passes:
    ps = ps[high[ps] > 0]
    rho = np.min(low[ps] / high[ps]) if len(ps) else 1.0
    logs.append(-math.log(min(rho, 1.0)) if rho > 0 else math.inf)
  return math.exp(np.mean(logs))


@dataclasses.dataclass(frozen=True)
class Result:
  """One workload on one architecture."""

  workload: str
  placement: Placement
  microbatch: int
  throughput: float  # samples/s


@dataclasses.dataclass(frozen=True)
class AcceleratorPlan(JsonFile):
  """The best architecture found, its plans, and the baseline's.

  score: geometric mean over workloads of throughput / the baseline's.
  history: (architecture, score, how) of every pricing: "ratio" (its passes'
    bounds against the baseline's schedules), "bound" (placed with every pass
    at its bound; for one workload, where that placement cannot beat the
    best found by the gap, the score it failed to beat), "dominated" (not
    placed: the "bound" of a point whose every pass bound is no longer, in
    as much memory or more), "greedy" (placed with list schedules), "exact"
    (placed with CP-SAT schedules).
  """

  accelerator: acc_lib.Accelerator
  results: tuple[Result, ...]
  baseline: acc_lib.Accelerator
  baseline_results: tuple[Result, ...]
  score: float
  area_budget: float
  history: tuple[tuple[acc_lib.Accelerator, float, str], ...]
  seconds: float = dataclasses.field(default=0.0, compare=False)

  def to_json(self) -> dict:
    result = lambda r: {"workload": r.workload, "placement": r.placement.to_json(),  # noqa: E731
                        "microbatch": r.microbatch, "throughput": r.throughput}
    return {"accelerator": dataclasses.asdict(self.accelerator),
            "baseline": dataclasses.asdict(self.baseline),
            "results": [result(r) for r in self.results],
            "baseline_results": [result(r) for r in self.baseline_results],
            "score": self.score, "area_budget": self.area_budget,
            "history": [[dataclasses.asdict(a), s, e] for a, s, e in self.history]}

  @classmethod
  def from_json(cls, d: dict) -> AcceleratorPlan:
    result = lambda r: Result(r["workload"], Placement.from_json(r["placement"]),  # noqa: E731
                              int(r["microbatch"]), float(r["throughput"]))
    return cls(acc_lib.Accelerator(**d["accelerator"]), tuple(map(result, d["results"])),
               acc_lib.Accelerator(**d["baseline"]), tuple(map(result, d["baseline_results"])),
               float(d["score"]), float(d["area_budget"]),
               tuple((acc_lib.Accelerator(**a), float(s), str(e)) for a, s, e in d["history"]))

  def explain(self) -> str:
    a = self.accelerator
    lines = [
        f"automap accelerator: {a.tensor_units} tensor units of {a.array}x{a.array}, "
        f"{a.vector_units} vector units of {a.vector_width}, {a.buffer / 2**20:.0f} MiB on chip, "
        f"{a.area():.0f} of {self.area_budget:.0f} mm^2",
        f"  throughput {self.score:.3f}x the baseline (geometric mean over workloads)"]
    for r, b in zip(self.results, self.baseline_results):
      p = r.placement
      lines.append(
          f"  {r.workload}: {r.throughput:,.1f} samples/s (baseline {b.throughput:,.1f}); "
          f"{p.data_parallel} data-parallel x {len(p.stages)} stage(s), TP "
          f"{sorted({s.width for s in p.stages})}, microbatch {r.microbatch}")
    return "\n".join(lines)

  def plot(self, path: str | os.PathLike) -> None:
    """Throughput against area of every architecture priced (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for how, marker in (("ratio", "."), ("dominated", "1"), ("bound", "x"), ("greedy", "+"),
                        ("exact", "o")):
      pts = [(a.area(), s) for a, s, e in self.history if e == how]
      if pts:
        ax.scatter(*zip(*pts), marker=marker, label=how, alpha=0.6)
    ax.axvline(self.area_budget, color="grey", ls="--", lw=1)
    ax.scatter([self.accelerator.area()], [self.score], marker="*", s=200, color="red",
               label="best")
    ax.set_xlabel("area (mm$^2$)")
    ax.set_ylabel("throughput / baseline")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _candidates(budget: float, base: acc_lib.Accelerator,
                space: dict[str, tuple]) -> list[acc_lib.Accelerator]:
  """Grid points within the area budget, largest area first. Not only the
  maximal ones: more tensor units shrink each core's share of bandwidth and
  buffer, and larger arrays waste cycles on small matmuls, so a smaller point
  can win."""
  names = list(space)
  points = [dataclasses.replace(base, **dict(zip(names, values)))
            for values in itertools.product(*(space[n] for n in names))]
  return sorted((p for p in points if p.area() <= budget), key=lambda p: -p.area())


def _place(pricer: _Pricer, profiled: _Profiled, acc: acc_lib.Accelerator, hw: Hardware,
           devices: int, sizes: Sequence[int], options: PlacementOptions,
           bound: float = math.inf) -> Result | None:
  """The best placement on `acc`; None when none fits (or beats `bound`
  seconds per batch)."""
  wl = profiled.workload
  hardware = dataclasses.replace(hw, name=f"{hw.name}-links", hbm_capacity=acc.hbm_capacity,
                                 flops=acc.peak_flops, fp32_flops=acc.peak_flops / 4,
                                 hbm_bandwidth=acc.hbm_bandwidth)
  while True:
    try:
      placement, i = place_any(
          [(pricer.graph(profiled, b), wl.global_batch // b) for b in sizes],
          devices=devices, hardware=hardware, options=options, bound=bound)
    except PlacementError:
      return None
    # With passes at their bounds the plan is a lower bound on every plan:
    # once those of the pairs it uses are scheduled, it is also the best.
    result = Result(wl.name, placement, sizes[i], wl.global_batch / placement.time)
    if not sum(pricer.schedule(p) for pair in _pairs(result) for p in profiled.passes(*pair)):
      return result


def _pairs(result: Result) -> list[tuple[int, int]]:
  """The (microbatch size, width) pairs whose passes price the result's plan."""
  return sorted({(result.microbatch, s.width) for s in result.placement.stages})


def search_accelerator(workloads: Workload | Sequence[Workload], *, devices: int,
                       hardware: str | Hardware = "tpu-v4", area_budget: float | None = None,
                       options: CoSearchOptions | None = None, **keywords) -> AcceleratorPlan:
  """The architecture (within `area_budget` mm^2, default the baseline's
  area) and the placements that together train `workloads` fastest on
  `devices` accelerators linked like `hardware` (its links; compute and
  memory come from the architecture). Several workloads share one
  architecture: the score is the geometric mean of their throughputs
  relative to the baseline's.

  options: an automap.CoSearchOptions: baseline, space, widths,
    microbatches, optimizer, zero, schedule_seconds, bucket, gap, finalists,
    budget, progress, seed (see its docstring). Each field may be given as a
    keyword instead (`search_accelerator(..., gap=0.0)`), but not both ways.
  """
  options = with_keywords(CoSearchOptions, options, keywords, "search_accelerator")
  microbatches = options.microbatches
  t0 = time.perf_counter()
  workloads = [workloads] if isinstance(workloads, Workload) else list(workloads)
  if not workloads or not all(isinstance(w, Workload) for w in workloads):
    raise PlacementError("workloads must be an automap.Workload or a non-empty list of them.")
  hw = get_hardware(hardware)
  base = options.baseline or acc_lib.TPU_V4_LIKE
  budget_area = base.area() if area_budget is None else float(area_budget)
  if not budget_area > 0:
    raise PlacementError(f"area_budget must be a positive area in mm^2, got {area_budget!r}.")
  for w in workloads:
    if any(w.global_batch % b for b in microbatches):
      raise PlacementError(
          f"microbatches {tuple(microbatches)} must divide workload {w.name!r}'s global_batch "
          f"{w.global_batch}.")
  search = layers_lib.sharding_search(
      options.budget or Budget(episodes=20, seconds=30, progress=False), options.seed)
  profiled = [_profile(w, hw, options.widths, microbatches, search) for w in workloads]
  placing = PlacementOptions(optimizer=options.optimizer, zero=options.zero)
  passes = [_all_passes(p) for p in profiled]
  lower = _Bounds(list(dict.fromkeys(p for ps in passes for p in ps)))

  def place(pricer, bounds=None) -> list[Result | None]:
    bounds = bounds or [math.inf] * len(profiled)  # seconds per batch, per workload
    return [_place(pricer, p, pricer.acc, hw, devices, microbatches, placing, bound)
            for p, bound in zip(profiled, bounds)]

  twins: dict[tuple, list[Result | None]] = {}
  last: dict[tuple, list[Result | None]] = {}  # the latest results of a class of points

  def price(acc, mode, bounds=None) -> list[Result | None]:
    """The point's results, found once per class of points that price alike."""
    kind = lower.twins(acc)
    key = (kind, mode, tuple(bounds or ()))
    if key not in twins:
      pricer = _Pricer(acc, options.schedule_seconds, mode, lower)
      # The plan found at the level before mostly stands: with its passes
      # scheduled up front, the first placement is mostly the final one.
      for p, result in zip(profiled, last.get(kind, ())):
        for pair in _pairs(result) if result is not None else ():
          for pass_ in p.passes(*pair):
            pricer.schedule(pass_)
      twins[key] = last[kind] = place(pricer, bounds)
    return twins[key]

  base_pricer = _Pricer(base, options.schedule_seconds, "exact", lower)
  base_results = place(base_pricer)
  if any(r is None for r in base_results):
    missing = [w.name for w, r in zip(workloads, base_results) if r is None]
    raise PlacementError(f"the baseline accelerator cannot train {missing} on {devices} "
                         "devices: it runs out of memory; add devices or shrink the models.")

  def score(results) -> float:
    if any(r is None for r in results):
      return 0.0
    return math.exp(np.mean([math.log(r.throughput / b.throughput)
                             for r, b in zip(results, base_results)]))

  points = _candidates(budget_area, base, options.space or SPACE)
  history: list[tuple[acc_lib.Accelerator, float, str]] = []
  owned = [np.array([lower.index[p] for p in ps], np.int64) for ps in passes]
  high = np.array([base_pricer.most(p) for p in lower.passes])
  # Area buckets from the largest down (a tenth of the budget each); within
  # and across them, best-first over upper bounds on each point's score,
  # refined lazily: "ratio", then "bound", then the exact score, until no
  # bound beats the best. A bucket that improves nothing ends the search:
  # smaller chips stopped helping.
  width = budget_area * options.bucket
  buckets: dict[int, list[int]] = {}
  for i, acc in enumerate(points):
    buckets.setdefault(int((budget_area - acc.area()) // width), []).append(i)
  def priced(acc, mode, cut: float = 0.0) -> float:
    """The point's score; with one workload and a `cut`, the placement only
    seeks plans scoring above it (pruning from the start) and the cut stands
    in, as an upper bound, for a score no higher."""
    if cut and len(profiled) == 1:
      (w,), (b,) = workloads, base_results
      results = price(acc, mode, [w.global_batch / (cut * b.throughput)])
      s = cut if results[0] is None else score(results)
    else:
      s = score(price(acc, mode))
    history.append((acc, s, mode))
    return s

  heap: list[tuple[float, int, str]] = []
  floor, listed = 1.0, []  # the best greedy score; (greedy score, point) listed
  # Points placed at bound: (their passes' bounds, memory, score). A point
  # whose every pass bound is no shorter than such a one's, in no more
  # memory, places no faster at bound (a placement's time only grows with
  # its layers' times): that score bounds its own without placing it. Not
  # where a label's backward splits over layers (its bound share is not
  # monotone in the bounds).
  placed: list[tuple[np.ndarray, float, float]] = []
  monotone = all(len(layers) == 1 for p in profiled for bw in p.backward.values()
                 for _, layers in bw)

  def dominated(acc) -> float:
    low = lower(acc)
    return min((s for other, memory, s in placed
                if memory >= acc.hbm_capacity and np.all(other <= low)), default=math.inf)
  show = options.progress if options.progress is not None else sys.stderr.isatty()
  bar = None
  if show:
    from rich import progress as progress_lib
    bar = progress_lib.Progress(transient=True)
    bar.start()
    task = bar.add_task("automap: searching architectures", total=len(points))
  try:
    for b in sorted(buckets):
      before = floor
      for i in buckets[b]:
        ub = _ratio_bound(points[i], owned, lower, base, high)
        history.append((points[i], ub, "ratio"))
        heapq.heappush(heap, (-ub, i, "ratio"))
        if bar is not None:
          bar.update(task, advance=1)
      while heap and -heap[0][0] > floor * (1 + options.gap):
        key, i, level = heapq.heappop(heap)
        mode = "bound" if level == "ratio" else "greedy"
        # A bound only matters if it beats the best found by the gap.
        cut = floor * (1 + options.gap)
        if mode == "bound" and monotone and (s := dominated(points[i])) <= cut:
          history.append((points[i], min(s, -key), "dominated"))
          continue
        s = priced(points[i], mode, cut if mode == "bound" else 0.0)
        if mode == "bound":
          placed.append((lower(points[i]), points[i].hbm_capacity, s))
          heapq.heappush(heap, (-s, i, "bound"))
        else:
          listed.append((s, i))
          floor = max(floor, s)
        if bar is not None:
          bar.update(task, description=f"automap: best {floor:.3f}x")
      if b > min(buckets) and floor <= before:
        break
  finally:
    if bar is not None:
      bar.stop()
  # The few best by list schedule, scheduled by CP-SAT (never worse); on
  # ties the smaller chip, then the earlier point of the grid.
  best = (1.0, base, base_results)
  for _, _, i in sorted((-s, points[i].area(), i) for s, i in listed)[:options.finalists]:
    results = price(points[i], "exact")
    history.append((points[i], score(results), "exact"))
    if history[-1][1] > best[0]:
      best = (history[-1][1], points[i], results)
  s, acc, results = best
  return AcceleratorPlan(acc, tuple(results), base, tuple(base_results), s, budget_area,
                         tuple(history), time.perf_counter() - t0)
