"""A deep scanned stack profiled through a shallow twin.

A scanned stack's layers run one body: each computes, stashes and hands on
what the next does, at any depth. Only its ends differ in what they touch:
the first reads what comes before the stack, the last feeds what comes
after. Tracing, building, searching and pricing all L layers of it costs
time linear in L (seconds per dozen layers), where the layer costs need
three kinds of layer.

`Twin` profiles the same loss with the stack running its first `FRONT`
layers and its last `BACK` (`stacks.Stacks.shallow`: each layer under its
own name, the carry handed from one kept layer to the next), then writes
that profile out to the whole stack (`graph`, `specs`):

- the kept layers at either end are the twin's own: a layer's role near an
  end shows in its costs (the layer before the last starts the sums of
  what every layer adds to a shared weight's or input's gradient);
- every other layer is a copy of the twin's layer `FRONT - 2`, which has
  the roles of its neighbours' neighbours as far from it as those of a
  layer deep in the stack; the twin is kept only where its next layer,
  which stands as far from the end, costs the same (else the stack has
  roles this module does not see, and is profiled in full);
- the carry a layer hands the next is the twin's between layers of the
  same roles (`FRONT - 2` to `FRONT - 1` between two deep ones);
- what a layer outside the stack hands each layer of it (a bias, a mask)
  or reads from each, and parameters it shares with them, is the twin's
  for the layer standing for it.

A loss that needs the stack whole (a stacked leaf read outside its scan, a
scan stacking per-layer outputs), stacks of several lengths or two stacks
under one name, a twin whose search cannot meet the scaled memory limit,
or a layer graph these rules do not write out (a reversed scan hands its
carry from the last layer down) is profiled in full.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from automap._src.cluster.profile.layer_graph import LayerGraph, Shared
from automap._src.ir.stacks import Stacks
from automap._src.ir.trace import path_str

# Layers the twin runs from the stack's start and its end. Layer
# DEEP = FRONT - 2 stands for every layer not kept; FRONT - 1 checks it.
FRONT, BACK = 4, 2
DEEP = FRONT - 2

_INDEXED = re.compile(r"^(.*_)(\d+)$")


@dataclasses.dataclass(frozen=True)
class Twin:
  """A loss's single stack of `length` layers run as its `kept` layers.

  Attributes:
    stacks: the stacks running the kept layers only.
    length: the stack's layers.
    stacked: the user's parameters (stacked, abstract).
  """

  stacks: Stacks
  length: int
  stacked: Any

  @classmethod
  def of(cls, stacks: Stacks | None, params: Any) -> Twin | None:
    """The twin of a loss's stacks (`params`: the user's, stacked): None
    where it has none, stacks of several lengths, or too few layers for a
    twin to save any."""
    if stacks is None:
      return None
    lengths = {n for n in stacks.lengths if n}
    if len(lengths) != 1 or (length := lengths.pop()) <= FRONT + BACK:
      return None
    return cls(stacks.shallow((*range(FRONT), *range(length - BACK, length))), length, params)

  @property
  def kept(self) -> tuple[int, ...]:
    return self.stacks.kept

  @property
  def params(self) -> Any:
    """The twin loss's parameters: each stacked leaf a tuple of its kept layers."""
    return self.stacks.split(self.stacked)

  def stands_for(self, j: int) -> int:
    """The kept layer that stands for layer j of the stack."""
    return j if j < FRONT or j >= self.length - BACK else DEEP

  def handed_as(self, j: int) -> tuple[int, int]:
    """The kept layers whose hand-off stands for layer j's to layer j + 1."""
    if j + 1 < FRONT:
      return j, j + 1
    if j + 1 >= self.length - BACK:
      return self.kept[self.kept.index(j + 1) - 1], j + 1
    return DEEP, DEEP + 1

  def multiplicity(self) -> np.ndarray:
    """Per flat leaf of `params`, the layers of the whole stack it stands
    for (1 for a leaf outside the stack)."""
    counts = {i: 0 for i in self.kept}
    for j in range(self.length):
      counts[self.stands_for(j)] += 1
    return np.array([c for n in self.stacks.lengths
                     for c in ([counts[i] for i in self.kept] if n else [1])], float)

  def share(self) -> float:
    """The twin's share of the parameters' bytes: what a memory limit for
    the whole step leaves the twin."""
    leaves = self.stacks.treedef.flatten_up_to(self.stacked)
    whole = held = 0.0
    for x, n in zip(leaves, self.stacks.lengths):
      nbytes = math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize
      whole += nbytes
      held += nbytes * len(self.kept) / n if n else nbytes
    return held / whole if whole else 1.0

  def graph(self, twin: LayerGraph) -> LayerGraph | None:
    """The whole stack's layer graph from the twin's (`twin`); None where
    the twin's graph is not one the rules of this module write out."""
    kept = {i: k for k, i in enumerate(self.kept)}
    stack: dict[str, tuple[str, int]] = {}  # twin layer name -> (stem, layer index)
    stems = {}
    for layer in twin.layers:
      m = _INDEXED.match(layer.name)
      if m and int(m.group(2)) in kept:
        stems.setdefault(m.group(1), set()).add(int(m.group(2)))
        stack[layer.name] = (m.group(1), int(m.group(2)))
    stems = [s for s, found in stems.items() if found == set(kept)]
    if len(stems) != 1:
      return None
    stem = stems[0]
    stack = {name: i for name, (s, i) in stack.items() if s == stem}
    if any(re.match(rf"{re.escape(stem)}\d+#", layer.name) for layer in twin.layers):
      return None  # a second stack under the same name: its layers would be lost

    def name(j: int) -> str:
      return f"{stem}{j}"

    by_name = {layer.name: layer for layer in twin.layers}
    deep, beside = by_name[name(DEEP)], by_name[name(DEEP + 1)]
    if deep.structure != beside.structure or any(
        not _close(deep.widths[t], beside.widths[t]) for t in deep.widths):
      return None  # the deep layers differ: roles the twin does not see
    layers = []
    for layer in twin.layers:
      if layer.name not in stack:
        layers.append(layer)
      elif stack[layer.name] == 0:  # the stack, in place of its first layer
        layers += [dataclasses.replace(by_name[name(self.stands_for(j))], name=name(j))
                   for j in range(self.length)]
    # Edges, by the kinds of layer at their ends.
    handed: dict[tuple[int, int], float] = {}  # (from, to) stack layers
    outside: dict[tuple[str, str], float] = {}
    into: dict[tuple[str, int], float] = {}
    out_of: dict[tuple[int, str], float] = {}
    for a, b, nbytes in twin.edges:
      if a in stack and b in stack:
        if kept[stack[b]] != kept[stack[a]] + 1:
          return None  # a layer reaching past its successor: not a scan's carry
        handed[(stack[a], stack[b])] = nbytes
      elif a in stack:
        out_of[(stack[a], b)] = nbytes
      elif b in stack:
        into[(a, stack[b])] = nbytes
      else:
        outside[(a, b)] = nbytes
    edges = list(outside.items())
    for j in range(self.length - 1):
      if self.handed_as(j) in handed:
        edges.append(((name(j), name(j + 1)), handed[self.handed_as(j)]))
    for j in range(self.length):
      s = self.stands_for(j)
      edges += [((src, name(j)), n) for (src, i), n in into.items() if i == s]
      edges += [((name(j), dst), n) for (i, dst), n in out_of.items() if i == s]
    shared = []
    for group in twin.shared:
      inside = {stack[n] for n in group.layers if n in stack}
      if inside and inside != set(kept):
        return None  # parameters some layers of a scan read and others not
      members = [n for n in group.layers if n not in stack]
      if inside:
        members += [name(j) for j in range(self.length)]
      shared.append(Shared(tuple(members), dict(group.params)))
    order = {layer.name: i for i, layer in enumerate(layers)}
    edges.sort(key=lambda e: (order[e[0][0]], order[e[0][1]]))
    return LayerGraph(tuple(layers), tuple((a, b, n) for (a, b), n in edges), tuple(shared))

  def specs(self, twin: Mapping[str, PartitionSpec]) -> dict[str, PartitionSpec]:
    """The whole step's argument specs from the twin's (`twin`, keyed by
    argument path as `Profile.specs`): each layer of a stacked leaf laid
    out as the layer standing for it."""
    paths, _ = jax.tree_util.tree_flatten_with_path((self.stacked,))
    out = {}
    stacked = {path_str(p): n for (p, _), n in zip(paths, self.stacks.lengths) if n}
    for key, spec in twin.items():
      base, _, k = key.rpartition("/")
      if base in stacked and k.isdigit():
        continue
      out[key] = spec
    for base in stacked:
      for j in range(self.length):
        out[f"{base}/{j}"] = twin[f"{base}/{self.kept.index(self.stands_for(j))}"]
    return out


def _close(a, b) -> bool:
  """Two `LayerCost`s equal but for float rounding."""
  return all(x == y if x is None or y is None else math.isclose(x, y, rel_tol=1e-9)
             for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b)))


__all__ = ["BACK", "FRONT", "Twin"]
