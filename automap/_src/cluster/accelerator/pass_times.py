"""Seconds of layer passes on an accelerator: lower bounds first, schedules on demand.

`PassBounds` prices every pass of a co-search at its lower bound on one
architecture at a time, all passes at once: no schedule of a pass is
shorter than its critical path at each op's best latency, nor than its
work spread over every core. `PassTimes` holds one architecture's pass
times as the search refines them (a pass's bound until it is scheduled,
its schedule after) and builds from them the layer graphs the placement
DP reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from automap._src.cluster.accelerator import chip as acc_lib
from automap._src.cluster.accelerator import scheduling
from automap._src.cluster.accelerator.passes import LayerPass, ProfiledWorkload
from automap._src.cluster.profile import layers as layers_lib
from automap._src.cluster.profile.layer_graph import LayerCost, LayerGraph


class PassBounds:
  """Lower bounds on the passes' schedules, all passes of an accelerator at
  once: no schedule of a pass is shorter than its critical path at each op's
  best latency, nor than its work spread over every core."""

  def __init__(self, passes: Sequence[LayerPass]):
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
    # Accelerator -> (its bounds, its pricing key): a cache keyed by the full input.
    self.memo: dict[acc_lib.Accelerator, tuple[np.ndarray, tuple]] = {}

  def __call__(self, acc: acc_lib.Accelerator) -> np.ndarray:
    """Per pass (in `passes` order), seconds."""
    return self._priced(acc)[0]

  def pricing_key(self, acc: acc_lib.Accelerator) -> tuple:
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


class PassTimes:
  """Seconds of each layer pass on one accelerator, and the layer graphs of
  profiled workloads they make.

  Mode "bound" prices each pass at its lower bound. Modes "greedy" (list
  schedules) and "exact" (CP-SAT, `solver_seconds` per pass) price a pass
  at its schedule once `schedule` has made it, and at its bound until then:
  a placement on those times is a lower bound, and `cosearch._place_on`
  schedules only the passes of the (size, width) pairs it picks.
  """

  def __init__(self, acc: acc_lib.Accelerator, solver_seconds: float, mode: str,
               bounds: PassBounds):
    self.acc, self.solver_seconds, self.mode = acc, solver_seconds, mode
    self.index, self.bounds = bounds.index, bounds(acc)
    self.scheduled: dict[LayerPass, float] = {}  # pass -> its schedule's makespan
    self.list_scheduled: dict[LayerPass, float] = {}  # for `upper_bound` only

  def makespan(self, p: LayerPass) -> float:
    """The pass's schedule's seconds, or its lower bound until it has one."""
    found = self.scheduled.get(p)
    return self.bounds[self.index[p]] if found is None else found

  def schedule(self, p: LayerPass) -> bool:
    """Schedules the pass (in modes other than "bound"); whether it was not yet."""
    if self.mode == "bound" or p in self.scheduled:
      return False
    if not p.ops:
      self.scheduled[p] = 0.0
    else:  # a greedy list schedule starts the solver; without time, it stands
      seconds = self.solver_seconds if self.mode == "exact" else 0.0
      self.scheduled[p] = scheduling.schedule(p.ops, p.edges, self.acc,
                                              seconds=seconds).makespan
    return True

  def upper_bound(self, p: LayerPass) -> float:
    """No schedule of the pass these times settle on is longer: its
    schedule, or else its list schedule (which CP-SAT only shortens)."""
    if p in self.scheduled:
      return self.scheduled[p]
    if p not in self.list_scheduled:
      self.list_scheduled[p] = scheduling.schedule(p.ops, p.edges, self.acc,
                                                   seconds=0.0).makespan
    return self.list_scheduled[p]

  def layer_graph(self, profiled: ProfiledWorkload, size: int) -> LayerGraph:
    """The workload's layer graph at microbatch `size`, every width it was
    profiled at, its layer passes at these times."""
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
          high = np.array([self.upper_bound(forward[i]) for i in layers])
          bw[layers] += _least_share(fw[layers], high) * self.makespan(p)
      comm_fw, comm_bw = profiled.comm[(size, t)]
      graph = profiled.graphs[size][t]
      per_width[t] = [
          LayerCost(fw[i] + comm_fw[i], bw[i] + comm_bw[i], c.params, c.activations,
                    comm_fw[i] + comm_bw[i], largest_param=c.largest_param)
          for i, c in enumerate(layer.widths[t] for layer in graph.layers)]
    layers = tuple(dataclasses.replace(layer, widths={t: per_width[t][i] for t in widths})
                   for i, layer in enumerate(base.layers))
    graph = LayerGraph(layers, base.edges, base.shared)
    for name, times in profiled.workload.repeat.items():
      graph = graph.repeat(name, times)
    return graph


__all__ = ["PassBounds", "PassTimes"]
