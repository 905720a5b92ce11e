"""Device placement: pipeline stages x tensor x data parallelism over a layer graph.

The placement half of PHAZE, on a layer graph with per-layer costs. A plan
splits the graph into pipeline stages, contiguous in a topological sense (each
prefix of stages is a downset: it holds every predecessor of its layers), runs
each stage on `t` tensor-parallel devices (its own width), replicates the whole
pipeline `d` ways for data parallelism, and per stage stashes every
in-flight microbatch's activations or recomputes (modes below).

Schedule and memory follow 1F1B (PipeDream-Flush). With `m` microbatches per
pipeline and `S` stages, stage `i` (0-based) holds `min(S - i, m)` microbatches
in flight; a batch takes

    (m + S - 1) * max_i T_i  +  max_i Y_i

where `T_i` is stage i's time per microbatch (forward, backward, recompute,
transfers to the neighbouring stages, the exposed ZeRO collectives) and `Y_i`
the exposed part of its data-parallel gradient sync (overlap below; under
the interleaved schedule, (m + (S - 1) / v) * max_i T_i + max_i Y_i). Units:
seconds, bytes (per device).

Collectives are priced as rings over the hardware's links: within a node on
`link_*`, across nodes on `network_*`, with devices numbered pipeline-major
(replica r of the pipeline holds devices [r*P, (r+1)*P), its stages in order,
each stage's tensor-parallel group contiguous), so a group's level follows from
where its devices sit.

Recompute is per layer, as Megatron-LM and `jax.checkpoint` on each block
practise it: "full" keeps each layer's input per microbatch in flight and
rebuilds one layer's activations at a time in its backward; "selective"
keeps everything but the attention scores and softmax (`LayerCost.selective`)
and rebuilds those; "dots" keeps each layer's input and its weight-matmul
outputs (`LayerCost.dots`, JAX's `checkpoint_dots_with_no_batch_dims`) and
reruns the rest of the forward the backward needs. With `overlap`, the
data-parallel sync and the ZeRO collectives run beside compute in as many
pieces as the stage has layers (`exposed`): only what compute cannot cover is
on the clock.

The interleaved 1F1B schedule (v chunks per stage, Narayanan et al. 2021)
splits a chain of equal blocks evenly into S * v chunks, chunk c on stage
c mod S: the bubble shrinks to (S - 1) / v of a stage's time per
microbatch, each chunk boundary is a transfer, and stage i keeps
(S - i - 1) * 2 + (v - 1) * S + 1 chunks in flight (Megatron-LM's warm-up).
It is priced by `uniform` and searched beside the DP where legal.

The search is exact: a dynamic program over (downset still to place, stages
after it) that keeps, per state, the Pareto front of (devices used, max T, max
Y), inside an outer loop over the data-parallel degree and ZeRO stage. It
prunes with lower bounds on what a partial plan can still reach (the work
left over the devices left, in their memory: `_StageCosts.packed_work`), and
prices stages by what their costs depend on (`_StageCosts.signature`), so the
stages of a repeated block are priced once. The DP and `_StageCosts` (which
prices its candidate stages and bounds what a partial plan can still reach)
stay one module: the bounds are written for the DP's states (a downset still
to place, the stages after it), so neither reads alone. The data they read
and return is in `model.py`, their options in `options.py`.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

from automap._src.cluster.layer_graph import Layer, LayerGraph, Placement, PlacementError, Stage
from automap._src.cluster.options import PlacementOptions, memory_limit, recompute_modes
from automap._src.cost.collectives import ALL_GATHER, ALL_REDUCE, ring_seconds, send_seconds
from automap._src.cost.hardware import Hardware, get_hardware
from automap._src.search.request import with_keywords

# Downsets enumerated at most; wider graphs should be coarsened into layer groups.
MAX_DOWNSETS = 4096


@dataclasses.dataclass(frozen=True)
class _Problem:
  """One search: a graph's cluster and microbatches, with the options resolved
  against the hardware."""

  devices: int
  microbatches: int
  memory: float                 # bytes per device
  hw: Hardware
  optimizer: float              # bytes of optimizer state per parameter byte
  zero: tuple[int, ...]         # ZeRO stages to try
  recompute: tuple[str, ...]    # per stage, the modes tried
  widths: tuple[int, ...] | None
  stages: int | None
  gradients: float = 1.0        # bytes of gradient per parameter byte
  overlap: bool = True          # sync and ZeRO collectives beside compute
  virtual_stages: int | None = 1  # None: interleaving searched where legal
  overlap_tensor: bool = False  # tensor-parallel collectives beside the matmuls
  recompute_stated: bool = True  # `recompute` as the options name it (else every mode)


class _Totals(NamedTuple):
  """A stage's sums per microbatch per device at one width (seconds, bytes, FLOPs)."""

  forward: float
  backward: float
  params: float
  activations: float
  collectives: float
  flops: float
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


class _TimeParts(NamedTuple):
  """A stage's seconds: per microbatch compute, transfers and exposed ZeRO
  collectives; per batch the exposed sync; and the two collectives in all."""

  compute: float
  transfers: float
  zero: float
  sync: float
  zero_total: float
  sync_total: float
  tensor: float               # tensor-parallel collectives left exposed (inside compute)


def kept(mode: str, activations: float, inputs: float, selective: float, dots: float) -> float:
  """Bytes a recompute mode keeps per microbatch in flight: every activation
  ("none"), every layer's input ("full"), all but the attention scores
  ("selective"), every layer's input and weight-matmul outputs ("dots")."""
  return {"none": activations, "full": inputs, "selective": activations - selective,
          "dots": inputs + dots}[mode]


def rebuilt(mode: str, forward: float, selective_forward: float, dots_forward: float) -> float:
  """Seconds of forward a recompute mode runs again in the backward."""
  return {"none": 0.0, "full": forward, "selective": selective_forward,
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


class _Ring:
  """Ring collectives over a set of devices on the hardware's links
  (`collectives`), for arrays of `nbytes` in all."""

  def __init__(self, hw: Hardware):
    self.hw = hw

  def link(self, lo: int, hi: int) -> tuple[float, float]:
    """(bandwidth, latency) of the link joining devices lo..hi."""
    node = self.hw.devices_per_node
    if lo // node == hi // node:
      return self.hw.link_bandwidth, self.hw.link_latency
    return self.hw.network_bandwidth, self.hw.network_latency

  def gather(self, nbytes: float, n: int, lo: int, hi: int) -> float:
    """All-gather (or reduce-scatter) of `nbytes` in all over a ring of n
    devices spanning lo..hi: a reduce-scatter's input is the gathered
    array, its steps the same."""
    if n == 1 or nbytes == 0:
      return 0.0
    return ring_seconds(ALL_GATHER, nbytes, n, *self.link(lo, hi))

  def reduce(self, nbytes: float, n: int, lo: int, hi: int) -> float:
    """All-reduce of `nbytes` over a ring of n devices spanning lo..hi."""
    if n == 1 or nbytes == 0:
      return 0.0
    return ring_seconds(ALL_REDUCE, nbytes, n, *self.link(lo, hi))

  def send(self, nbytes: float, a: int, b: int) -> float:
    """Sends `nbytes` from device a to device b."""
    if nbytes == 0:
      return 0.0
    return send_seconds(nbytes, *self.link(min(a, b), max(a, b)))


def _downsets(graph: LayerGraph) -> list[int]:
  """Every downset of the graph as a bitmask over layer indices (empty first)."""
  index = {layer.name: i for i, layer in enumerate(graph.layers)}
  preds = [0] * len(graph.layers)
  for src, dst, _ in graph.edges:
    preds[index[dst]] |= 1 << index[src]
  seen = {0}
  frontier = [0]
  while frontier:
    grown = []
    for down in frontier:
      for i, p in enumerate(preds):
        bit = 1 << i
        if not down & bit and p & down == p and down | bit not in seen:
          seen.add(down | bit)
          grown.append(down | bit)
      if len(seen) > MAX_DOWNSETS:
        raise PlacementError(
            f"the layer graph has more than {MAX_DOWNSETS} downsets (too many parallel "
            f"branches); group layers into coarser nodes before placing.")
    frontier = grown
  return sorted(seen, key=lambda s: (bin(s).count("1"), s))


class _StageCosts:
  """Costs of one candidate stage (a set of layers) in one placement problem."""

  def __init__(self, graph: LayerGraph, problem: _Problem):
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
    self.ring = _Ring(problem.hw)
    self.index = {layer.name: i for i, layer in enumerate(graph.layers)}
    self.edges = [(self.index[s], self.index[d], float(b)) for s, d, b in graph.edges]
    self._ins: list[list[tuple[int, float]]] = [[] for _ in graph.layers]
    self._outs: list[list[tuple[int, float]]] = [[] for _ in graph.layers]
    for s, d, b in self.edges:
      self._ins[d].append((s, b))
      self._outs[s].append((d, b))
    self._signatures: dict[int, tuple] = {}
    self._totals: dict[tuple, tuple[float, ...]] = {}
    self._choices: dict[tuple, tuple[float, list]] = {}
    self._terms: dict[tuple, tuple[float, float, float]] = {}
    self._levels: dict[tuple[int, int, int], tuple[bool, bool, bool]] = {}
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
    param_work = sum(min(t * c.params for t, c in layer.widths.items()) for layer in layers)
    # A replica's stage and its copies span (d - 1) * P + 1 devices at least:
    # more than a node, and the sync crosses nodes.
    bandwidth = max(o.hw.link_bandwidth, o.hw.network_bandwidth)
    if (d - 1) * per_pipeline + 1 > o.hw.devices_per_node:
      bandwidth = o.hw.network_bandwidth
    # The bandwidth term of `collectives.ring_seconds` for the step's sync
    # (all-reduce, or reduce-scatter under ZeRO 2), latency left out: a bound.
    ring = {0: 2.0, 1: 2.0, 2: 1.0, 3: 0.0}[zero] * (d - 1) / d
    # ZeRO 2 reduce-scatters gradients every microbatch, ZeRO 3 also gathers
    # parameters twice: device-seconds on top of the compute.
    per_microbatch = {0: 0.0, 1: 0.0, 2: 1.0, 3: 3.0}[zero] * (d - 1) / d
    if o.overlap:  # at least one piece of each stays exposed (`exposed`)
      ring, per_microbatch = ring / len(layers), per_microbatch / len(layers)
    floor = max((work + per_microbatch * param_work / bandwidth) / per_pipeline, longest)
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
    kinds = self.signature(members)[0]
    key = (kinds, in_flight, d, zero)
    pack = self._packs.get(key)
    if pack is None:
      work = size = 0.0
      trades = []
      for kind, count in kinds:
        w, b, hull = self._hull(kind, in_flight, d, zero)
        work, size = work + count * w, size + count * b
        trades += [(rate, count * saved) for rate, saved in hull]
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
          held = kept(mode, c.activations, self.inputs[kind] / t, c.selective, c.dots or 0.0)
          extra = rebuilt(mode, c.forward, c.selective_forward, c.dots_forward)
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
          for i in _layer_indices(members))
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
           for i in _layer_indices(members)), default=0.0)
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

  def totals(self, members: int, t: int) -> _Totals:
    """A stage's sums per microbatch per device at width t."""
    sig = self.signature(members)
    key = (sig, t)
    if key not in self._totals:
      kinds, b_in, b_out = sig
      costs = [(n, self.example[kind].widths[t], self.inputs[kind] / t) for kind, n in kinds]
      total = lambda f: sum(n * f(c) for n, c, _ in costs)  # noqa: E731
      self._totals[key] = _Totals(
          forward=total(lambda c: c.forward), backward=total(lambda c: c.backward),
          params=total(lambda c: c.params), activations=total(lambda c: c.activations),
          collectives=total(lambda c: c.collectives), flops=total(lambda c: c.flops),
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
    holds, and the bytes per microbatch on edges into and out of it. Stages
    of a repeated block that hold as many blocks share their costs."""
    sig = self._signatures.get(members)
    if sig is None:
      counts: dict[int, int] = {}
      into = out = 0.0
      for i in _layer_indices(members):
        counts[self.kind[i]] = counts.get(self.kind[i], 0) + 1
        into += sum(b for s, b in self._ins[i] if not members >> s & 1)
        out += sum(b for d, b in self._outs[i] if not members >> d & 1)
      sig = self._signatures[members] = (tuple(sorted(counts.items())), into, out)
    return sig

  def state_bytes(self, params: float, d: int, zero: int) -> float:
    """Bytes per device of parameters, their gradients and optimizer state,
    each sharded over the d replicas from its ZeRO stage on."""
    shard = lambda level: d if zero >= level else 1  # noqa: E731
    o = self.problem
    return params / shard(3) + o.gradients * params / shard(2) + o.optimizer * params / shard(1)

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
        fixed += c.largest_param * (1 - 1 / d)
      transient = {"none": 0.0, "full": c.largest_activations,
                   "selective": c.largest_selective, "dots": c.largest_dots_rebuilt}[mode]
      self._terms[key] = (fixed + transient,
                          kept(mode, c.activations, c.inputs, c.selective, c.dots))
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
    spot = (first, t, d, per_pipeline)
    levels = self._levels.get(spot)
    if levels is None:
      node = self.problem.hw.devices_per_node
      prev, after = (first - 1) % per_pipeline, (first + t) % per_pipeline
      levels = self._levels[spot] = (
          first // node != ((d - 1) * per_pipeline + first + t - 1) // node,
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

  def time_parts(self, members, t, mode, first, d, per_pipeline, zero) -> _TimeParts:
    """A stage's seconds: per microbatch compute, transfers and ZeRO
    collectives, per batch the data-parallel sync."""
    c = self.totals(members, t)
    ring = self.ring
    group = (d, first, (d - 1) * per_pipeline + first + t - 1)
    # Activations in and out, forward, and their gradients back: each crosses
    # once per direction of the pass, not overlapped with compute. Only an
    # interleaved first or last stage sends around the end of the pipeline.
    transfers = 2 * (ring.send(c.bytes_in, (first - 1) % per_pipeline, first)
                     + ring.send(c.bytes_out, first + t - 1, (first + t) % per_pipeline))
    rebuild = rebuilt(mode, c.forward, c.selective_forward, c.dots_forward)
    compute = c.forward + c.backward + rebuild
    tensor = c.collectives * (1.5 if mode == "full" else 1.0)  # full recompute redoes forward's
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
    if zero >= 3:  # parameters gathered for forward, backward (and full recompute)
      zero_time += (3 if mode == "full" else 2) * ring.gather(c.params, *group)
    sync = {0: ring.reduce(grads, *group), 1: ring.reduce(grads, *group),
            2: ring.gather(c.params, *group), 3: 0.0}[zero]
    if not self.problem.overlap:
      return _TimeParts(compute, transfers, zero_time, sync, zero_time, sync, tensor)
    # Gathers run a layer ahead of the compute that reads them, reductions
    # a layer behind the backward that makes them; the sync only beside the
    # last microbatch's backward.
    return _TimeParts(compute, transfers, exposed(zero_time, compute, c.layers),
                      exposed(sync, c.backward + rebuild, c.layers), zero_time, sync, tensor)

  def stage(self, members: int, t: int, mode: str, first: int, in_flight: float, d: int,
            per_pipeline: int, zero: int) -> Stage:
    """The stage at device offset `first`, with its breakdown."""
    parts = self.time_parts(members, t, mode, first, d, per_pipeline, zero)
    c = self.totals(members, t)
    return Stage(
        layers=tuple(self.graph.layers[i].name for i in _layer_indices(members)), width=t,
        recompute=mode != "none", first_device=first, in_flight=in_flight,
        time=parts.compute + parts.transfers + parts.zero, compute=parts.compute,
        collectives=parts.tensor, transfers=parts.transfers, zero=parts.zero, sync=parts.sync,
        memory=self.memory(members, t, mode, in_flight, d, zero), recompute_mode=mode,
        sync_total=parts.sync_total, zero_total=parts.zero_total, flops=c.flops)

  def downsets_inside(self, rest: int, downs: list[int]) -> list[int]:
    """The downsets strictly inside `rest`."""
    if rest not in self._inside:
      self._inside[rest] = [h for h in downs if not h & ~rest and h != rest]
    return self._inside[rest]


def _completion_floor(before: int, t_max: float, longest: float, work: float, fastest: float,
                      spare: int, head: int, transfer: float) -> float:
  """A lower bound on (m + S - 1) * max T with `before` = m + (stages so far)
  and `head` still to place on at most `spare` devices in S' >= 1 more stages:
  min over S' of (before + S') * max(T so far, the slowest layer, the work
  over the devices, the layers' fastest times over S'), at the S' where the
  last two cross; each new stage also pays the least transfer `transfer`."""
  if not head:
    return before * t_max
  if spare <= 0:
    return math.inf
  floor = max(longest, work / spare)
  cross = fastest / floor
  counts = {max(1, min(spare, math.floor(cross))), max(1, min(spare, math.ceil(cross)))}
  return min((before + s) * max(t_max, max(floor, fastest / s) + transfer) for s in counts)


def _layer_indices(mask: int) -> list[int]:
  return [i for i in range(mask.bit_length()) if mask >> i & 1]


def _best_at(graph: LayerGraph, costs: _StageCosts, downs: list[int], d: int, zero: int,
               bound: float) -> Placement | None:
  """The best placement with data-parallel degree d and ZeRO stage `zero`
  taking less than `bound` seconds per batch, if any."""
  problem = costs.problem
  m = problem.microbatches // d
  per_pipeline = problem.devices // d
  # fronts[k][remaining downset] -> Pareto front of (devices used, max T, max Y,
  # stages), built from the end of the graph backwards: stage positions count
  # from the pipeline's last device, and the k stages after a state fix the
  # in-flight count of the next one.
  # choices: a linked list ((members, width, recompute mode, first device,
  # in flight), rest of the list) of the stages chosen so far.
  fronts: list[dict[int, list[tuple]]] = [{downs[-1]: [(0, 0.0, 0.0, None)]}]
  best: Placement | None = None
  earlier: dict[int, list[tuple]] = {}
  single_level = costs.single_level
  for k in range(len(graph.layers)):
    after: dict[int, list[tuple]] = {}
    # This stage's microbatches in flight; the head's stages keep more.
    in_flight, ahead = min(k + 1, m), min(k + 2, m)
    for rest, front in fronts[k].items():
      least_used = min(f[0] for f in front)
      least_t, least_y = min(f[1] for f in front), min(f[2] for f in front)
      for head in costs.downsets_inside(rest, downs):
        members = rest & ~head
        most, choices = costs.choices(members, d, zero, per_pipeline)
        if in_flight > most:
          continue
        spare = per_pipeline - least_used - 1
        longest, work = costs.longest(head), (
            costs.packed_work(head, ahead, d, zero, spare) if head and spare > 0 else 0.0)
        if _completion_floor(m + k, least_t, longest, work, costs.fastest(head), spare, head,
                  costs.least_transfer) + least_y >= bound:
          continue
        for t, mode, base, per_flight, timing in choices:
          if base + in_flight * per_flight > problem.memory:
            continue
          if single_level:  # one link level: the stage's position changes nothing
            time, sync = timing
          else:
            table = timing  # first device -> (T, Y)
          for used, t_max, y_max, chosen in front:
            if used + t > per_pipeline:
              continue
            first = per_pipeline - used - t
            if not single_level:
              found = table.get(first)
              if found is None:
                found = table[first] = costs.times(members, t, mode, first, d,
                                                   per_pipeline, zero)
              time, sync = found
            t_new = t_max if t_max > time else time
            y_new = y_max if y_max > sync else sync
            # Any completion has at least k + 1 stages, these maxima, and
            # spreads the work left over the devices left at best.
            floor = t_new if t_new > longest else longest
            if first:
              floor = floor if floor > work / first else work / first
            elif head:
              continue
            if (m + k) * floor + y_new >= bound:
              continue
            if head and first < spare:  # the head's memory on fewer devices
              packed = costs.packed_work(head, ahead, d, zero, first) / first
              if (m + k) * packed + y_new >= bound:
                continue
            entry = (used + t, t_new, y_new, ((members, t, mode, first, in_flight), chosen))
            if any(f[0] <= entry[0] and f[1] <= t_new and f[2] <= y_new
                   for f in earlier.get(head, ())):
              continue
            target = after.setdefault(head, [])
            if any(f[0] <= entry[0] and f[1] <= t_new and f[2] <= y_new for f in target):
              continue
            target[:] = [f for f in target
                         if not (entry[0] <= f[0] and t_new <= f[1] and y_new <= f[2])]
            target.append(entry)
    for used, t_max, y_max, chosen in after.pop(0, []):
      time = (m + k) * t_max + y_max
      if time < bound and problem.stages in (None, k + 1):
        # Stage offsets were counted from the end; shift onto device 0.
        shift = per_pipeline - used
        stages = []
        while chosen is not None:
          (members, t, mode, first, n), chosen = chosen
          stage = costs.stage(members, t, mode, first, n, d, per_pipeline, zero)
          stages.append(dataclasses.replace(stage, first_device=first - shift))
        bound, best = time, Placement(d, m, zero, tuple(stages), used * d, time)
    if not after or (problem.stages is not None and k + 1 >= problem.stages):
      break
    if problem.stages is None:  # keep what no later entry can beat
      for rest, front in after.items():
        kept = [f for f in earlier.get(rest, ())
                if not any(e[0] <= f[0] and e[1] <= f[1] and e[2] <= f[2] for e in front)]
        earlier[rest] = kept + front
    fronts.append(after)
  return best


def place(graph: LayerGraph, *, devices: int, microbatches: int, hardware: str | Hardware,
          options: PlacementOptions | None = None, **keywords) -> Placement:
  """The fastest placement of `graph` on `devices` devices.

  microbatches: microbatches per batch over all data-parallel replicas (each of
    d replicas runs microbatches / d of them; d must divide it).
  hardware: its links price collectives and transfers; its `hbm_capacity` is
    the memory limit unless the options give `memory_limit` (bytes per device,
    or None for none).
  options: an automap.cluster.PlacementOptions: memory_limit, optimizer, zero,
    recompute, widths, data_parallel, stages (see its docstring). Each field
    may be given as a keyword instead (`place(..., zero=0)`), but not both ways.
  """
  options = with_keywords(PlacementOptions, options, keywords, "place")
  return place_any([(graph, microbatches)], devices=devices, hardware=hardware,
                   options=options)[0]


def place_any(candidates: Sequence[tuple[LayerGraph, int]], *, devices: int,
              hardware: str | Hardware, options: PlacementOptions | None = None,
              bound: float = math.inf) -> tuple[Placement, int]:
  """The fastest placement of any of (graph, microbatches) candidates (a model
  at several microbatch sizes), and the index of the one it places; the
  candidates share one bound, so the later ones are mostly pruned. Only
  plans faster than `bound` seconds per batch count: a caller that needs no
  slower one says so and the search prunes from the start."""
  options = options if options is not None else PlacementOptions()
  data_parallel, stages = options.data_parallel, options.stages
  for name, value in (("data_parallel", data_parallel), ("stages", stages)):
    if value is not None and not value <= devices:
      raise PlacementError(f"{name} must be None or an int in 1..devices={devices}, "
                           f"got {value!r}.")
  best: tuple[Placement, int] | None = None
  for i, (graph, microbatches) in enumerate(candidates):
    problem = _problem(devices, microbatches, hardware, options)
    found = _search(graph, problem, data_parallel, bound if best is None else best[0].time)
    if found is not None:
      best = (found, i)
  if best is None and bound < math.inf:
    raise PlacementError(f"no placement takes less than bound={bound:.4g} s per batch.")
  if best is None and options.virtual_stages not in (None, 1):
    raise PlacementError(
        f"no interleaved placement with virtual_stages={options.virtual_stages} fits: it needs "
        f"2 or more stages, microbatches per replica a multiple of the stage count, stages x "
        f"virtual_stages blocks at least, and the memory; use virtual_stages=None to let the "
        f"plain schedule stand where interleaving cannot.")
  if best is None:
    graph = candidates[0][0]
    need = sum(min(c.params * t for t, c in layer.widths.items()) for layer in graph.layers)
    need /= devices
    raise PlacementError(
        f"no placement of the {len(graph.layers)} layers on {devices} devices"
        f"{'' if data_parallel is None else f' with data_parallel={data_parallel}'}"
        f"{'' if stages is None else f' in {stages} stages'} fits "
        f"memory_limit={problem.memory:.4g} bytes per device (parameters alone need at least "
        f"{need:.4g} bytes per device when spread over all devices); raise the memory "
        "limit, allow recompute or ZeRO, or add devices.")
  return best


def _search(graph: LayerGraph, problem: _Problem, data_parallel: int | None,
            bound: float) -> Placement | None:
  """The fastest placement under `bound` seconds per batch, if any: the DP's
  (plain 1F1B) and, where the options allow it, an interleaved one's."""
  costs = _StageCosts(graph, problem)
  v = problem.virtual_stages
  best = None if v not in (None, 1) else _search_plain(graph, costs, data_parallel, bound)
  if v != 1:
    found = _search_interleaved(costs, data_parallel, bound if best is None else best.time,
                                (2, 4, 8) if v is None else (v,))
    best = found or best
  return best


def _search_plain(graph: LayerGraph, costs: _StageCosts, data_parallel: int | None,
                  bound: float) -> Placement | None:
  """The DP's fastest plain-1F1B placement under `bound`, if any."""
  problem = costs.problem
  downs = _downsets(graph)
  best: Placement | None = None
  # ZeRO 1 costs what ZeRO 0 does (one all-reduce per batch) in less memory:
  # with both allowed only ZeRO 1 is searched, and its plan is reported as
  # ZeRO 0 when it fits unsharded too.
  zero1_for_zero0 = 0 in problem.zero and 1 in problem.zero
  # Most promising first (by lower bound): a good plan early prunes the rest.
  tries = sorted((costs.lower_bound(d, z), -d, z) for d in range(1, problem.devices + 1)
                 for z in problem.zero
                 if not problem.microbatches % d and data_parallel in (None, d)
                 and not (z and d == 1 and 0 in problem.zero)  # d = 1: nothing to shard
                 and not (z == 0 and d > 1 and zero1_for_zero0))
  # A tight bound prunes hard: with none given, plans are first sought under
  # a guess a little above the most promising floor, raised until some plan
  # beats it. A round that finds one is exact, as every try ran under the
  # guess or the best.
  slack = 0.25 if bound == math.inf else math.inf
  while tries:
    least = tries[0][0]
    limit = min(bound, least * (1 + slack)) if 0 < least < math.inf else bound
    for floor, d, z in tries:
      if floor >= (limit if best is None else best.time):
        break
      plan = _best_at(graph, costs, downs, -d, z, limit if best is None else best.time)
      best = plan or best
    if best is not None or limit >= bound:
      break
    slack = slack * 2 if slack < 2 else math.inf
  if best is not None and best.zero == 1 and zero1_for_zero0:
    best = _unsharded(costs, best) or best
  return best


def chunks(costs: _StageCosts, count: int) -> list[int] | None:
  """The graph cut into `count` chunks (layer bitmasks, in order) holding
  equally many of its most frequent layer kind (the repeated block), or
  where they do not divide, one fewer in the chunks nearest the ends (which
  also hold the embedding and the head, as Megatron-DeepSpeed and Llama 3
  split 70 and 126 layers); other layers join the chunk of the block before
  them (the first chunk before any). None where there are fewer blocks than
  chunks or some edge skips a chunk, which a pipeline of chunks cannot
  carry."""
  order = costs.graph.order()
  templates: dict[tuple, int] = {}  # layers priced alike, whatever enters them
  kind = [templates.setdefault(tuple(sorted(layer.widths.items())), len(templates))
          for layer in costs.graph.layers]
  counts: dict[int, int] = {}
  for i in order:
    counts[kind[i]] = counts.get(kind[i], 0) + 1
  block = max(counts, key=lambda k: (counts[k], -k))
  if counts[block] < count:
    return None
  base, extra = divmod(counts[block], count)
  # The `extra` chunks farthest from the ends take one block more.
  inner = sorted(range(count), key=lambda c: (-min(c, count - 1 - c), c))[:extra]
  ends = list(itertools.accumulate(base + (c in inner) for c in range(count)))
  seen, chunk = 0, 0
  chunk_of = [0] * len(order)
  for i in order:
    if kind[i] == block:
      chunk = bisect.bisect_right(ends, seen)
      seen += 1
    chunk_of[i] = chunk
  if any(not 0 <= chunk_of[d] - chunk_of[s] <= 1 for s, d, _ in costs.edges):
    return None
  masks = [0] * count
  for i, c in enumerate(chunk_of):
    masks[c] |= 1 << i
  return masks


def in_flight(stage: int, stages: int, virtual: int, microbatches: int) -> float:
  """Microbatches whose activations stage `stage` (0-based) holds at its
  peak under 1F1B, as a share of the stage's layers: min(S - i, m) plainly;
  interleaved, Megatron-LM's warm-up of (S - i - 1) * 2 + (v - 1) * S
  chunk-microbatches plus the one in its backward, each 1/v of the stage."""
  if virtual == 1:
    return float(min(stages - stage, microbatches))
  held = (stages - stage - 1) * 2 + (virtual - 1) * stages + 1
  return min(microbatches * virtual, held) / virtual


def uniform(costs: _StageCosts, masks: list[int], *, data_parallel: int, stages: int,
            virtual: int, width: int, zero: int, fits: bool = True) -> Placement | None:
  """The placement running chunk c of `masks` (S * v of them, in order) on
  stage c mod S, each stage on `width` devices, replicated `data_parallel`
  ways; per stage the fastest allowed recompute mode that fits in memory
  (with `fits` False: the fastest, fitting or not). None where no mode of
  some stage fits or a stage's layers lack the width."""
  o = costs.problem
  d, S, v, t = data_parallel, stages, virtual, width
  m = o.microbatches // d
  per_pipeline = S * t
  chosen = []
  for s in range(S):
    members = 0
    for k in range(v):
      members |= masks[s + k * S]
    if t not in costs.widths(members):
      return None
    held = in_flight(s, S, v, m)
    options = []
    for mode in o.recompute:
      memory = costs.memory(members, t, mode, held, d, zero)
      if fits and memory > o.memory:
        continue
      time, sync = costs.times(members, t, mode, s * t, d, per_pipeline, zero)
      options.append((time, sync, memory, mode))
    if not options:
      return None
    time, sync, _, mode = min(options)
    chosen.append((members, mode, held, time, sync))
  t_max = max(c[3] for c in chosen)
  total = (m + (S - 1) / v) * t_max + max(c[4] for c in chosen)
  built = tuple(costs.stage(members, t, mode, s * t, held, d, per_pipeline, zero)
                for s, (members, mode, held, _, _) in enumerate(chosen))
  return Placement(d, m, zero, built, per_pipeline * d, total, v)


def _search_interleaved(costs: _StageCosts, data_parallel: int | None, bound: float,
                        virtuals: Sequence[int]) -> Placement | None:
  """The fastest interleaved placement (equal chunks, equal widths) under
  `bound`, if any. Megatron-LM's rule: microbatches per replica a multiple of
  the stage count."""
  o = costs.problem
  best: Placement | None = None
  widths = sorted({t for layer in costs.graph.layers for t in layer.widths
                   if o.widths is None or t in o.widths})
  # No stage does less than its share of the layers' fastest work: a floor
  # on (m + (S - 1) / v) * max T that skips most splits unpriced.
  work = costs.fastest((1 << len(costs.graph.layers)) - 1)
  for v in virtuals:
    for S in range(2, len(costs.graph.layers) // v + 1):
      if o.stages not in (None, S):
        continue
      masks = None
      for d in range(1, o.devices // S + 1):
        if o.microbatches % d or (o.microbatches // d) % S or data_parallel not in (None, d):
          continue
        m = o.microbatches // d
        if (m + (S - 1) / v) * work / S >= (bound if best is None else best.time):
          continue
        masks = masks or chunks(costs, S * v)
        if masks is None:
          break
        for t in widths:
          if d * S * t > o.devices:
            break
          for zero in o.zero:
            if zero and d == 1 and 0 in o.zero:
              continue
            plan = uniform(costs, masks, data_parallel=d, stages=S, virtual=v, width=t,
                           zero=zero)
            if plan is not None and plan.time < (bound if best is None else best.time):
              best = plan
  return best


def _unsharded(costs: _StageCosts, plan: Placement) -> Placement | None:
  """`plan` under ZeRO 0 (the same times), if every stage still fits."""
  stages = []
  for s in plan.stages:
    members = sum(1 << costs.index[name] for name in s.layers)
    memory = costs.memory(members, s.width, s.recompute_mode, s.in_flight, plan.data_parallel, 0)
    if memory > costs.problem.memory:
      return None
    stages.append(dataclasses.replace(s, memory=memory))
  return dataclasses.replace(plan, zero=0, stages=tuple(stages))


def _problem(devices, microbatches, hardware, options: PlacementOptions) -> _Problem:
  for name, value in (("devices", devices), ("microbatches", microbatches)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise PlacementError(f"{name} must be a positive int, got {value!r}.")
  hw = get_hardware(hardware)
  return _Problem(devices, microbatches, memory_limit(options, hw), hw, options.optimizer_state,
                  options.zero, recompute_modes("PlacementOptions", options.recompute),
                  options.widths, options.stages, options.gradient_state, options.overlap,
                  options.virtual_stages, options.overlap_tensor, options.recompute is not None)


__all__ = ["MAX_DOWNSETS", "place", "place_any"]
