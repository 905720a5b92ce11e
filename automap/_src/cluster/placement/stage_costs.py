"""What a pipeline stage costs: time per microbatch, sync and memory.

`StageCosts` prices layers run as one stage at a tensor-parallel width, a
recompute mode, a ZeRO stage and a data-parallel degree; `Problem` (`problem.py`) is one
placement search's cluster, microbatches and resolved options (`problem`).
Collectives are rings (`rings.Ring`) over the hardware's links, within a node on `link_*`
and across nodes on `network_*`. Recompute is per layer: "full" keeps each
layer's input and rebuilds one layer's activations at a time in its
backward; "selective" drops only the attention scores and softmax; "dots"
keeps each layer's input and weight-matmul outputs (`kept`, `rebuilt`).
With overlap, the data-parallel sync and ZeRO collectives run beside compute
in as many pieces as the stage has layers, and only what compute cannot
cover is on the clock (`exposed`). Seconds and bytes per device.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

from automap._src.cluster.placement.placed import Stage
from automap._src.cluster.placement.problem import SLICE, Problem, problem
from automap._src.cluster.placement.rings import Ring
from automap._src.cluster.profile.layer_graph import Layer, LayerGraph, PlacementError


class Totals(NamedTuple):
  """A stage's sums per microbatch per device at one width (seconds, bytes, FLOPs)."""

  forward: float
  backward: float
  params: float
  activations: float
  collectives: float
  flops: float
  comm_bytes: float
  largest_param: float        # the largest parameter array of any layer
  inputs: float               # every layer's input, summed (full recompute keeps them)
  largest_activations: float  # the largest layer's (full recompute rebuilds one at a time)
  selective: float            # attention scores selective recompute drops
  largest_selective: float
  selective_forward: float    # seconds to rebuild them
  dots: float                 # weight-matmul outputs the "dots" policy keeps
  largest_dots_rebuilt: float  # the most one layer rebuilds under it
  dots_forward: float         # seconds it reruns
  layers: int
  bytes_in: float             # on edges entering the stage
  bytes_out: float            # on edges leaving it


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


def kept(mode: str, activations: float, inputs: float, selective: float, dots: float,
         share: float = 1.0) -> float:
  """Bytes a recompute mode keeps per microbatch in flight: every activation
  ("none"), every layer's input ("full"), all but the attention scores
  ("selective"), every layer's input and weight-matmul outputs ("dots");
  applied to a `share` of the layers (every k-th: 1 / k), the rest keep all."""
  mode_keeps = {"none": activations, "full": inputs, "selective": activations - selective,
                "dots": inputs + dots}[mode]
  return share * mode_keeps + (1 - share) * activations


def rebuilt(mode: str, forward: float, selective_forward: float, dots_forward: float,
            share: float = 1.0) -> float:
  """Seconds of forward a recompute mode runs again in the backward, on a
  `share` of the layers."""
  return share * {"none": 0.0, "full": forward, "selective": selective_forward,
                  "dots": dots_forward}[mode]


def exposed(comm: float, compute: float, pieces: int) -> float:
  """Seconds of `comm` that `compute` cannot hide when both run in `pieces`
  equal pieces on two streams, each piece of communication bound to one of
  compute (a gather feeds the next piece, a reduction follows the last):
  the critical path is one piece of communication plus, at each of the
  other pieces, whatever communication outlasts the compute beside it,
  c / n + (n - 1) / n * max(0, c - w)."""
  n = max(1, pieces)
  return comm / n + (n - 1) / n * max(0.0, comm - compute)


class StageCosts:
  """Costs of one candidate stage (a set of layers) in one placement problem."""

  def __init__(self, graph: LayerGraph, problem: Problem):
    # The "dots" mode needs each layer's kept matmul outputs (traced graphs have them).
    untraced = next((layer.name for layer in graph.layers
                     if any(c.dots is None for c in layer.widths.values())), None)
    if "dots" in problem.recompute and untraced is not None:
      if problem.recompute_stated:
        raise PlacementError(
            f"recompute='dots' needs each layer's weight-matmul outputs (LayerCost.dots), "
            f"which layer {untraced!r} lacks: trace the step (automap.cluster.plan_cluster, "
            "automap.cluster.price_cluster) or set LayerCost.dots and dots_forward.")
      problem = dataclasses.replace(
          problem, recompute=tuple(m for m in problem.recompute if m != "dots"))
    self.graph, self.problem = graph, problem
    self.ring = Ring(problem.hw)
    self.index = {layer.name: i for i, layer in enumerate(graph.layers)}
    self.edges = [(self.index[s], self.index[d], float(b)) for s, d, b in graph.edges]
    self._ins: list[list[tuple[int, float]]] = [[] for _ in graph.layers]
    self._outs: list[list[tuple[int, float]]] = [[] for _ in graph.layers]
    for s, d, b in self.edges:
      self._ins[d].append((s, b))
      self._outs[s].append((d, b))
    # Parameters several layers read: (mask of the layers, width -> bytes).
    self.shared = [(sum(1 << self.index[n] for n in group.layers), group.params)
                   for group in graph.shared]
    self._signatures: dict[int, tuple] = {}
    self._totals: dict[tuple, tuple[float, ...]] = {}
    self._choices: dict[tuple, tuple[float, list]] = {}
    self._terms: dict[tuple, tuple[float, float, float]] = {}
    self._levels: dict[tuple, tuple[bool, ...]] = {}
    self._tables: dict[tuple, dict[int, tuple[float, float]]] = {}
    self._times: dict[tuple, tuple[float, float]] = {}
    self._inside: dict[int, list[int]] = {}
    self._widths: dict[tuple, list[int]] = {}
    self._longest: dict[int, float] = {}
    self._fastest: dict[int, float] = {0: 0.0}
    # Layers priced alike, with inputs as large (a repeated block), share one
    # template; `inputs[kind]` is the bytes per microbatch entering one.
    entering = [sum(b for _, b in ins) for ins in self._ins]
    kinds: dict[tuple, int] = {}
    self.kind = [kinds.setdefault((tuple(sorted(layer.widths.items())), entering[i]), len(kinds))
                 for i, layer in enumerate(graph.layers)]
    self.example: dict[int, Layer] = {}
    self.inputs: dict[int, float] = {}
    for i, (layer, kind) in enumerate(zip(graph.layers, self.kind)):
      self.example.setdefault(kind, layer)
      self.inputs.setdefault(kind, entering[i])
    self._hulls: dict[tuple, tuple[float, float, list[tuple[float, float]]]] = {}
    self._packs: dict[tuple, tuple[float, float, list[tuple[float, float]]]] = {}

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
                          o.recompute_share)
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

  def fastest(self, members: int) -> float:
    """The layers' seconds per microbatch at their fastest widths, summed."""
    if members not in self._fastest:
      self._fastest[members] = sum(
          min(self.least(c) for c in self.graph.layers[i].widths.values())
          for i in layer_indices(members))
    return self._fastest[members]

  def least(self, c) -> float:
    """A layer's seconds per microbatch at the least: forward and backward,
    less its tensor-parallel collectives where they may hide (a bound)."""
    return c.forward + c.backward - (c.collectives if self.problem.overlap_tensor else 0.0)

  def longest(self, members: int) -> float:
    """The slowest layer's seconds per microbatch at its fastest width: no
    stage holding it is faster."""
    if members not in self._longest:
      self._longest[members] = max(
          (min(self.least(c) for c in self.graph.layers[i].widths.values())
           for i in layer_indices(members)), default=0.0)
    return self._longest[members]

  def widths(self, members: int) -> list[int]:
    """Tensor-parallel widths every layer of the stage prices (and allowed)."""
    kinds = self.signature(members)[0]
    if kinds not in self._widths:
      common = set.intersection(*(set(self.example[kind].widths) for kind, _ in kinds))
      if self.problem.widths is not None:
        common &= set(self.problem.widths)
      self._widths[kinds] = sorted(common)
    return self._widths[kinds]

  def totals(self, members: int, t: int) -> Totals:
    """A stage's sums per microbatch per device at width t."""
    sig = self.signature(members)
    key = (sig, t)
    if key not in self._totals:
      kinds, b_in, b_out, overlaps = sig
      costs = [(n, self.example[kind].widths[t], self.inputs[kind] / t) for kind, n in kinds]
      total = lambda f: sum(n * f(c) for n, c, _ in costs)  # noqa: E731
      # A parameter several of the stage's layers read is held once.
      held_twice = sum((k - 1) * self.shared[g][1].get(t, 0.0) for g, k in overlaps)
      self._totals[key] = Totals(
          forward=total(lambda c: c.forward), backward=total(lambda c: c.backward),
          params=total(lambda c: c.params) - held_twice,
          activations=total(lambda c: c.activations),
          collectives=total(lambda c: c.collectives), flops=total(lambda c: c.flops),
          comm_bytes=total(lambda c: c.comm_bytes),
          largest_param=max(c.largest_param or c.params for _, c, _ in costs),
          inputs=sum(n * x for n, _, x in costs),
          largest_activations=max(c.activations for _, c, _ in costs),
          selective=total(lambda c: c.selective),
          largest_selective=max(c.selective for _, c, _ in costs),
          selective_forward=total(lambda c: c.selective_forward),
          dots=total(lambda c: c.dots or 0.0),
          largest_dots_rebuilt=max(max(c.activations - (c.dots or 0.0), 0.0)
                                   for _, c, _ in costs),
          dots_forward=total(lambda c: c.dots_forward),
          layers=sum(n for n, _, _ in costs), bytes_in=b_in / t, bytes_out=b_out / t)
    return self._totals[key]

  def signature(self, members: int) -> tuple:
    """What a stage's costs depend on: how many layers of each kind it
    holds, the bytes per microbatch on edges into and out of it, and how
    many readers of each shared parameter it holds (where two or more).
    Stages of a repeated block that hold as many blocks share their costs."""
    sig = self._signatures.get(members)
    if sig is None:
      counts: dict[int, int] = {}
      into = out = 0.0
      for i in layer_indices(members):
        counts[self.kind[i]] = counts.get(self.kind[i], 0) + 1
        into += sum(b for s, b in self._ins[i] if not members >> s & 1)
        out += sum(b for d, b in self._outs[i] if not members >> d & 1)
      overlaps = tuple((g, k) for g, (mask, _) in enumerate(self.shared)
                       if (k := (members & mask).bit_count()) > 1)
      sig = self._signatures[members] = (tuple(sorted(counts.items())), into, out, overlaps)
    return sig

  def state_bytes(self, params: float, d: int, zero: int) -> float:
    """Bytes per device of parameters, their gradients and optimizer state
    (none where it is offloaded to the host), each sharded over the d
    replicas from its ZeRO stage on."""
    g = self.problem.sharded_over(d, zero)
    shard = lambda level: g if zero >= level else 1  # noqa: E731
    o = self.problem
    held = 0.0 if o.offload else self.optimizer_bytes(params, d, zero)
    return params / shard(3) + o.gradients * params / shard(2) + held

  def optimizer_bytes(self, params: float, d: int, zero: int) -> float:
    """Bytes per device of optimizer state, sharded from ZeRO stage 1 on."""
    return self.problem.optimizer * params / (self.problem.sharded_over(d, zero) if zero else 1)

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
                   "selective": c.largest_selective, "dots": c.largest_dots_rebuilt}[mode]
      self._terms[key] = (fixed + transient,
                          kept(mode, c.activations, c.inputs, c.selective, c.dots,
                               self.problem.recompute_share))
    return self._terms[key]

  def memory(self, members: int, t: int, mode: str, in_flight: float, d: int,
             zero: int) -> float:
    """Bytes per device."""
    base, per_flight = self.memory_terms(members, t, mode, d, zero)
    return base + in_flight * per_flight

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
    rebuild = rebuilt(mode, c.forward, c.selective_forward, c.dots_forward, share)
    compute = c.forward + c.backward + rebuild
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

  def downsets_inside(self, rest: int, downs: list[int]) -> list[int]:
    """The downsets strictly inside `rest`."""
    if rest not in self._inside:
      self._inside[rest] = [h for h in downs if not h & ~rest and h != rest]
    return self._inside[rest]


def layer_indices(mask: int) -> list[int]:
  return [i for i in range(mask.bit_length()) if mask >> i & 1]


__all__ = ["SLICE", "Problem", "StageCosts", "exposed", "kept", "layer_indices", "problem",
           "rebuilt"]
