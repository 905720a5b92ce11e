"""Sharding state, actions and incremental propagation.

A state says, for every value and every mesh axis, which dimension of the
value the axis tiles (or -1: the value is whole along that axis). An action
is "tile value v, dimension d, over mesh axis a". Propagation carries an
action across every operation whose factor rule links the tiled dimension to
a dimension of a neighbour, in both directions, until a conflict, an
indivisible size or a fixed value stops it. It touches only what it changes.

Shape letters: V values, A mesh axes.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterable, Sequence

import jax
import numpy as np
from jax.sharding import PartitionSpec

from automap._src.graph import Graph
from automap._src.rules import UNSHARDABLE

UNSHARDED = -1


class MeshError(ValueError):
  """A mesh, mesh axis or PartitionSpec that does not fit the program."""


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  """The mesh shape a plan is for: axis names and sizes, major to minor."""

  axis_names: tuple[str, ...]
  axis_sizes: tuple[int, ...]

  @classmethod
  def of(cls, mesh) -> MeshSpec:
    if isinstance(mesh, MeshSpec):
      return mesh
    if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
      raise MeshError(
          f"mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh((4, 2), "
          f"('data', 'model'))), got {type(mesh).__name__}.")
    names = tuple(str(n) for n in mesh.axis_names)
    sizes = tuple(int(mesh.shape[n]) for n in mesh.axis_names)
    if not names or math.prod(sizes) < 1:
      raise MeshError(f"mesh must have at least one axis, got {mesh}.")
    return cls(names, sizes)

  @property
  def num_axes(self) -> int:
    return len(self.axis_names)

  @property
  def num_devices(self) -> int:
    return math.prod(self.axis_sizes)

  def axis_index(self, name: str, where: str) -> int:
    try:
      return self.axis_names.index(name)
    except ValueError:
      raise MeshError(
          f"{where} names mesh axis {name!r}, but the mesh has axes "
          f"{self.axis_names}. Use one of those names.") from None


State = np.ndarray  # [V, A] int8: the dim each axis tiles, or UNSHARDED.


def empty_state(graph: Graph, mesh: MeshSpec) -> State:
  return np.full((graph.num_values, mesh.num_axes), UNSHARDED, np.int8)


def tile_count(state: State, mesh: MeshSpec, v: int, d: int) -> int:
  """How many tiles dimension d of value v is cut into."""
  return math.prod(s for a, s in enumerate(mesh.axis_sizes) if state[v, a] == d)


def spec_of(state: State, mesh: MeshSpec, v: int, rank: int) -> PartitionSpec:
  """The PartitionSpec of value v (axes of a dim in mesh order)."""
  return spec_from_row(state[v], mesh, rank)


def spec_from_row(row: Sequence[int], mesh: MeshSpec, rank: int) -> PartitionSpec:
  """The PartitionSpec of a per-axis row of tiled dims."""
  entries: list = [None] * rank
  for a, d in enumerate(row):
    if d >= 0:
      name = mesh.axis_names[a]
      entries[d] = name if entries[d] is None else (
          (entries[d] if isinstance(entries[d], tuple) else (entries[d],))
          + (name,))
  while entries and entries[-1] is None:
    entries.pop()
  return PartitionSpec(*entries)


def set_spec(state: State, mesh: MeshSpec, v: int, shape: Sequence[int],
             spec, where: str) -> None:
  """Writes a PartitionSpec into the state, validating it against the value."""
  if spec is None:
    spec = PartitionSpec()
  if not isinstance(spec, PartitionSpec):
    raise MeshError(f"{where}: expected a PartitionSpec, got {spec!r}.")
  if len(spec) > len(shape):
    raise MeshError(
        f"{where}: PartitionSpec {spec} has {len(spec)} entries but the value "
        f"has rank {len(shape)} (shape {tuple(shape)}). Give at most one "
        "entry per dimension.")
  state[v] = UNSHARDED
  for d, entry in enumerate(spec):
    if entry is None:
      continue
    names = entry if isinstance(entry, tuple) else (entry,)
    order = [mesh.axis_index(name, where) for name in names]
    if order != sorted(order):
      raise MeshError(
          f"{where}: dimension {d} of {spec} lists mesh axes {names} out of "
          f"mesh order {mesh.axis_names}; automap tiles a dimension major to "
          "minor in mesh order. Reorder them, or build the mesh with its axes "
          "in the order you want.")
    for name in names:
      a = mesh.axis_index(name, where)
      if state[v, a] != UNSHARDED:
        raise MeshError(f"{where}: mesh axis {name!r} appears twice in {spec}.")
      state[v, a] = d
    tiles = tile_count(state, mesh, v, d)
    if shape[d] % tiles:
      raise MeshError(
          f"{where}: dimension {d} of size {shape[d]} is not divisible by the "
          f"{tiles} tiles of mesh axes {names} in {spec}. Choose axes whose "
          "sizes divide it, or leave that dimension unsharded (None).")


class Propagator:
  """Applies actions to a state and propagates them through factor rules.

  fixed: [V] bool, values whose sharding nothing may change (user pins,
  arguments whose layout was given).
  """

  def __init__(self, graph: Graph, mesh: MeshSpec, fixed: np.ndarray | None = None):
    self.graph, self.mesh = graph, mesh
    self.fixed = (np.zeros(graph.num_values, bool) if fixed is None
                  else fixed.astype(bool))
    self.sizes = mesh.axis_sizes
    # Built once: per op, its (value, dims) members and, per factor, the
    # (value, dim) pairs it indexes; per value, the (op, dims) views of it.
    self.views: list[list[tuple[int, tuple[int, ...]]]] = [
        [] for _ in range(graph.num_values)]
    self.members: list[list[tuple[int, tuple[int, ...]]]] = []
    self.by_factor: list[dict[int, list[tuple[int, int]]]] = []
    for o, rule in enumerate(graph.rules):
      members = [(v, dims) for v, dims in zip(graph.operands[o], rule.operands)
                 if v >= 0 and dims is not None]
      members += [(v, dims) for v, dims in zip(graph.results[o], rule.results)
                  if v >= 0]
      by_factor: dict[int, list[tuple[int, int]]] = {}
      for v, dims in members:
        self.views[v].append((o, dims))
        seen = set()
        for e, f in enumerate(dims):
          if f != UNSHARDABLE and f not in seen:  # a value's first dim per factor
            seen.add(f)
            by_factor.setdefault(f, []).append((v, e))
      self.members.append(members)
      self.by_factor.append(by_factor)

  def can_tile(self, state: State, v: int, d: int, a: int) -> bool:
    if self.fixed[v] or state[v, a] != UNSHARDED or d >= self.graph.rank(v):
      return False
    tiles = tile_count(state, self.mesh, v, d) * self.sizes[a]
    return self.graph.shapes[v][d] % tiles == 0

  def tile(self, state: State, v: int, d: int, a: int,
           propagate: bool = True) -> list[int]:
    """Tiles dim d of value v over axis a; returns the values changed."""
    if not self.can_tile(state, v, d, a):
      return []
    state[v, a] = d
    if not propagate:
      return [v]
    return [v] + self.propagate(state, [(v, a)])

  def propagate(self, state: State, seeds: Iterable[tuple[int, int]]) -> list[int]:
    """Spreads each (value, axis) in `seeds` through the graph; in place."""
    changed: list[int] = []
    work = deque(seeds)
    sizes, shapes, rules, fixed = self.sizes, self.graph.shapes, self.graph.rules, self.fixed
    axes = range(len(sizes))
    at = state.item
    while work:
      v, a = work.popleft()
      d = at(v, a)
      if d < 0:
        continue
      on_d = [b for b in axes if at(v, b) == d]
      tiles = math.prod(sizes[b] for b in on_d)
      for o, dims in self.views[v]:
        f = dims[d]
        if f == UNSHARDABLE or rules[o].sizes[f] % tiles:
          continue
        # The axis may tile only one factor of an op.
        if any(at(u, a) >= 0 and udims[at(u, a)] != f for u, udims in self.members[o]):
          continue
        for u, e in self.by_factor[o][f]:
          if u == v or at(u, a) != UNSHARDED or fixed[u] or shapes[u][e] % tiles:
            continue
          if all(b in on_d for b in axes if at(u, b) == e):
            state[u, a] = e
            changed.append(u)
            work.append((u, a))
    return changed

  def seed_all(self, state: State) -> list[int]:
    """Propagates every tiled (value, axis) already in the state."""
    vs, axes = np.nonzero(state >= 0)
    return self.propagate(state, zip(vs.tolist(), axes.tolist()))
