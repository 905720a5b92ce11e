"""Incremental propagation of tilings through the graph's factor rules.

An action is "tile value v, dimension d, over mesh axis a". Propagation
carries it across every operation whose factor rule links the tiled
dimension to a dimension of a neighbour, in both directions, until a
conflict, an indivisible size or a fixed value stops it. It touches only
what it changes.

Shape letters: V values, A mesh axes.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from automap._src.ir import rules
from automap._src.ir.graph import Graph
from automap._src.sharding import kernels
from automap._src.sharding.mesh import MeshSpec
from automap._src.sharding.state import UNSHARDED, State, concat, tile_count


class _Tables(NamedTuple):
  """A graph's factor rules as arrays, built once per graph.

  Per op: member values mval [O, M] (-1 pads), the factor of each member dim
  mdims [O, M, R] (-2 pads), the member dim each factor indexes fdim
  [O, M, F] (-1: none), factor extents msize [O, F]; per value: its
  padded shape [V, R] and the (op, member slot) views of it, as CSR
  (vptr [V + 1], vop, vslot); the views of elementwise ops alone, as CSR
  (eptr, eop, eslot).
  """

  mval: np.ndarray
  mdims: np.ndarray
  fdim: np.ndarray
  msize: np.ndarray
  shape: np.ndarray
  vptr: np.ndarray
  vop: np.ndarray
  vslot: np.ndarray
  eptr: np.ndarray
  eop: np.ndarray
  eslot: np.ndarray


# A cache keyed by the graph (immutable, hashed by identity): the search
# builds a Propagator per program many times over.
@functools.lru_cache(maxsize=4)
def _tables(graph: Graph) -> _Tables:
  members = []
  for o, rule in enumerate(graph.rules):
    m = [(v, tuple(dims)) for v, dims in zip(graph.operands[o], rule.operands)
         if v >= 0 and dims is not None]
    m += [(v, tuple(dims)) for v, dims in zip(graph.results[o], rule.results) if v >= 0]
    members.append(m)
  num_ops, num_values = graph.num_ops, graph.num_values
  width = max((len(m) for m in members), default=1) or 1
  rank = max((len(s) for s in graph.shapes), default=1) or 1
  factors = max((len(r.sizes) for r in graph.rules), default=1) or 1
  mval = np.full((num_ops, width), -1, np.int64)
  mdims = np.full((num_ops, width, rank), -2, np.int32)
  msize = np.ones((num_ops, factors), np.int64)
  fdim = np.full((num_ops, width, factors), -1, np.int8)
  views: list[list[tuple[int, int]]] = [[] for _ in range(num_values)]
  for o, m in enumerate(members):
    for j, (v, dims) in enumerate(m):
      mval[o, j] = v
      mdims[o, j, :len(dims)] = dims
      for e, f in reversed(list(enumerate(dims))):  # the first dim a factor indexes
        if f >= 0:
          fdim[o, j, f] = e
      views[v].append((o, j))
    sizes = graph.rules[o].sizes
    msize[o, :len(sizes)] = sizes
  shape = np.ones((num_values, rank), np.int64)
  for v, s in enumerate(graph.shapes):
    shape[v, :len(s)] = s
  vptr = np.zeros(num_values + 1, np.int64)
  vptr[1:] = np.cumsum([len(x) for x in views])
  vop, vslot = _csr_columns(views)
  elementwise = [[(o, j) for o, j in x if graph.prims[o] in rules.ELEMENTWISE]
                 for x in views]
  eptr = np.zeros(num_values + 1, np.int64)
  eptr[1:] = np.cumsum([len(x) for x in elementwise])
  eop, eslot = _csr_columns(elementwise)
  return _Tables(mval, mdims, fdim, msize, shape, vptr, vop, vslot, eptr, eop, eslot)


def _csr_columns(views: list[list[tuple[int, int]]]) -> tuple[np.ndarray, np.ndarray]:
  flat = [pair for x in views for pair in x]
  return (np.array([o for o, _ in flat], np.int64),
          np.array([j for _, j in flat], np.int64))


class Propagator:
  """Applies actions to a state and propagates them through factor rules.

  Propagation runs in waves (`kernels.spread`): a value newly tiled on an
  axis offers the tiling, through each op's factor rule, to the op's other
  members. An offer is taken where the op has no other factor on that axis,
  the factor's extent and the member's dim divide by the tiles, the member
  is free on that axis and not fixed, and any axes already on that dim nest
  inside the offer's. Within a wave the first offer to a value wins.

  fixed: [V] bool, values whose sharding nothing may change (user pins,
  arguments whose layout was given).
  """

  def __init__(self, graph: Graph, mesh: MeshSpec, fixed: np.ndarray | None = None):
    self.graph, self.mesh = graph, mesh
    self.fixed = (np.zeros(graph.num_values, bool) if fixed is None
                  else fixed.astype(bool))
    self.sizes = mesh.axis_sizes
    self.size_row = np.array(mesh.axis_sizes, np.int64)
    t = _tables(graph)
    self.mval, self.mdims, self.fdim, self.msize = t.mval, t.mdims, t.fdim, t.msize
    self.shape = t.shape
    self.vptr, self.vop, self.vslot = t.vptr, t.vop, t.vslot
    self._elementwise = (t.eptr, t.eop, t.eslot)
    self._offer = np.full(graph.num_values, -1, np.int64)  # `kernels.spread`'s scratch

  def can_tile(self, state: State, v: int, d: int, a: int) -> bool:
    if (self.fixed[v] or state[v, a] != UNSHARDED or d >= self.graph.rank(v)
        or self.sizes[a] == 1):
      return False
    tiles = tile_count(state, self.mesh, v, d) * self.sizes[a]
    return self.graph.shapes[v][d] % tiles == 0

  def tile(self, state: State, v: int, d: int, a: int,
           propagate: bool = True) -> np.ndarray:
    """Tiles dim d of value v over axis a; returns the values changed [n]
    (none when the tiling is not legal)."""
    if not self.can_tile(state, v, d, a):
      return np.zeros(0, np.int64)
    state[v, a] = d
    if not propagate:
      return np.array([v], np.int64)
    return concat([[v], self.propagate(state, [(v, a)])])

  def propagate(self, state: State, seeds: Iterable[tuple[int, int]],
                elementwise_only: bool = False) -> np.ndarray:
    """Spreads each (value, axis) in `seeds` through the graph (through its
    elementwise ops only, if asked); in place. Returns the values changed
    [n], in the order they changed."""
    by_axis: dict[int, list[int]] = {}
    for v, a in seeds:
      by_axis.setdefault(int(a), []).append(int(v))
    vptr, vop, vslot = self._elementwise if elementwise_only else (
        self.vptr, self.vop, self.vslot)
    return concat([kernels.spread(
        state, np.unique(np.array(values, np.int64)), a, self.size_row, self.fixed,
        self.shape, vptr, vop, vslot, self.mval, self.mdims, self.fdim,
        self.msize, self._offer) for a, values in by_axis.items()])

  def seed_all(self, state: State) -> np.ndarray:
    """Propagates every tiled (value, axis) already in the state: through
    elementwise ops first, then through every op, as Shardy's op-priority
    propagation does. Layouts given at several points (arguments and
    constraints) thus reach the values around them before a dot carries
    one across: a constrained activation's batch tiling reaches the
    normalised input of a projection before the weight's contracting
    dimension is offered to it."""
    vs, axes = np.nonzero(state >= 0)
    first = self.propagate(state, zip(vs.tolist(), axes.tolist()), elementwise_only=True)
    vs, axes = np.nonzero(state >= 0)
    return concat([first, self.propagate(state, zip(vs.tolist(), axes.tolist()))])
