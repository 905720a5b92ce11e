"""A candidate stage's layers summed: the sums its time and memory are priced from.

A stage is a set of layers (a bitmask over the layer graph's indices) at a
tensor-parallel width. `StageSums` indexes the graph once, groups layers
priced alike with inputs as large (a repeated block) into kinds, and keys a
stage's sums by its signature (how many layers of each kind, the bytes on
edges crossing its border, the shared parameters it reads twice or more),
so stages of a repeated block that hold as many blocks are summed once.
`kept` and `rebuilt` are what each recompute mode keeps per microbatch in
flight and runs again in the backward. Seconds, bytes and FLOPs per
microbatch per device.
"""

from __future__ import annotations

from typing import NamedTuple

from automap._src.cluster.placement.problem import Problem
from automap._src.cluster.profile.layer_graph import Layer, LayerGraph


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
  offloaded: float            # named values the "offload" mode sends to host memory
  offloaded_forward: float    # seconds that mode reruns
  layers: int
  bytes_in: float             # on edges entering the stage
  bytes_out: float            # on edges leaving it


def kept(mode: str, activations: float, inputs: float, selective: float, dots: float,
         share: float = 1.0) -> float:
  """Bytes a recompute mode keeps on the device per microbatch in flight:
  every activation ("none"), every layer's input ("full"; "offload", whose
  named values wait in host memory), all but the attention scores
  ("selective"), every layer's input and weight-matmul outputs ("dots");
  applied to a `share` of the layers (every k-th: 1 / k), the rest keep all."""
  mode_keeps = {"none": activations, "full": inputs, "selective": activations - selective,
                "dots": inputs + dots, "offload": inputs}[mode]
  return share * mode_keeps + (1 - share) * activations


def rebuilt(mode: str, forward: float, selective_forward: float, dots_forward: float,
            share: float = 1.0, offloaded_forward: float = 0.0) -> float:
  """Seconds of forward a recompute mode runs again in the backward, on a
  `share` of the layers."""
  return share * {"none": 0.0, "full": forward, "selective": selective_forward,
                  "dots": dots_forward, "offload": offloaded_forward}[mode]


class StageSums:
  """A layer graph indexed for pricing its candidate stages in one problem.

  Args:
    graph: the layer graph.
    problem: the placement problem (cluster, microbatches, options).

  Attributes:
    index: layer name -> its index (its bit in a stage's mask).
    edges: (source index, destination index, bytes per microbatch).
    shared: per group of layers reading one parameter, (mask of the
      layers, width -> bytes per device).
    kind: per layer, its kind (layers priced alike with inputs as large).
    example: kind -> one layer of it.
    inputs: kind -> bytes per microbatch entering one of its layers.
  """

  def __init__(self, graph: LayerGraph, problem: Problem):
    self.graph, self.problem = graph, problem
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
          offloaded=total(lambda c: c.offloaded or 0.0),
          offloaded_forward=total(lambda c: c.offloaded_forward),
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

  def optimizer_bytes(self, params: float, d: int, zero: int) -> float:
    """Bytes per device of optimizer state, sharded from ZeRO stage 1 on."""
    return self.problem.optimizer * params / (self.problem.sharded_over(d, zero) if zero else 1)

  def downsets_inside(self, rest: int, downs: list[int]) -> list[int]:
    """The downsets strictly inside `rest`."""
    if rest not in self._inside:
      self._inside[rest] = [h for h in downs if not h & ~rest and h != rest]
    return self._inside[rest]


def layer_indices(mask: int) -> list[int]:
  return [i for i in range(mask.bit_length()) if mask >> i & 1]


__all__ = ["StageSums", "Totals", "kept", "layer_indices", "rebuilt"]
