"""What a candidate stage takes: its seconds per microbatch and its sync per batch.

A stage's time per microbatch is its layers' forward and backward, what its
recompute mode runs again (`stage_sums.rebuilt`), the activations and their
gradients crossing its border, and ZeRO's collectives; once per batch it
syncs its gradients over the data-parallel replicas. Collectives are rings
(`rings.Ring`) over the hardware's links, within a node on `link_*` and
across nodes on `network_*`, so a stage's times depend on where its devices
sit. With overlap, the data-parallel sync and ZeRO collectives run beside
compute in as many pieces as the stage has layers, and only what compute
cannot cover is on the clock (`exposed`). Seconds per device.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from automap._src.cluster.placement.problem import Problem
from automap._src.cluster.placement.rings import Ring
from automap._src.cluster.placement.stage_sums import StageSums, rebuilt
from automap._src.cluster.profile.layer_graph import LayerGraph


class TimeParts(NamedTuple):
  """A stage's seconds: per microbatch compute, transfers and exposed ZeRO
  collectives; per batch the exposed sync; and the two collectives in all."""

  compute: float
  transfers: float
  zero: float
  sync: float
  zero_total: float
  sync_total: float
  tensor: float               # tensor-parallel collectives left exposed (inside compute)


def exposed(comm: float, compute: float, pieces: int) -> float:
  """Seconds of `comm` that `compute` cannot hide when both run in `pieces`
  equal pieces on two streams, each piece of communication bound to one of
  compute (a gather feeds the next piece, a reduction follows the last):
  the critical path is one piece of communication plus, at each of the
  other pieces, whatever communication outlasts the compute beside it,
  c / n + (n - 1) / n * max(0, c - w)."""
  n = max(1, pieces)
  return comm / n + (n - 1) / n * max(0.0, comm - compute)


class StageTimes(StageSums):
  """The time terms of a layer graph's candidate stages in one problem.

  Args:
    graph: the layer graph.
    problem: the placement problem (its hardware's links, ZeRO, overlap,
      recompute share, context parallelism and offload).
  """

  def __init__(self, graph: LayerGraph, problem: Problem):
    super().__init__(graph, problem)
    self.ring = Ring(problem.hw)
    self._levels: dict[tuple, tuple[bool, ...]] = {}
    self._tables: dict[tuple, dict[int, tuple[float, float]]] = {}
    self._times: dict[tuple, tuple[float, float]] = {}

  @functools.cached_property
  def single_level(self) -> bool:
    """One link level: a stage's position changes none of its times."""
    return self.problem.hw.devices_per_node >= self.problem.devices

  @functools.cached_property
  def least_transfer(self) -> float:
    """Seconds every stage of a pipeline of two or more spends at least on
    transfers: a connected graph's stage has an edge crossing its border,
    sent forward and its gradient back, at the widest width on the fastest
    link."""
    graph, hw = self.graph, self.problem.hw
    if len(graph.layers) < 2 or not self._connected():
      return 0.0
    widest = max(max(layer.widths) for layer in graph.layers)
    if self.problem.widths is not None:
      widest = min(widest, max(self.problem.widths))
    least = min(b for _, _, b in self.edges)
    if not least:
      return 0.0
    return 2 * (least / widest / max(hw.link_bandwidth, hw.network_bandwidth)
                + min(hw.link_latency, hw.network_latency))

  def _connected(self) -> bool:
    n = len(self.graph.layers)
    parent = list(range(n))

    def root(i: int) -> int:
      while parent[i] != i:
        parent[i] = parent[parent[i]]
        i = parent[i]
      return i

    for a, b, _ in self.edges:
      parent[root(a)] = root(b)
    return len({root(i) for i in range(n)}) == 1

  def times(self, members: int, t: int, mode: str, first: int, d: int,
            per_pipeline: int, zero: int) -> tuple[float, float]:
    """(T, Y): seconds per microbatch and data-parallel sync per batch of the
    stage at device offset `first` of its pipeline replica."""
    # Rank j of the width-t group syncs with rank j of every replica: d-device
    # rings whose widest spans from replica 0's first device to the last's end.
    g = self.problem.sharded_over(d, zero)
    spot = (first, t, d, per_pipeline, g)
    levels = self._levels.get(spot)
    if levels is None:
      node = self.problem.hw.devices_per_node
      prev, after = (first - 1) % per_pipeline, (first + t) % per_pipeline
      levels = self._levels[spot] = (
          first // node != ((d - 1) * per_pipeline + first + t - 1) // node,
          first // node != ((g - 1) * per_pipeline + first + t - 1) // node,
          first // node != ((d - g) * per_pipeline + first + t - 1) // node,
          first // node != prev // node,
          (first + t - 1) // node != after // node)
    key = (self.signature(members), t, mode, d, zero, levels)
    if key not in self._times:
      parts = self.time_parts(members, t, mode, first, d, per_pipeline, zero)
      self._times[key] = (parts.compute + parts.transfers + parts.zero, parts.sync)
    return self._times[key]

  def times_by_first(self, members: int, t: int, mode: str, d: int, zero: int) -> dict:
    """A memo of `times` by first device for one stage choice."""
    return self._tables.setdefault((self.signature(members), t, mode, d, zero), {})

  def time_parts(self, members, t, mode, first, d, per_pipeline, zero) -> TimeParts:
    """A stage's seconds: per microbatch compute, transfers and ZeRO
    collectives, per batch the data-parallel sync."""
    c = self.totals(members, t)
    ring = self.ring
    # ZeRO's collectives run over the g replicas of a shard group; under
    # hybrid sharding (g < d) the sync then all-reduces each device's shard
    # across the d / g groups, rank j with rank j (as XLA runs a mesh axis
    # of replicas across slices beside one of shards within them).
    g = self.problem.sharded_over(d, zero)
    group = (g * self.problem.context, first, (g - 1) * per_pipeline + first + t - 1)
    across = (d // g, first, (d - g) * per_pipeline + first + t - 1)
    # Activations in and out, forward, and their gradients back: each crosses
    # once per direction of the pass, not overlapped with compute. Only an
    # interleaved first or last stage sends around the end of the pipeline.
    transfers = 2 * (ring.send(c.bytes_in, (first - 1) % per_pipeline, first)
                     + ring.send(c.bytes_out, first + t - 1, (first + t) % per_pipeline))
    share = self.problem.recompute_share
    rebuild = rebuilt(mode, c.forward, c.selective_forward, c.dots_forward, share,
                      c.offloaded_forward)
    compute = c.forward + c.backward + rebuild
    if mode == "offload":
      # Offloaded values cross the host link out in the forward and back in
      # the backward, XLA's host-offload copies running beside the layers'
      # compute (copy-start / copy-done), a layer at a time.
      link = share * c.offloaded / self.problem.hw.host_bandwidth
      compute += (exposed(link, c.forward, c.layers) + exposed(link, c.backward + rebuild,
                                                                c.layers)
                  if self.problem.overlap else 2 * link)
    # Full recompute redoes the forward's collectives (a third of them).
    tensor = c.collectives * (1 + 0.5 * share if mode == "full" else 1.0)
    if self.problem.overlap_tensor and tensor:
      # Each of a layer's 4 (2 forward, 2 backward) beside the matmul it
      # feeds or follows, as Megatron-LM's --tp-comm-overlap runs them.
      rest = compute - tensor
      tensor = exposed(tensor, rest, 4 * c.layers)
      compute = rest + tensor
    # Gradients move in their own dtype (float32 under mixed precision, as
    # Megatron-LM reduces bf16 models' gradients), parameters in theirs.
    grads = c.params * self.problem.gradients
    zero_time = 0.0
    if zero >= 2:  # gradients reduce-scattered every microbatch
      zero_time += ring.gather(grads, *group)
    if zero >= 3:
      # Parameters gathered for the forward, the backward and a full
      # recompute's forward apart (DeepSpeed's stage 3 frees them after each
      # use; Narayanan et al.'s ZeRO-3 runs are priced so). XLA, rebuilding
      # in the backward's program, gathers once for both (`run_check`).
      zero_time += (2 + share if mode == "full" else 2) * ring.gather(c.params, *group)
    sync = {0: ring.reduce(grads, *group), 1: ring.reduce(grads, *group),
            2: ring.gather(c.params, *group), 3: 0.0}[zero]
    if zero and g < d:
      sync += ring.reduce(grads / g, *across)
    # Offloaded optimizer state is read from the host for the update and
    # written back, after the last backward: on the clock, per batch.
    host = (2 * self.optimizer_bytes(c.params, d, zero) / self.problem.hw.host_bandwidth
            if self.problem.offload else 0.0)
    if not self.problem.overlap:
      return TimeParts(compute, transfers, zero_time, sync + host, zero_time, sync + host, tensor)
    # Gathers run a layer ahead of the compute that reads them, reductions
    # a layer behind the backward that makes them; the sync only beside the
    # last microbatch's backward.
    return TimeParts(compute, transfers, exposed(zero_time, compute, c.layers),
                     exposed(sync, c.backward + rebuild, c.layers) + host, zero_time,
                     sync + host, tensor)


__all__ = ["StageTimes", "TimeParts", "exposed"]
