"""What a candidate stage holds: its bytes per device, and the floors the search prunes with.

A stage's bytes per device are a base (parameters, gradients and optimizer
state, each sharded over the data-parallel replicas from its ZeRO stage on,
and what the backward rebuilds at a time) plus a share per microbatch in
flight (what the recompute mode keeps: `stage_sums.kept`). `packed_work`
bounds the device-seconds layers need when they must fit in some devices'
memory, which the placement DP prunes with. Bytes per device.
"""

from __future__ import annotations

import math

from automap._src.cluster.placement.problem import Problem
from automap._src.cluster.placement.stage_sums import StageSums, kept, rebuilt
from automap._src.cluster.profile.layer_graph import LayerGraph


class StageMemory(StageSums):
  """The memory terms of a layer graph's candidate stages in one problem.

  Args:
    graph: the layer graph.
    problem: the placement problem (its memory limit, optimizer, ZeRO,
      recompute modes and offload).
  """

  def __init__(self, graph: LayerGraph, problem: Problem):
    super().__init__(graph, problem)
    self._terms: dict[tuple, tuple[float, float, float]] = {}
    self._hulls: dict[tuple, tuple[float, float, list[tuple[float, float]]]] = {}
    self._packs: dict[tuple, tuple[float, float, list[tuple[float, float]]]] = {}

  def state_bytes(self, params: float, d: int, zero: int) -> float:
    """Bytes per device of parameters, their gradients and optimizer state
    (none where it is offloaded to the host), each sharded over the d
    replicas from its ZeRO stage on."""
    g = self.problem.sharded_over(d, zero)
    shard = lambda level: g if zero >= level else 1  # noqa: E731
    o = self.problem
    held = 0.0 if o.offload else self.optimizer_bytes(params, d, zero)
    return params / shard(3) + o.gradients * params / shard(2) + held

  def memory_terms(self, members: int, t: int, mode: str, d: int,
                   zero: int) -> tuple[float, float]:
    """(base, per microbatch in flight): a stage's bytes per device are
    base + in_flight * per microbatch. Base: parameters, gradients and
    optimizer state (each sharded over data parallelism from its ZeRO stage
    on) and what the backward rebuilds at a time: one layer's activations
    under full recompute, one layer's attention scores under selective,
    one layer's activations less its kept matmul outputs under dots.
    Per microbatch: every activation (none), every layer's input (full),
    all but the attention scores (selective), every layer's input and
    weight-matmul outputs (dots)."""
    key = (self.signature(members), t, mode, d, zero)
    if key not in self._terms:
      c = self.totals(members, t)
      fixed = self.state_bytes(c.params, d, zero)
      if zero >= 3:
        # One parameter array gathered at a time: DeepSpeed's stage 3 gathers
        # a submodule's parameters before it runs and frees them after, XLA's
        # FSDP all-gathers each weight for the matmul that reads it.
        fixed += c.largest_param * (1 - 1 / self.problem.sharded_over(d, zero))
      transient = {"none": 0.0, "full": c.largest_activations,
                   "selective": c.largest_selective, "dots": c.largest_dots_rebuilt,
                   "offload": c.largest_activations}[mode]
      self._terms[key] = (fixed + transient,
                          kept(mode, c.activations, c.inputs, c.selective, c.dots,
                               self.problem.recompute_share))
    return self._terms[key]

  def memory(self, members: int, t: int, mode: str, in_flight: float, d: int,
             zero: int) -> float:
    """Bytes per device."""
    base, per_flight = self.memory_terms(members, t, mode, d, zero)
    return base + in_flight * per_flight

  def packed_work(self, members: int, in_flight: int, d: int, zero: int, devices: int) -> float:
    """Device-seconds per microbatch the layers need at least when every
    stage holding them keeps `in_flight` microbatches or more and they share
    `devices` devices' memory: each layer takes a (width, recompute) option
    priced in device-seconds and device-bytes, and the fractional relaxation
    of that multiple-choice knapsack is solved exactly (each layer starts at
    its fastest option and trades time for bytes along its convex hull,
    cheapest trades first). Infinite when even the smallest choices overflow."""
    sig = self.signature(members)
    kinds, overlaps = sig[0], sig[3]
    key = (kinds, overlaps, in_flight, d, zero)
    pack = self._packs.get(key)
    if pack is None:
      work = size = 0.0
      trades = []
      for kind, count in kinds:
        w, b, hull = self._hull(kind, in_flight, d, zero)
        work, size = work + count * w, size + count * b
        trades += [(rate, count * saved) for rate, saved in hull]
      # Shared parameters are held once: the most that can save (a bound).
      size -= sum((k - 1) * max(t * self.state_bytes(b, d, zero)
                                for t, b in self.shared[g][1].items())
                  for g, k in overlaps)
      pack = self._packs[key] = (work, size, sorted(trades))
    work, size, trades = pack
    excess = size - devices * self.problem.memory
    for rate, saved in trades:
      if excess <= 0:
        break
      work += rate * min(saved, excess)
      excess -= saved
    return work if excess <= 0 else math.inf

  def _hull(self, kind: int, in_flight: int, d: int, zero: int):
    """(device-seconds, device-bytes) of a layer kind's fastest option and
    the trades (extra seconds per byte saved, bytes saved) down its convex
    hull, rates increasing."""
    key = (kind, in_flight, d, zero)
    if key not in self._hulls:
      o = self.problem
      layer = self.example[kind]
      points = []
      for t, c in layer.widths.items():
        if o.widths is not None and t not in o.widths:
          continue
        fixed = self.state_bytes(c.params, d, zero)
        for mode in o.recompute:
          # What a layer keeps per microbatch in flight; the one layer a
          # recomputing stage rebuilds at a time is left out (a bound).
          held = kept(mode, c.activations, self.inputs[kind] / t, c.selective, c.dots or 0.0,
                      o.recompute_share)
          extra = rebuilt(mode, c.forward, c.selective_forward, c.dots_forward,
                          o.recompute_share, c.offloaded_forward)
          points.append((t * (self.least(c) + extra), t * (fixed + in_flight * held)))
      if not points:
        self._hulls[key] = (math.inf, math.inf, [])
        return self._hulls[key]
      w, b = min(points)
      hull = []
      while True:
        lower = [((pw - w) / (b - pb), -pb, pw) for pw, pb in points if pb < b]
        if not lower:
          break
        rate, neg_b, pw = min(lower)
        hull.append((rate, b + neg_b))
        w, b = pw, -neg_b
      self._hulls[key] = (*min(points), hull)
    return self._hulls[key]


__all__ = ["StageMemory"]
