"""How an op computes under a layout: the factor each mesh axis tiles.

The result's layout wins; otherwise a reduction factor tiled on the
operands; otherwise none. Reductions compute in their operand's layout, a
gather or scatter takes the partitioning XLA's dry run finds cheapest, and
a compound dim's minor factor is tiled only under its whole major factor.
Functions of a `CostModel` (its graph, mesh, and `transition` for a
lookup's candidate reshards).
"""

from __future__ import annotations

import math

from automap._src.ir import rules
from automap._src.sharding.state import UNSHARDED, State

# Ops XLA's partitioner chooses among several partitionings of by cost.
LOOKUPS = frozenset({"gather", "scatter-add", "scatter_add", "scatter-max", "scatter-min"})


def derive(model, state: State, o: int) -> tuple[list[int], list[bool], list]:
  """How op o computes under `state`.

  Returns, per mesh axis, the factor it tiles (or UNSHARDED) and whether the
  op's partial result is scattered over it; and per operand (None for a
  literal) the dim each axis must tile on entry.
  """
  g, sizes = model.graph, model.mesh.axis_sizes
  rule = g.rules[o]
  operands, results = g.operands[o], g.results[o]
  num_axes = len(sizes)
  factor_of_axis = [UNSHARDED] * num_axes
  scatter = [False] * num_axes
  factor_tiles = [1] * len(rule.sizes)
  windowed = {w.factor for w in rule.windows}
  slicing = bool(windowed) and g.prims[o] in ("slice", "split") and (
      model.tiles(state, operands[0]) > max(model.tiles(state, v) for v in results))
  for a in range(num_axes):
    f, scatter[a] = _axis_factor(model, state, o, a, windowed, slicing)
    if f >= 0 and rule.sizes[f] % (factor_tiles[f] * sizes[a]) == 0:
      factor_of_axis[a] = f
      factor_tiles[f] *= sizes[a]
    else:
      scatter[a] = False
  _keep_tile_order(model, state, o, factor_of_axis, scatter)
  _minor_under_major(model, o, factor_of_axis, scatter)
  wants = []
  if g.prims[o] in LOOKUPS:
    factor_of_axis, scatter = _cheapest_lookup(model, state, o, factor_of_axis, scatter)
  for p, v in enumerate(operands):
    dims = rule.operands[p]
    if v < 0 or dims is None:
      wants.append(None)
      continue
    wants.append([rule.dim_of(p, f) if f >= 0 else UNSHARDED for f in factor_of_axis])
  return factor_of_axis, scatter, wants


def _axis_factor(model, state: State, o: int, a: int, windowed: set[int],
                 slicing: bool) -> tuple[int, bool]:
  """The factor op o would have axis a tile (or UNSHARDED), and whether its
  partial result would be scattered over a, before `derive` checks that the
  factor's size takes the axis: the result's factor, unless it needs the
  operands' reduction instead; else the operands' most common reduction
  factor; else, slicing, a windowed factor of its operand's."""
  g = model.graph
  rule = g.rules[o]
  operands, results = g.operands[o], g.results[o]
  scatter = False
  res_f = UNSHARDED
  for r, v in enumerate(results):
    d = state[v, a] if v >= 0 else -1
    if d >= 0 and rule.results[r][d] >= 0:
      res_f = _factor_on(model, state, o, len(rule.operands) + r, v, a)
      if res_f >= 0:
        break
  op_fs = []
  for p, v in enumerate(operands):
    if v >= 0 and rule.operands[p] is not None:
      d = state[v, a]
      if d >= 0 and rule.operands[p][d] >= 0:
        f = _factor_on(model, state, o, p, v, a)
        if f >= 0:
          op_fs.append(f)
  reductions = [f for f in op_fs if rule.reduction[f]]
  if res_f in rule.moved:
    res_f = _moved_factor(model, state, o, a)
  f = UNSHARDED
  if g.prims[o] in rules.REDUCTIONS:
    # XLA reduces each device's tile as the operand holds it, combines
    # the partial sums over the reduced dims' axes, then reshards the
    # (smaller) result to its own layout: it never reshards the operand
    # to the result's (`SpmdPartitioningVisitor::HandleReduce`).
    res_f, reductions = UNSHARDED, []
    if op_fs:
      f = op_fs[0]
      scatter = bool(rule.reduction[f]) and g.prims[o] not in rules.ARG_REDUCTIONS and any(
          v >= 0 and state[v, a] >= 0 for v in results)
  elif g.prims[o] == "scan_stack":
    # The loop stacks each step's result in the layout the body made
    # it in; the stacked result is resharded after the loop.
    res_f = op_fs[0] if op_fs else UNSHARDED
  if res_f >= 0:
    f = res_f
    if res_f not in op_fs and reductions:
      f, scatter = reductions[0], True
  elif reductions:
    f = max(set(reductions), key=reductions.count)
  elif slicing and windowed.intersection(op_fs):
    # A slice of an operand with more tiles than its result is made in
    # the operand's layout, then resharded (XLA's HandleSlice).
    f = min(windowed.intersection(op_fs))
  return f, scatter


def _keep_tile_order(model, state: State, o: int, factor_of_axis: list[int],
                     scatter: list[bool]) -> None:
  """Scattering a partial sum over axis a into a result dim already tiled
  by a more minor axis b would need the tiles reordered; the partitioner
  computes that dim without b instead (b's operands are gathered). A
  reduction keeps b and all-reduces over a instead, then reshards. In
  place."""
  g = model.graph
  rule = g.rules[o]
  num_axes = len(factor_of_axis)
  for a in range(num_axes):
    if not scatter[a]:
      continue
    for r, v in enumerate(g.results[o]):
      d = state[v, a] if v >= 0 else -1
      if d < 0:
        continue
      for b in range(a + 1, num_axes):
        if g.prims[o] in rules.REDUCTIONS and factor_of_axis[b] == rule.results[r][d]:
          scatter[a] = False
        elif state[v, b] == d and factor_of_axis[b] == rule.results[r][d]:
          factor_of_axis[b] = UNSHARDED


def _minor_under_major(model, o: int, factor_of_axis: list[int], scatter: list[bool]) -> None:
  """A compound dim's minor factor is tiled only under a whole major
  factor, by axes after the major's (mesh order); else not at all. In
  place."""
  rule, sizes = model.graph.rules[o], model.mesh.axis_sizes
  num_axes = len(sizes)
  for member, e, minor in rule.minor:
    major = rule.member_dims(member)[e]
    on_major = [a for a in range(num_axes) if factor_of_axis[a] == major]
    on_minor = [a for a in range(num_axes) if factor_of_axis[a] == minor]
    if on_minor and (math.prod(sizes[a] for a in on_major) != rule.sizes[major]
                     or max(on_major) > min(on_minor)):
      for a in on_minor:
        factor_of_axis[a] = UNSHARDED
        scatter[a] = False

def _factor_on(model, state: State, o: int, member: int, v: int, a: int) -> int:
  """The factor axis a tiles on value v, member `member` of op o: its
  dim's major factor, or on a compound dim (`Rule.minor`) the one the
  axes before a leave it."""
  rule = model.graph.rules[o]
  d = int(state[v, a])
  if not rule.minor:
    return rule.member_dims(member)[d]
  sizes = model.mesh.axis_sizes
  return rule.factor_on(member, d, [sizes[b] for b in range(a) if state[v, b] == d], sizes[a])

def _cheapest_lookup(model, state: State, o: int, factor_of_axis: list,
                     scatter: list) -> tuple[list, list]:
  """A gather or scatter whose members offer an axis two factors (a table
  tiled on the rows it is read from, its indices on the batch) can be
  partitioned either way; XLA dry-runs each way and takes the one of least
  (memory, communication) (`GatherPartitionMethodsOrderedByCost` and its
  scatter twin, by `EvaluatePartitionCost`)."""
  g, sizes = model.graph, model.mesh.axis_sizes
  rule = g.rules[o]
  offered: dict[int, list[int]] = {}  # factor -> the axes members offer it on
  for a in range(len(sizes)):
    for p, v in enumerate(g.operands[o]):
      d = int(state[v, a]) if v >= 0 and rule.operands[p] is not None else -1
      if d >= 0 and rule.operands[p][d] >= 0 and rule.operands[p][d] != factor_of_axis[a]:
        offered.setdefault(rule.operands[p][d], []).append(a)
  choice = (factor_of_axis, scatter)
  best = _lookup_cost(model, state, o, factor_of_axis)
  for f, axes in sorted(offered.items()):  # one method: every axis it can have
    other = [f if a in axes else g_ for a, g_ in enumerate(factor_of_axis)]
    if rule.sizes[f] % math.prod(sizes[a] for a, h in enumerate(other) if h == f):
      continue
    cost = _lookup_cost(model, state, o, other)
    if cost < best:
      best, choice = cost, (other, [s and a not in axes for a, s in enumerate(scatter)])
  return list(choice[0]), list(choice[1])

def _lookup_cost(model, state: State, o: int, factor_of_axis: list) -> tuple[float, float]:
  """XLA's estimate of one partitioning of op o: the most bytes one of the
  instructions it emits makes per device (the partitioned op's result, a
  collective's), then the bytes its collectives make. Operands XLA makes
  anew in any layout (a broadcast zero) cost nothing."""
  g, sizes = model.graph, model.mesh.axis_sizes
  rule = g.rules[o]
  peak = moved = 0.0
  for p, v in enumerate(g.operands[o]):
    dims = rule.operands[p]
    if v < 0 or dims is None or model.free[v]:
      continue
    want = [dims.index(f) if f >= 0 and f in dims else UNSHARDED for f in factor_of_axis]
    comms: list = []
    model.transition(comms, state[v], want, model.local_bytes(state, v), p)
    for _, _, nbytes, *_ in comms:
      moved += nbytes
      peak = max(peak, nbytes)
  for r, v in enumerate(g.results[o]):
    if v < 0:
      continue
    dims = rule.results[r]
    kept = [a for a, f in enumerate(factor_of_axis) if f >= 0 and f in dims]
    local = float(g.nbytes[v]) / math.prod(sizes[a] for a in kept)
    peak = max(peak, local)
    if any(f >= 0 and rule.reduction[f] for f in factor_of_axis):
      moved += local
  return peak, moved


def _moved_factor(model, state: State, o: int, a: int) -> int:
  """The factor axis a tiles while op o computes, its result tiled over a
  by a factor the op keeps whole (`Rule.moved`): XLA moves the dim's tiles
  to the first other dim whose size their product with its own divides
  (`GetFirstTargetDimToMoveShardingTiles`), else gathers it."""
  g, sizes = model.graph, model.mesh.axis_sizes
  rule, v = g.rules[o], g.results[o][0]
  factors = rule.results[0]
  d = int(state[v, a])
  tiles = [math.prod(n for b, n in enumerate(sizes) if state[v, b] == e)
           for e in range(len(factors))]
  for t, f in enumerate(factors):
    if (t != d and f >= 0 and f not in rule.moved
        and g.shapes[v][t] % (tiles[d] * tiles[t]) == 0):
      return f
  return UNSHARDED


__all__ = ["LOOKUPS", "derive"]
