"""What a pipeline stage costs: time per microbatch, sync and memory, together.

`StageCosts` prices layers run as one stage at a tensor-parallel width, a
recompute mode, a ZeRO stage and a data-parallel degree: its memory terms
(`stage_memory.StageMemory`) and its time terms (`stage_times.StageTimes`),
both over the layers' sums (`stage_sums.StageSums`), and what needs both:
a stage's choices within the memory limit, a finished `Stage`, and the
lower bound on a whole placement's time the DP starts from. `Problem`
(`problem.py`) is one placement search's cluster, microbatches and resolved
options (`problem`). Recompute is per layer: "full" keeps each layer's
input and rebuilds one layer's activations at a time in its backward;
"selective" drops only the attention scores and softmax; "dots" keeps each
layer's input and weight-matmul outputs. Seconds and bytes per device.
"""

from __future__ import annotations

import dataclasses
import math

from automap._src.cluster.errors import PlacementError
from automap._src.cluster.placement.placed import Stage
from automap._src.cluster.placement.problem import SLICE, Problem, problem
from automap._src.cluster.placement.stage_memory import StageMemory
from automap._src.cluster.placement.stage_sums import layer_indices
from automap._src.cluster.placement.stage_times import StageTimes
from automap._src.cluster.profile.layer_graph import LayerGraph


class StageCosts(StageMemory, StageTimes):
  """Costs of one candidate stage (a set of layers) in one placement problem.

  Args:
    graph: the layer graph.
    problem: the placement problem; "dots" and "offload" leave its
      recompute modes where they cannot be priced (`_unpriced`), unless
      stated.

  Raises:
    PlacementError: recompute="dots" or "offload" stated where it cannot
      be priced.
  """

  def __init__(self, graph: LayerGraph, problem: Problem):
    for mode in ("dots", "offload"):
      why = _unpriced(graph, problem, mode) if mode in problem.recompute else None
      if why is None:
        continue
      if problem.recompute_stated:
        raise PlacementError(why)
      problem = dataclasses.replace(
          problem, recompute=tuple(m for m in problem.recompute if m != mode))
    super().__init__(graph, problem)
    self._choices: dict[tuple, tuple[float, list]] = {}

  def lower_bound(self, d: int, zero: int) -> float:
    """Seconds per batch no placement with d replicas and this ZeRO stage
    beats. With S stages on at most P devices the slowest stage takes at
    least the layers' fastest times summed over S, their device-seconds over
    P (as they fit in P devices' memory), and the slowest layer; the largest
    stage holds at least 1/P of the parameters' device-bytes, which the sync
    moves over the fastest link."""
    o = self.problem
    m, per_pipeline = o.microbatches // d, o.devices // d
    layers = self.graph.layers
    everything = (1 << len(layers)) - 1
    # Each stage keeps a microbatch in flight at least, on P devices' memory.
    work, longest = self.packed_work(everything, 1, d, zero, per_pipeline), self.longest(everything)
    fastest = self.fastest(everything)
    param_work = self.graph.least_params()
    # A replica's stage and its copies span (d - 1) * P + 1 devices at least:
    # more than a node, and the sync crosses nodes.
    bandwidth = max(o.hw.link_bandwidth, o.hw.network_bandwidth)
    if (d - 1) * per_pipeline + 1 > o.hw.devices_per_node:
      bandwidth = o.hw.network_bandwidth
    # The bandwidth term of `collectives.ring_seconds` for the step's sync
    # (all-reduce, or reduce-scatter under ZeRO 2), latency left out: a bound.
    g = o.sharded_over(d, zero)
    ring = {0: 2.0, 1: 2.0, 2: 1.0, 3: 0.0}[zero] * (d - 1) / d if g == d else 0.0
    # ZeRO 2 reduce-scatters gradients every microbatch, ZeRO 3 also gathers
    # parameters twice: device-seconds on top of the compute, over the links
    # a shard group spans.
    per_microbatch = {0: 0.0, 1: 0.0, 2: 1.0, 3: 3.0}[zero] * (g - 1) / g
    within = max(o.hw.link_bandwidth, o.hw.network_bandwidth)
    if (g - 1) * per_pipeline + 1 > o.hw.devices_per_node:
      within = o.hw.network_bandwidth
    if o.overlap:  # at least one piece of each stays exposed (`exposed`)
      ring, per_microbatch = ring / len(layers), per_microbatch / len(layers)
    floor = max((work + per_microbatch * param_work / within) / per_pipeline, longest)
    # Two stages or more: each also sends and receives across its border.
    cut = self.least_transfer
    return ring * param_work / per_pipeline / bandwidth + min(
        (m + s - 1) * (max(fastest / s, floor) + (cut if s > 1 else 0.0))
        for s in range(1, min(len(layers), per_pipeline) + 1))

  def choices(self, members: int, d: int, zero: int, per_pipeline: int) -> tuple[float, list]:
    """A stage's choices: (the most microbatches any keeps in flight within
    the memory limit, [(width, recompute, bytes, bytes per microbatch in
    flight, timing)]), timing being (T, Y) where the stage's position changes
    nothing (one link level) and else a memo of them by first device."""
    key = (self.signature(members), d, zero)
    if key not in self._choices:
      limit, most, choices = self.problem.memory, -math.inf, []
      for t in self.widths(members):
        for mode in self.problem.recompute:
          base, per_flight = self.memory_terms(members, t, mode, d, zero)
          if base + per_flight > limit:  # not even one microbatch in flight fits
            continue
          most = max(most, (limit - base) / per_flight * (1 + 1e-9) if per_flight else math.inf)
          timing = (self.times(members, t, mode, 0, d, per_pipeline, zero) if self.single_level
                    else self.times_by_first(members, t, mode, d, zero))
          choices.append((t, mode, base, per_flight, timing))
      self._choices[key] = (most, choices)
    return self._choices[key]

  def stage(self, members: int, t: int, mode: str, first: int, in_flight: float, d: int,
            per_pipeline: int, zero: int) -> Stage:
    """The stage at device offset `first`, with its breakdown."""
    parts = self.time_parts(members, t, mode, first, d, per_pipeline, zero)
    c = self.totals(members, t)
    return Stage(
        layers=tuple(self.graph.layers[i].name for i in layer_indices(members)), width=t,
        recompute=mode != "none", first_device=first, in_flight=in_flight,
        time=parts.compute + parts.transfers + parts.zero, compute=parts.compute,
        collectives=parts.tensor, transfers=parts.transfers, zero=parts.zero, sync=parts.sync,
        memory=self.memory(members, t, mode, in_flight, d, zero), recompute_mode=mode,
        sync_total=parts.sync_total, zero_total=parts.zero_total, flops=c.flops,
        param_bytes=c.params, comm_bytes=c.comm_bytes, bytes_in=c.bytes_in,
        bytes_out=c.bytes_out)



def _unpriced(graph: LayerGraph, problem: Problem, mode: str) -> str | None:
  """Why a recompute mode cannot be priced over the graph (None: it can):
  "dots" needs each layer's kept matmul outputs (traced graphs have them),
  "offload" the values each layer sends to host memory, and a host link."""
  field = {"dots": "dots", "offload": "offloaded"}[mode]
  lacking = next((layer.name for layer in graph.layers
                  if any(getattr(c, field) is None for c in layer.widths.values())), None)
  if mode == "dots" and lacking is not None:
    return (f"recompute='dots' needs each layer's weight-matmul outputs (LayerCost.dots), "
            f"which layer {lacking!r} lacks: trace the step (automap.cluster.plan_cluster, "
            "automap.cluster.price_cluster) or set LayerCost.dots and dots_forward.")
  if mode == "offload" and problem.hw.host_bandwidth is None:
    return (f"recompute='offload': hardware {problem.hw.name!r} states no host link "
            "bandwidth to price the offloaded activations; give "
            "Hardware(host_bandwidth=bytes/s per direction) or another recompute mode.")
  if mode == "offload" and lacking is not None:
    return ("recompute='offload' needs the bytes each layer sends to host memory "
            f"(LayerCost.offloaded), which layer {lacking!r} lacks: state the "
            "checkpoint_names to offload (ClusterConfig.offload_activations).")
  return None


__all__ = ["SLICE", "Problem", "StageCosts", "problem"]
