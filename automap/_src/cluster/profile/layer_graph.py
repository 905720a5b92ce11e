"""The cluster planner's input: layer graphs with per-layer costs.

A `LayerGraph` is what placement reads (layers, each priced at every
tensor-parallel width it supports, and the bytes on edges between them);
what placement returns, a `Placement` of pipeline stages, is in
`placement/placed.py`. Units: seconds, bytes (per device).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from automap._src.cluster.errors import PlacementError


@dataclasses.dataclass(frozen=True)
class LayerCost:
  """One layer at one tensor-parallel width, per microbatch and per device.

  Attributes:
    forward: seconds of the forward pass, tensor-parallel collectives included.
    backward: seconds of the backward pass, tensor-parallel collectives included.
    params: bytes of parameters the device holds (gradients are as large).
    activations: bytes stashed for the backward pass.
    collectives: seconds of forward + backward spent in tensor-parallel
      collectives (already inside forward/backward; kept for the breakdown).
    flops: FLOPs of forward + backward (the model's, no recompute): what
      achieved FLOP/s and MFU count.
    selective: bytes of `activations` that selective recompute drops and
      rebuilds in the backward pass (the attention scores, their softmax and
      what lies between the two batched contractions of attention).
    selective_forward: seconds of forward it takes to rebuild them.
    dots: bytes of weight-matmul outputs (dot_generals without batch
      dimensions) the backward needs, directly or to rebuild what it reads:
      what JAX's `checkpoint_dots_with_no_batch_dims` policy keeps besides the
      layer's input (MaxText's remat_policy "minimal"). None where the layer
      was not traced: the "dots" recompute mode is then not priced.
    dots_forward: seconds of forward that policy reruns in the backward.
    largest_param: bytes of the layer's largest parameter array on the
      device: what ZeRO stage 3 gathers at a time (0: not known, the whole
      layer's `params`).
    comm_bytes: bytes of the results of its tensor-parallel collectives, per
      device, forward + backward (what a compiled program's collectives
      return; 0: not known).
    offloaded: bytes the "offload" recompute mode moves to host memory in
      the forward and back for the backward: the values named by
      `checkpoint_name` with a name `ClusterConfig.offload_activations`
      lists that the backward reads, directly or to rebuild what it reads
      (`jax.checkpoint_policies.save_and_offload_only_these_names`). None:
      no names were given; that mode is then not priced.
    offloaded_forward: seconds of forward that policy reruns in the backward.
  """

  forward: float
  backward: float
  params: float
  activations: float
  collectives: float = 0.0
  flops: float = 0.0
  selective: float = 0.0
  selective_forward: float = 0.0
  dots: float | None = None
  dots_forward: float = 0.0
  largest_param: float = 0.0
  comm_bytes: float = 0.0
  offloaded: float | None = None
  offloaded_forward: float = 0.0

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.name in ("dots", "offloaded") and value is None:
        continue
      if (isinstance(value, bool) or not isinstance(value, (int, float))
          or not math.isfinite(value) or value < 0):
        raise PlacementError(
            f"LayerCost.{field.name} must be a finite number >= 0 (seconds, bytes or "
            f"FLOPs), got {value!r}.")
    if self.selective > self.activations:
      raise PlacementError(
          f"LayerCost.selective ({self.selective!r} bytes) must not exceed activations "
          f"({self.activations!r} bytes): it is the part of them selective recompute drops.")
    if self.largest_param > self.params:
      raise PlacementError(
          f"LayerCost.largest_param ({self.largest_param!r} bytes) must not exceed params "
          f"({self.params!r} bytes): it is one of the layer's parameter arrays.")


@dataclasses.dataclass(frozen=True)
class Layer:
  """A node of the layer graph: its cost at each tensor-parallel width.

  Attributes:
    name: unique in its graph.
    widths: tensor-parallel width -> the layer's `LayerCost` at it.
    structure: a digest of the ops the layer computes (their kinds, shapes
      and wiring, `layers.structures`): layers with equal structure are
      copies of one block, however their costs differ (the last block of a
      stack feeds the final norm, a searched plan may lay one out apart).
      None: not known (a hand-built graph); the block is then found by costs.
  """

  name: str
  widths: Mapping[int, LayerCost]
  structure: str | None = None

  @classmethod
  def of(cls, name: str, forward: float, backward: float, params: float, activations: float,
         tensor_parallel: Mapping[int, LayerCost] | None = None) -> Layer:
    """A layer from its width-1 costs, plus optional costs at other widths."""
    widths = {1: LayerCost(forward, backward, params, activations)}
    widths.update(tensor_parallel or {})
    return cls(name, widths)

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise PlacementError(f"Layer.name must be a non-empty string, got {self.name!r}.")
    if not self.widths or any(
        not isinstance(t, int) or isinstance(t, bool) or t < 1 for t in self.widths):
      raise PlacementError(
          f"Layer {self.name!r}: widths must map tensor-parallel widths (int >= 1) to "
          f"LayerCost, got keys {list(self.widths)}.")
    for t, cost in self.widths.items():
      if not isinstance(cost, LayerCost):
        raise PlacementError(
            f"Layer {self.name!r}: widths[{t}] must be a LayerCost, got {type(cost).__name__}.")
    if self.structure is not None and not isinstance(self.structure, str):
      raise PlacementError(
          f"Layer {self.name!r}: structure must be a string (a digest of the layer's ops) "
          f"or None, got {type(self.structure).__name__}.")


@dataclasses.dataclass(frozen=True)
class Shared:
  """Parameters several layers read (a tied embedding: the token lookup and
  the output head). Each layer's `params` counts them; a stage holding k of
  the layers holds them once, k - 1 times fewer.

  Attributes:
    layers: the names of the layers reading them.
    params: tensor-parallel width -> their bytes per device.
  """

  layers: tuple[str, ...]
  params: Mapping[int, float]


@dataclasses.dataclass(frozen=True)
class LayerGraph:
  """Layers in any order and edges (src, dst, bytes per microbatch) between them.

  An edge's bytes cross between stages forward (activations) and backward
  (their gradients) when its ends sit in different stages; they are also what a
  recomputing stage keeps per in-flight microbatch.

  Attributes:
    layers: the `Layer`s, names unique.
    edges: (source layer name, destination layer name, bytes per microbatch).
    shared: parameters several layers read (`Shared`).

  Raises:
    PlacementError: no layers, repeated names, an edge between unknown or
      equal layers or with negative bytes, a shared group of fewer than two
      known layers, or edges forming a cycle.
  """

  layers: tuple[Layer, ...]
  edges: tuple[tuple[str, str, float], ...] = ()
  shared: tuple[Shared, ...] = ()

  @classmethod
  def chain(cls, layers: Sequence[Layer], edge_bytes: float | Sequence[float] = 0.0) -> LayerGraph:
    """Layers in sequence; `edge_bytes` per link (one number for all, or one each)."""
    layers = tuple(layers)
    links = len(layers) - 1
    sizes = [edge_bytes] * links if isinstance(edge_bytes, (int, float)) else list(edge_bytes)
    if len(sizes) != links:
      raise PlacementError(
          f"edge_bytes must be one number or {links} numbers (one per link), got {len(sizes)}.")
    return cls(layers, tuple((a.name, b.name, float(s))
                             for a, b, s in zip(layers, layers[1:], sizes)))

  def repeat(self, name: str, times: int) -> LayerGraph:
    """The graph with layer `name` replaced by `times` copies in a chain
    ("name", "name*2", ...): a model profiled with few blocks standing for a
    deep one. Edges into the layer enter the first copy, edges out leave the
    last, and consecutive copies pass what enters the original."""
    names = [layer.name for layer in self.layers]
    if name not in names:
      raise PlacementError(f"repeat: no layer {name!r}; layers are {names}.")
    if isinstance(times, bool) or not isinstance(times, int) or times < 1:
      raise PlacementError(f"repeat: times must be a positive int, got {times!r}.")
    copies = [name] + [f"{name}*{i}" for i in range(2, times + 1)]
    i = names.index(name)
    template = self.layers[i]
    layers = (self.layers[:i] + tuple(dataclasses.replace(template, name=c) for c in copies)
              + self.layers[i + 1:])
    handed = sum(b for _, d, b in self.edges if d == name)
    edges = [(s, d if d != name else copies[0], b) if s != name else (copies[-1], d, b)
             for s, d, b in self.edges]
    edges += [(a, b, handed) for a, b in zip(copies, copies[1:])]
    return LayerGraph(layers, tuple(edges), self.shared)

  def __post_init__(self):
    if not self.layers:
      raise PlacementError("LayerGraph needs at least one layer.")
    names = [layer.name for layer in self.layers]
    if len(set(names)) != len(names):
      dup = sorted({n for n in names if names.count(n) > 1})
      raise PlacementError(f"LayerGraph: layer names must be unique, repeated: {dup}.")
    for edge in self.edges:
      if len(edge) != 3 or edge[0] not in names or edge[1] not in names or edge[0] == edge[1]:
        raise PlacementError(
            f"LayerGraph edge {edge!r} must be (src, dst, bytes) between two different "
            f"known layers; layers are {names}.")
      if not isinstance(edge[2], (int, float)) or not edge[2] >= 0:
        raise PlacementError(f"LayerGraph edge {edge!r}: bytes must be a number >= 0.")
    for group in self.shared:
      if len(set(group.layers)) < 2 or any(n not in names for n in group.layers):
        raise PlacementError(
            f"LayerGraph shared parameters {group.layers!r} must name two or more known "
            f"layers; layers are {names}.")
    self.order()  # rejects cycles

  def least_params(self) -> float:
    """Parameter bytes over all devices, each layer at its cheapest width
    (t x bytes per device), shared parameters once: a floor on any plan's."""
    total = sum(min(t * c.params for t, c in layer.widths.items()) for layer in self.layers)
    return total - sum((len(g.layers) - 1) * max((t * b for t, b in g.params.items()), default=0.0)
                       for g in self.shared)

  def order(self) -> list[int]:
    """Layer indices in a topological order (Kahn, stable in the given order)."""
    index = {layer.name: i for i, layer in enumerate(self.layers)}
    preds = [set() for _ in self.layers]
    for src, dst, _ in self.edges:
      preds[index[dst]].add(index[src])
    done: list[int] = []
    placed: set[int] = set()
    while len(done) < len(self.layers):
      ready = [i for i in range(len(self.layers)) if i not in placed and preds[i] <= placed]
      if not ready:
        cycle = [self.layers[i].name for i in range(len(self.layers)) if i not in placed]
        raise PlacementError(f"LayerGraph edges form a cycle among {cycle}.")
      done.extend(ready)
      placed.update(ready)
    return done


RECOMPUTE_MODES = ("none", "full", "selective", "dots", "offload")


__all__ = ["RECOMPUTE_MODES", "Layer", "LayerCost", "LayerGraph", "Shared"]
