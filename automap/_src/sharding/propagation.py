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

from automap._src.ir import factor_rule, rules
from automap._src.ir.graph import Graph
from automap._src.sharding import propagation_kernels as kernels
from automap._src.sharding.mesh import MeshSpec
from automap._src.sharding.state import UNSHARDED, State, concat, tile_count


class _Tables(NamedTuple):
  """A graph's factor rules as arrays, built once per graph.

  Per op: member values mval [O, M] (-1 pads; operands first, then
  results), whether each is a result role [O, M], the factor of each member
  dim mdims [O, M, R] (-2 pads) and its minor factor where the dim is
  compound, mminor [O, M, R] (-1: none), the member dim each factor indexes
  fdim [O, M, F] (-1: none), factor extents msize [O, F], each member's
  elements [O, M], and per propagation round
  the members each factor may update, direction [ROUNDS, O, F], and
  whether each member may offer (sends) and take (takes) tilings,
  [ROUNDS, O, M] (`_rounds`); per value: its padded shape [V, R] and the
  (op, member slot) views of it, as CSR (vptr [V + 1], vop, vslot); the
  ops in the order Shardy meets them, order [O] (`_module_order`).
  """

  mval: np.ndarray
  role: np.ndarray
  mdims: np.ndarray
  mminor: np.ndarray
  fdim: np.ndarray
  msize: np.ndarray
  elements: np.ndarray
  direction: np.ndarray
  sends: np.ndarray
  takes: np.ndarray
  shape: np.ndarray
  vptr: np.ndarray
  vop: np.ndarray
  vslot: np.ndarray
  order: np.ndarray


# Bits of `_Tables.direction`: a factor may update an op's results
# (forward), its operands (backward).
FORWARD, BACKWARD, BOTH = 1, 2, 3
# Shardy's op-priority schedule (`op_priority_propagation.cc`), one round
# each: pass-through ops none of whose operands has another use; all
# pass-through ops; every op's pass-through factors, broadcasts backward
# only; every factor, broadcasts backward only; everything.
ROUNDS = 5
_SINGLE_USE, _PASS_OPS, _PASS_FACTORS, _NO_BROADCAST_FORWARD, _ALL = range(ROUNDS)

# Ops every factor of which passes straight through (Shardy's elementwise
# ops, reshapes, transposes and data-flow edges: control flow's carries and
# a cond's results), and ops that pass their factors forward only (dynamic
# slices; a scan's per-step slice and stacking are dynamic slices and
# updates of the loop's arrays).
_PASS_THROUGH = rules.ELEMENTWISE | {"select_n", "clamp", "reshape", "squeeze",
                                     "expand_dims", "transpose", "scan_carry",
                                     "while_enter", "while_carry", "cond_result"}
_FORWARD_ONLY = frozenset({"dynamic_slice", "dynamic_update_slice", "scan_slice",
                           "scan_stack"})


def _rounds(prim: str, rule: factor_rule.Rule, shapes: list, results: int, factors: int,
            width: int, shared: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """How an op propagates in each round of Shardy's op-priority propagation
  (`op_priority_propagation.cc`): pass-through ops, first only those whose
  operands have no other use (`shared`: one has), then all; then every
  op's pass-through factors (those that neither reduce nor permute);
  then every factor; a broadcast passes its factors backward only until
  the last round. Returns per round the members each factor may update
  [ROUNDS, factors], and which members may offer and take tilings
  [ROUNDS, width] each.

  `shapes`: the op's members' shapes, operands first; the last `results`
  are its results. A broadcast that only inserts unit dims is a reshape in
  the module Shardy reads; an elementwise op's operand with unit dims where
  the result has more is broadcast explicitly there, so it takes part as a
  broadcast's operand: in no pass-through-op round, taking but never
  offering until the last.
  """
  direction = np.zeros((ROUNDS, factors), np.uint8)
  sends = np.ones((ROUNDS, width), bool)
  takes = np.ones((ROUNDS, width), bool)
  n = len(rule.sizes)
  out = shapes[-1] if results else ()
  relabels = prim == "broadcast_in_dim" and [d for d in out if d != 1] == [
      d for d in shapes[0] if d != 1]
  broadcast = prim == "broadcast_in_dim" and not relabels
  if prim in _PASS_THROUGH or relabels:
    direction[_PASS_OPS, :n] = BOTH
  elif prim in _FORWARD_ONLY:
    direction[_PASS_OPS, :n] = FORWARD
  if not shared:
    direction[_SINGLE_USE] = direction[_PASS_OPS]
  permuting = {w.factor for w in rule.windows} | set(rule.moved)
  for f in range(n):
    direction[_PASS_FACTORS, f] = direction[_PASS_OPS, f]
    if not rule.reduction[f] and f not in permuting:
      direction[_PASS_FACTORS, f] |= BACKWARD if broadcast else BOTH
  direction[_NO_BROADCAST_FORWARD, :n] = BACKWARD if broadcast else BOTH
  direction[_ALL, :n] = BOTH
  if prim in rules.ELEMENTWISE or prim in ("select_n", "clamp"):
    for j, shape in enumerate(shapes[:len(shapes) - results]):
      if len(shape) == len(out) and any(a == 1 < b for a, b in zip(shape, out)):
        sends[:_ALL, j] = False
        takes[:_PASS_FACTORS, j] = False
  return direction, sends, takes


# A cache keyed by the graph (immutable, hashed by identity): the search
# builds a Propagator per program many times over.
@functools.lru_cache(maxsize=4)
def _tables(graph: Graph) -> _Tables:
  members, operand_count = [], []
  for o, rule in enumerate(graph.rules):
    # (value, its dims' factors, its member index in the rule, which counts
    # literals too), operands first.
    every = [*zip(graph.operands[o], rule.operands), *zip(graph.results[o], rule.results)]
    m = [(v, tuple(dims), i) for i, (v, dims) in enumerate(every)
         if v >= 0 and dims is not None]
    operand_count.append(sum(i < len(rule.operands) for *_, i in m))
    members.append(m)
  num_ops, num_values = graph.num_ops, graph.num_values
  width = max((len(m) for m in members), default=1) or 1
  rank = max((len(s) for s in graph.shapes), default=1) or 1
  factors = max((len(r.sizes) for r in graph.rules), default=1) or 1
  mval = np.full((num_ops, width), -1, np.int64)
  role = np.zeros((num_ops, width), np.int8)
  mdims = np.full((num_ops, width, rank), -2, np.int32)
  mminor = np.full((num_ops, width, rank), -1, np.int32)
  msize = np.ones((num_ops, factors), np.int64)
  fdim = np.full((num_ops, width, factors), -1, np.int8)
  elements = np.zeros((num_ops, width), np.int64)
  direction = np.zeros((ROUNDS, num_ops, factors), np.uint8)
  sends = np.ones((ROUNDS, num_ops, width), bool)
  takes = np.ones((ROUNDS, num_ops, width), bool)
  views: list[list[tuple[int, int]]] = [[] for _ in range(num_values)]
  # Uses as Shardy counts them: every read, and the function's return.
  uses = np.array([len(u) for u in graph.uses], np.int64)
  np.add.at(uses, [v for v in graph.outputs if v >= 0], 1)
  for o, m in enumerate(members):
    role[o, operand_count[o]:len(m)] = 1
    for j, (v, dims, _) in enumerate(m):
      mval[o, j] = v
      mdims[o, j, :len(dims)] = dims
      for e, f in reversed(list(enumerate(dims))):  # the first dim a factor indexes
        if f >= 0:
          fdim[o, j, f] = e
      elements[o, j] = int(np.prod(graph.shapes[v], dtype=np.int64))
      views[v].append((o, j))
    rule = graph.rules[o]
    slot = {i: j for j, (*_, i) in enumerate(m)}
    for member, e, f in rule.minor:
      if member in slot:
        mminor[o, slot[member], e] = f
        fdim[o, slot[member], f] = e
    msize[o, :len(rule.sizes)] = rule.sizes
    direction[:, o], sends[:, o], takes[:, o] = _rounds(
        graph.prims[o], rule, [graph.shapes[v] for v, *_ in m], len(m) - operand_count[o],
        factors, width, any(uses[v] > 1 for v in graph.operands[o]
                            if v >= 0 and graph.shapes[v]))
  shape = np.ones((num_values, rank), np.int64)
  for v, s in enumerate(graph.shapes):
    shape[v, :len(s)] = s
  vptr = np.zeros(num_values + 1, np.int64)
  vptr[1:] = np.cumsum([len(x) for x in views])
  vop, vslot = _csr_columns(views)
  return _Tables(mval, role, mdims, mminor, fdim, msize, elements, direction, sends, takes, shape,
                 vptr, vop, vslot, _module_order(graph))


def _module_order(graph: Graph) -> np.ndarray:
  """[O] the ops in the order Shardy meets them: XLA hands it the module
  in post order (`HloComputation::MakeInstructionPostOrder`: depth first
  from each op nothing reads, the root's outputs first, operands in
  order), not in the order the program wrote them; a weight gradient's
  reduction thus comes after the backward pass that feeds it."""
  g = graph
  seen = np.zeros(g.num_ops, bool)
  order: list[int] = []

  def visit(root: int) -> None:
    stack = [(root, False)]
    while stack:
      o, expanded = stack.pop()
      if expanded:
        order.append(o)
        continue
      if seen[o]:
        continue
      seen[o] = True
      stack.append((o, True))
      for v in reversed(g.operands[o]):
        if v >= 0 and g.producer[v] >= 0 and not seen[g.producer[v]]:
          stack.append((int(g.producer[v]), False))

  for v in g.outputs:
    if v >= 0 and g.producer[v] >= 0:
      visit(int(g.producer[v]))
  for o in range(g.num_ops):  # ops whose results nothing reads, in program order
    if not seen[o] and not any(g.uses[v] for v in g.results[o] if v >= 0):
      visit(o)
  return np.array(order, np.int64)  # every op: each reaches one nothing reads


def _csr_columns(views: list[list[tuple[int, int]]]) -> tuple[np.ndarray, np.ndarray]:
  flat = [pair for x in views for pair in x]
  return (np.array([o for o, _ in flat], np.int64),
          np.array([j for _, j in flat], np.int64))


class Propagator:
  """Applies actions to a state and propagates them through factor rules.

  Propagation runs in waves (`kernels.spread`): a value newly tiled on an
  axis offers the tiling, through each op's factor rule, to the op's other
  members. An offer is taken where no larger member offers the
  same value another factor on that axis (Shardy's conflict rule), the
  factor's extent and the member's dim divide by the tiles, the member
  is free on that axis and not fixed, and any axes already on that dim nest
  inside the offer's (on a dim a reshape splits or merges, the minor
  factor's axes behind a whole major factor's). Within a wave the first offer to a value wins.

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
    self.mminor = t.mminor
    self.role, self.elements, self.direction = t.role, t.elements, t.direction
    self.sends, self.takes = t.sends, t.takes
    self.shape = t.shape
    self.vptr, self.vop, self.vslot = t.vptr, t.vop, t.vslot
    self.order = t.order
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
                stage: int = ROUNDS - 1) -> np.ndarray:
    """Spreads each (value, axis) in `seeds` through the graph, as far as
    the factors of round `stage` of `_directions` carry it (by default
    every factor, both ways); in place. Returns the values changed [n], in
    the order they changed."""
    by_axis: dict[int, list[int]] = {}
    for v, a in seeds:
      by_axis.setdefault(int(a), []).append(int(v))
    return concat([kernels.spread(
        state, np.unique(np.array(values, np.int64)), a, self.size_row, self.fixed,
        self.shape, self.vptr, self.vop, self.vslot, self.mval, self.role, self.mdims,
        self.mminor, self.fdim, self.msize, self.elements, self.direction[stage], self.sends[stage],
        self.takes[stage], self._offer) for a, values in by_axis.items()])

  def seed_all(self, state: State) -> np.ndarray:
    """Propagates every tiled (value, axis) already in the state as Shardy
    does (`kernels.sweep`: ops in the module's post order, each change
    chased depth first) in the rounds of its op-priority propagation
    (`_rounds`): through pass-through ops (elementwise, reshapes,
    transposes) first, then through every op's pass-through factors, then
    through every factor, a broadcast forward only at the very last.
    Layouts given at several points (arguments and constraints) thus reach
    the values around them before a dot carries one across; a parameter's
    tiling reaches no activation through the broadcast that scales it: the
    batch's tiling does, through the lookup that makes the first
    activation; and a broadcast cotangent (a mean's backward) takes the
    batch's tiling from the backward pass, which the post order puts
    before the weight gradient that would hand it the weight's."""
    return concat([kernels.sweep(
        state, self.order, self.size_row, self.fixed, self.shape, self.vptr, self.vop,
        self.mval, self.role, self.mdims, self.mminor, self.fdim, self.msize, self.elements,
        self.direction[stage], self.sends[stage], self.takes[stage], self._offer)
        for stage in range(ROUNDS)])
