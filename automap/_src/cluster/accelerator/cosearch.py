"""search_accelerator: the accelerator architecture and the placement, together.

Each workload is profiled once into layer passes, the ops of each layer's
forward and backward pass per tensor-parallel width and microbatch size
(`passes.py`). An architecture then prices each layer pass by scheduling
its ops on its cores (`pass_times.PassTimes`, one CP-SAT solve per distinct
pass), and the placement DP finds the best cluster plan on it. Passes are
scheduled lazily: the DP first places every pass at its lower bound, then
the passes of the (microbatch size, width) pairs its plan uses are
scheduled and it places again, until the plan it picks is priced by
schedules alone; no plan then beats it, and most passes never reach the
solver.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import os
import sys
import time
import types
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from automap._src.cluster.accelerator import chip as acc_lib
from automap._src.cluster.accelerator.options import CoSearchOptions
from automap._src.cluster.accelerator.pass_times import PassBounds, PassTimes
from automap._src.cluster.accelerator.passes import (
  ProfiledWorkload,
  Workload,
  all_passes,
  profile_workload,
)
from automap._src.cluster.errors import PlacementError
from automap._src.cluster.json_file import JsonFile
from automap._src.cluster.placement.dp import place_any
from automap._src.cluster.placement.options import PlacementOptions
from automap._src.cluster.placement.placed import Placement
from automap._src.cost.hardware import Hardware, get_hardware
from automap._src.plan import planner
from automap._src.search.request import Budget, with_keywords

# The grid: each field's candidate values.
SPACE: Mapping[str, tuple] = types.MappingProxyType({
    "tensor_units": (1, 2, 4, 8, 16, 32),
    "array": (32, 64, 128, 256),
    "vector_units": (1, 2, 4, 8, 16),
    "vector_width": (64, 128, 256),
    "buffer": tuple(m * 2**20 for m in (16, 32, 64, 128, 256)),
})


def _ratio_bound(acc: acc_lib.Accelerator, passes: list[np.ndarray], bounds: PassBounds,
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

  Attributes:
    accelerator: the best architecture (the baseline where none beats it).
    results: per workload, its plan on `accelerator` (placement,
      microbatch size, samples/s).
    baseline: the architecture scores are relative to.
    baseline_results: per workload, its plan on the baseline.
    score: geometric mean over workloads of throughput / the baseline's.
    area_budget: the area searched within, mm^2.
    history: (architecture, score, how) of every pricing: "ratio" (its passes'
      bounds against the baseline's schedules), "bound" (placed with every pass
      at its bound; for one workload, where that placement cannot beat the
      best found by the gap, the score it failed to beat), "dominated" (not
      placed: the "bound" of a point whose every pass bound is no longer, in
      as much memory or more), "greedy" (placed with list schedules), "exact"
      (placed with CP-SAT schedules).
    seconds: how long the search took.
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


def _grid_points(budget: float, base: acc_lib.Accelerator,
                 space: Mapping[str, tuple]) -> list[acc_lib.Accelerator]:
  """Grid points within the area budget, largest area first. Not only the
  maximal ones: more tensor units shrink each core's share of bandwidth and
  buffer, and larger arrays waste cycles on small matmuls, so a smaller point
  can win."""
  names = list(space)
  points = [dataclasses.replace(base, **dict(zip(names, values)))
            for values in itertools.product(*(space[n] for n in names))]
  return sorted((p for p in points if p.area() <= budget), key=lambda p: -p.area())


def _place_on(times: PassTimes, profiled: ProfiledWorkload, acc: acc_lib.Accelerator,
              hw: Hardware, devices: int, sizes: Sequence[int], options: PlacementOptions,
              bound: float = math.inf) -> Result | None:
  """The best placement on `acc` with its layer passes at `times`; None when
  none fits (or beats `bound` seconds per batch)."""
  wl = profiled.workload
  hardware = dataclasses.replace(hw, name=f"{hw.name}-links", hbm_capacity=acc.hbm_capacity,
                                 flops=acc.peak_flops, fp32_flops=acc.peak_flops / 4,
                                 hbm_bandwidth=acc.hbm_bandwidth)
  while True:
    try:
      placement, i = place_any(
          [(times.layer_graph(profiled, b), wl.global_batch // b) for b in sizes],
          devices=devices, hardware=hardware, options=options, bound=bound)
    except PlacementError:
      return None
    # With passes at their bounds the plan is a lower bound on every plan:
    # once those of the pairs it uses are scheduled, it is also the best.
    result = Result(wl.name, placement, sizes[i], wl.global_batch / placement.time)
    pairs = _size_width_pairs(result)
    if not sum(times.schedule(p) for pair in pairs for p in profiled.passes(*pair)):
      return result


def _size_width_pairs(result: Result) -> list[tuple[int, int]]:
  """The (microbatch size, width) pairs whose passes price the result's plan."""
  return sorted({(result.microbatch, s.width) for s in result.placement.stages})


class _CoSearch:
  """One co-search: the workloads profiled once, the baseline placed, and
  each architecture's pricings kept (`history`)."""

  def __init__(self, workloads: list[Workload], hw: Hardware, devices: int,
               base: acc_lib.Accelerator, options: CoSearchOptions):
    self.workloads, self.hw, self.devices, self.options = workloads, hw, devices, options
    self.base = base
    search = planner.searcher(
        options.budget or Budget(episodes=20, seconds=30, progress=False), options.seed)
    self.profiled = [profile_workload(w, hw, options.widths, options.microbatches, search)
                     for w in workloads]
    self.placing = PlacementOptions(optimizer=options.optimizer, zero=options.zero)
    passes = [all_passes(p) for p in self.profiled]
    self.pass_bounds = PassBounds(list(dict.fromkeys(p for ps in passes for p in ps)))
    self.results_by_key: dict[tuple, list[Result | None]] = {}
    self.latest: dict[tuple, list[Result | None]] = {}  # the latest results of a class of points
    self.history: list[tuple[acc_lib.Accelerator, float, str]] = []
    self.base_times = PassTimes(base, options.schedule_seconds, "exact", self.pass_bounds)
    self.base_results = self.place(self.base_times)
    if any(r is None for r in self.base_results):
      missing = [w.name for w, r in zip(workloads, self.base_results) if r is None]
      raise PlacementError(f"the baseline accelerator cannot train {missing} on {devices} "
                           "devices: it runs out of memory; add devices or shrink the models.")
    self.workload_passes = [np.array([self.pass_bounds.index[p] for p in ps], np.int64)
                            for ps in passes]
    self.baseline_upper = np.array([self.base_times.upper_bound(p)
                                    for p in self.pass_bounds.passes])
    # Points placed at bound: (their passes' bounds, memory, score). A point
    # whose every pass bound is no shorter than such a one's, in no more
    # memory, places no faster at bound (a placement's time only grows with
    # its layers' times): that score bounds its own without placing it. Not
    # where a label's backward splits over layers (its bound share is not
    # monotone in the bounds).
    self.placed: list[tuple[np.ndarray, float, float]] = []
    self.monotone = all(len(layers) == 1 for p in self.profiled for bw in p.backward.values()
                        for _, layers in bw)

  def place(self, times: PassTimes, bounds: list[float] | None = None) -> list[Result | None]:
    """Each workload's best placement with its passes at `times`, under
    `bounds` (seconds per batch, per workload)."""
    bounds = bounds or [math.inf] * len(self.profiled)
    return [_place_on(times, p, times.acc, self.hw, self.devices, self.options.microbatches,
                      self.placing, bound) for p, bound in zip(self.profiled, bounds)]

  def price(self, acc: acc_lib.Accelerator, mode: str,
            bounds: list[float] | None = None) -> list[Result | None]:
    """The point's results, found once per class of points that price alike."""
    pricing = self.pass_bounds.pricing_key(acc)
    key = (pricing, mode, tuple(bounds or ()))
    if key not in self.results_by_key:
      times = PassTimes(acc, self.options.schedule_seconds, mode, self.pass_bounds)
      # The plan found at the level before mostly stands: with its passes
      # scheduled up front, the first placement is mostly the final one.
      for p, result in zip(self.profiled, self.latest.get(pricing, ())):
        for pair in _size_width_pairs(result) if result is not None else ():
          for pass_ in p.passes(*pair):
            times.schedule(pass_)
      self.results_by_key[key] = self.latest[pricing] = self.place(times, bounds)
    return self.results_by_key[key]

  def score(self, results: list[Result | None]) -> float:
    """Geometric mean over workloads of throughput / the baseline's (0: one does not fit)."""
    if any(r is None for r in results):
      return 0.0
    return math.exp(np.mean([math.log(r.throughput / b.throughput)
                             for r, b in zip(results, self.base_results)]))

  def priced(self, acc: acc_lib.Accelerator, mode: str, cut: float = 0.0) -> float:
    """The point's score; with one workload and a `cut`, the placement only
    seeks plans scoring above it (pruning from the start) and the cut stands
    in, as an upper bound, for a score no higher."""
    if cut and len(self.profiled) == 1:
      (w,), (b,) = self.workloads, self.base_results
      results = self.price(acc, mode, [w.global_batch / (cut * b.throughput)])
      s = cut if results[0] is None else self.score(results)
    else:
      s = self.score(self.price(acc, mode))
    self.history.append((acc, s, mode))
    return s

  def dominated(self, acc: acc_lib.Accelerator) -> float:
    """The least score of a point placed at bound whose pass bounds are all
    no longer than `acc`'s in no less memory (inf: none)."""
    low = self.pass_bounds(acc)
    return min((s for other, memory, s in self.placed
                if memory >= acc.hbm_capacity and np.all(other <= low)), default=math.inf)

  def explore(self, points: list[acc_lib.Accelerator],
              budget_area: float) -> list[tuple[float, int]]:
    """The points list-scheduled and placed, as (greedy score, point index).

    Area buckets from the largest down (a tenth of the budget each); within
    and across them, best-first over upper bounds on each point's score,
    refined lazily: "ratio", then "bound", then the greedy score, until no
    bound beats the best by more than the gap. A bucket that improves
    nothing ends the search: smaller chips stopped helping."""
    options = self.options
    width = budget_area * options.bucket
    buckets: dict[int, list[int]] = {}
    for i, acc in enumerate(points):
      buckets.setdefault(int((budget_area - acc.area()) // width), []).append(i)
    heap: list[tuple[float, int, str]] = []
    best_greedy, listed = 1.0, []  # the best greedy score; (greedy score, point) listed
    show = options.progress if options.progress is not None else sys.stderr.isatty()
    bar = None
    if show:
      from rich import progress as progress_lib
      bar = progress_lib.Progress(transient=True)
      bar.start()
      task = bar.add_task("automap: searching architectures", total=len(points))
    try:
      for b in sorted(buckets):
        before = best_greedy
        for i in buckets[b]:
          ub = _ratio_bound(points[i], self.workload_passes, self.pass_bounds,
                            self.base, self.baseline_upper)
          self.history.append((points[i], ub, "ratio"))
          heapq.heappush(heap, (-ub, i, "ratio"))
          if bar is not None:
            bar.update(task, advance=1)
        while heap and -heap[0][0] > best_greedy * (1 + options.gap):
          key, i, level = heapq.heappop(heap)
          mode = "bound" if level == "ratio" else "greedy"
          # A bound only matters if it beats the best found by the gap.
          cut = best_greedy * (1 + options.gap)
          if mode == "bound" and self.monotone and (s := self.dominated(points[i])) <= cut:
            self.history.append((points[i], min(s, -key), "dominated"))
            continue
          s = self.priced(points[i], mode, cut if mode == "bound" else 0.0)
          if mode == "bound":
            self.placed.append((self.pass_bounds(points[i]), points[i].hbm_capacity, s))
            heapq.heappush(heap, (-s, i, "bound"))
          else:
            listed.append((s, i))
            best_greedy = max(best_greedy, s)
          if bar is not None:
            bar.update(task, description=f"automap: best {best_greedy:.3f}x")
        if b > min(buckets) and best_greedy <= before:
          break
    finally:
      if bar is not None:
        bar.stop()
    return listed

  def finalists(self, points: list[acc_lib.Accelerator], listed: list[tuple[float, int]],
                ) -> tuple[float, acc_lib.Accelerator, list[Result | None]]:
    """(score, architecture, results) of the best: the few best by list
    schedule, scheduled by CP-SAT (never worse); on ties the smaller chip,
    then the earlier point of the grid; the baseline where none beats it."""
    best = (1.0, self.base, self.base_results)
    for _, _, i in sorted((-s, points[i].area(), i) for s, i in listed)[:self.options.finalists]:
      results = self.price(points[i], "exact")
      self.history.append((points[i], self.score(results), "exact"))
      if self.history[-1][1] > best[0]:
        best = (self.history[-1][1], points[i], results)
    return best


def _checked_inputs(workloads: Workload | Sequence[Workload], hardware: str | Hardware,
                    area_budget: float | None, options: CoSearchOptions,
                    ) -> tuple[list[Workload], Hardware, acc_lib.Accelerator, float]:
  """(workloads as a list, hardware, baseline, area budget in mm^2), each checked."""
  workloads = [workloads] if isinstance(workloads, Workload) else list(workloads)
  if not workloads or not all(isinstance(w, Workload) for w in workloads):
    raise PlacementError(
        "workloads must be an automap.cluster.Workload or a non-empty list of them.")
  hw = get_hardware(hardware)
  base = options.baseline or acc_lib.TPU_V4_LIKE
  budget_area = base.area() if area_budget is None else float(area_budget)
  if not budget_area > 0:
    raise PlacementError(f"area_budget must be a positive area in mm^2, got {area_budget!r}.")
  for w in workloads:
    if any(w.global_batch % b for b in options.microbatches):
      raise PlacementError(
          f"microbatches {tuple(options.microbatches)} must divide workload {w.name!r}'s "
          f"global_batch {w.global_batch}.")
  return workloads, hw, base, budget_area


def search_accelerator(workloads: Workload | Sequence[Workload], *, devices: int,
                       hardware: str | Hardware = "tpu-v4", area_budget: float | None = None,
                       options: CoSearchOptions | None = None,
                       **keywords: Any) -> AcceleratorPlan:
  """The architecture (within `area_budget` mm^2, default the baseline's
  area) and the placements that together train `workloads` fastest on
  `devices` accelerators linked like `hardware` (its links; compute and
  memory come from the architecture). Several workloads share one
  architecture: the score is the geometric mean of their throughputs
  relative to the baseline's.

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

  Args:
    workloads: one `Workload` or a non-empty list of them (a model's loss,
      its arguments and global batch).
    devices: accelerators in the cluster.
    hardware: a catalogue name or a `Hardware` whose links connect them.
    area_budget: the architecture's area in mm^2 at most (None: the
      baseline's).
    options: an `automap.cluster.CoSearchOptions`: baseline, space, widths,
      microbatches, optimizer, zero, schedule_seconds, bucket, gap,
      finalists, budget, progress, seed (see its docstring).
    **keywords: `options`' fields given one by one instead
      (`search_accelerator(..., gap=0.0)`), but not both ways.

  Returns:
    An `AcceleratorPlan`: the best architecture, its placements and score
    against the baseline, and every pricing's history.

  Raises:
    PlacementError: no workloads, a non-positive area budget, microbatch
      sizes that do not divide a workload's global batch, or a workload the
      baseline cannot train on `devices` devices.
    TypeError: a keyword that is no `CoSearchOptions` field, or one given
      both ways.
  """
  options = with_keywords(CoSearchOptions, options, keywords, "search_accelerator")
  t0 = time.perf_counter()
  workloads, hw, base, budget_area = _checked_inputs(workloads, hardware, area_budget, options)
  search = _CoSearch(workloads, hw, devices, base, options)
  points = _grid_points(budget_area, base, options.space or SPACE)
  listed = search.explore(points, budget_area)
  s, acc, results = search.finalists(points, listed)
  return AcceleratorPlan(acc, tuple(results), base, tuple(search.base_results), s, budget_area,
                         tuple(search.history), time.perf_counter() - t0)
