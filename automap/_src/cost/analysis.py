"""Graph analyses the cost model reads: what XLA stores, liveness, dead ops.

Everything here depends on the program's graph alone (and on whether the
compiler's reductions fuse shared producers), not on the mesh or the
layouts: it is computed once per graph and read by every pricing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from automap._src.cost import aliasing
from automap._src.ir import graph as graph_lib
from automap._src.ir import rules
from automap._src.ir.graph import Graph

# Ops XLA fuses into their consumers (loop fusion) and reductions that
# absorb such producers (input fusion): their intermediates need no buffer.
_FUSIBLE = rules.ELEMENTWISE | {
    "broadcast_in_dim", "reshape", "squeeze", "select_n", "clamp", "iota",
    "transpose", "slice", "pad", "concatenate", "convert_element_type"}
_ABSORBING = _FUSIBLE | {"reduce_sum", "reduce_max", "reduce_min",
                         "reduce_and", "reduce_or", "argmax", "argmin"}
# Ops XLA fuses into a loop-fused reader but never duplicates (it deems
# them expensive): fused only into their one reader.
_FUSED_ONCE = frozenset({"gather"})
# Reductions a CPU library fusion implements (see `materialized`), from
# this many elements (XLA counts a device's share; the whole array's is
# used here, layouts aside).
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min"})
_LIBRARY_ELEMENTS = 4096


def materialized(graph: Graph, fuses_shared: bool = True,
                 expensive: frozenset[str] = frozenset()) -> tuple[np.ndarray, np.ndarray]:
  """([V] bool, [V] int): values that occupy a buffer of their own once XLA
  fuses, and per value the one whose shape a stored broadcast of it takes
  (-1: none).

  A value made by a fusible op whose every reader also fuses it is computed
  inside its readers' loops and never stored. Unless `fuses_shared`, a
  reduction fuses only the producers nothing outside its fusion reads
  (XLA:CPU's library reductions): a fusible value that a reduction's fusion
  and another op both read is stored, and where the fusion reads it with
  unit dims broadcast, so is that broadcast (XLA's CSE makes one of the
  readers' implicit broadcasts, which the fusion cannot take in): it has
  the shape of the fusion member's result. Nor does such a fusion take in
  a gather.

  An `expensive` op (`Compiler.expensive`) is never recomputed in two
  fusions: when its computation would run in more than one, it is stored.
  """
  out = np.ones(graph.num_values, bool)
  for v in range(graph.num_values):
    p = graph.producer[v]
    if p < 0 or not graph.uses[v]:
      continue
    if graph.prims[p] in _FUSIBLE or aliasing.is_outer_product(graph, p):
      out[v] = not all(graph.prims[o] in _ABSORBING for o, _ in graph.uses[v])
    elif graph.prims[p] in _FUSED_ONCE:
      out[v] = len(graph.uses[v]) > 1 or graph.prims[graph.uses[v][0][0]] not in _FUSIBLE
  out[[v for v in graph.outputs if v >= 0]] = True
  wide = np.full(graph.num_values, -1, np.int64)
  if fuses_shared:
    return _stored_where_cheaper(graph, out, expensive), wide
  # The reduction whose fusion absorbs each op (-1: none); readers come
  # after producers, so one reverse pass grows every fusion upwards.
  fusion = np.full(graph.num_ops, -1, np.int64)
  for o in range(graph.num_ops - 1, -1, -1):
    if graph.prims[o] in _REDUCTIONS and max(
        (math.prod(graph.shapes[v]) for v in graph.operands[o] if v >= 0),
        default=0) >= _LIBRARY_ELEMENTS:
      fusion[o] = o
      continue
    results = [v for v in graph.results[o] if v >= 0]
    if graph.prims[o] not in _FUSIBLE or not results or out[results].any():
      continue
    readers = {int(fusion[r]) for v in results for r, _ in graph.uses[v]}
    if len(readers) == 1 and -1 not in readers:
      fusion[o] = readers.pop()
  for v in range(graph.num_values):
    p = graph.producer[v]
    readers = {int(fusion[r]) for r, _ in graph.uses[v]}
    if p < 0 or max(readers, default=-1) < 0:
      continue  # read by no library fusion, or an argument (resident; its
      # broadcasts not modelled)
    if graph.prims[p] in _FUSED_ONCE:
      out[v] = True  # a library fusion takes in no gather
    if len(readers) < 2:
      continue
    out[v] = True
    elements = math.prod(graph.shapes[v])
    for r, _ in graph.uses[v]:
      made = graph.results[r][0] if graph.results[r] else -1
      if (fusion[r] >= 0 and made >= 0 and graph.prims[r] in rules.ELEMENTWISE
          and math.prod(graph.shapes[made]) > elements):
        wide[v], elements = made, math.prod(graph.shapes[made])
  _fusion_roots(graph, out, np.zeros(graph.num_ops, bool), expensive=expensive)
  return out, wide


def _stored_where_cheaper(graph: Graph, stored: np.ndarray,
                          expensive: frozenset[str] = frozenset()) -> np.ndarray:
  """`stored`, and the fusible values that cost fewer bytes stored than
  recomputed: a value fused into k fusions reads its fused chain's stored
  inputs k times; stored, it is written once and read k times. XLA's fusion
  cost model (priority fusion) weighs the same trade; a residual stream
  read by every later layer's fusions is stored, not recomputed in each.
  Inputs are counted forward, fusions backward (`_fusion_roots`)."""
  stored = stored.copy()
  inputs = np.zeros(graph.num_values)  # whole-array bytes a fused value reads
  for o in range(graph.num_ops):
    read = sum(float(graph.nbytes[u]) if stored[u] else inputs[u]
               for u in set(graph.operands[o]) if u >= 0)
    for v in graph.results[o]:
      if v >= 0:
        inputs[v] = read
  _fusion_roots(graph, stored, np.zeros(graph.num_ops, bool), inputs, expensive)
  return stored


def _fusion_roots(graph: Graph, stored: np.ndarray, dead: np.ndarray,
                  inputs: np.ndarray | None = None,
                  expensive: frozenset[str] = frozenset()) -> list[frozenset[int]]:
  """[O] the fusions (by their root op) each op's computation runs in.

  An op whose results are stored roots a fusion of its own; one whose
  results are never stored is computed inside each fusion that reads them
  (XLA's producer duplication). Given `inputs` (per value, the bytes its
  fused chain reads), a value is instead stored, in `stored`, where that
  moves fewer bytes than recomputing it, and so is an `expensive` op's
  that more than one fusion would recompute (XLA's `InstructionFusion::
  ShouldFuse`: "don't duplicate expensive instructions"). Readers come
  after producers: one reverse pass."""
  roots = [frozenset((o,)) for o in range(graph.num_ops)]
  for o in range(graph.num_ops - 1, -1, -1):
    results = [v for v in graph.results[o] if v >= 0]
    if dead[o] or not results or stored[results].any():
      continue
    reached = frozenset().union(*(roots[r] for v in results for r, _ in graph.uses[v]
                                  if not dead[r]))
    k = len(reached)
    if k > 1 and _expensive(graph, o, expensive):
      stored[results] = True
    elif inputs is not None and k > 1 and sum(
        (1 + k) * float(graph.nbytes[v]) for v in results) < k * sum(inputs[results]):
      stored[results] = True
    else:
      roots[o] = reached or roots[o]
  return roots


def _expensive(graph: Graph, o: int, expensive: frozenset[str]) -> bool:
  """Whether op o is one XLA's fusion will not duplicate. A division by a
  constant is cheap: an integer one compiles to multiplies and shifts
  (`IsExpensive`), and XLA's algebraic simplifier turns a float one into a
  multiplication by the inverse; by anything else it is expensive."""
  prim = graph.prims[o]
  if prim not in expensive:
    return False
  if prim in ("div", "rem"):
    divisor = graph.operands[o][1] if len(graph.operands[o]) > 1 else -1
    return divisor >= 0 and graph.kind[divisor] != graph_lib.CONST  # -1: a literal
  return True


def fused_liveness(graph: Graph, stored: np.ndarray, end: np.ndarray, dead: np.ndarray,
                   resident: np.ndarray, at: np.ndarray) -> np.ndarray:
  """[V] liveness ends once values that are never `stored` are accounted for.

  XLA recomputes such a value inside each of its readers' loops, so what it
  is made from stays alive until its last reader: a layer norm's input is
  held until the backward pass recomputes its fused `x - mean`. A reader
  that makes a result of the program updates its operands in the result's
  own buffer (a gradient in the new optimizer state) and holds nothing.
  Ops are in dependency order, so one reverse pass follows fused chains;
  `at` places each op in the schedule.
  """
  end = end.copy()
  reach = np.full(graph.num_values, -1, np.int64)  # last op recomputing a fused value
  for o in range(graph.num_ops - 1, -1, -1):
    results = [v for v in graph.results[o] if v >= 0]
    if dead[o] or not results or stored[results].any():
      continue
    last = -1
    for u in results:
      for r, _ in graph.uses[u]:
        made = [v for v in graph.results[r] if v >= 0]
        if made and not stored[made].any():
          last = max(last, int(reach[made].max()))
        elif not resident[made].any():
          last = max(last, int(at[r]))
    reach[results] = last
    for v in graph.operands[o]:
      if v >= 0 and end[v] < last:
        end[v] = last
  return end


def dead_ops(graph: Graph, outputs: list[int]) -> np.ndarray:
  """[O] bool ops none of whose results reaches an output. XLA removes them,
  so they cost nothing and hold no memory.

  A scan body reads its carry as the initial value; the next step's carry
  is what the body makes: a "scan_carry" (or "while_carry") tie is live when
  its result or its initial value is needed. Passes until nothing changes.
  """
  dead = np.ones(graph.num_ops, bool)
  needed = np.zeros(graph.num_values, bool)
  needed[outputs] = True
  changed = True
  while changed:
    changed = False
    for o in range(graph.num_ops - 1, -1, -1):
      ties = graph.operands[o][:1] if graph.prims[o] in ("scan_carry", "while_carry") else ()
      if dead[o] and any(needed[v] for v in (*graph.results[o], *ties) if v >= 0):
        dead[o] = False
        needed[[v for v in graph.operands[o] if v >= 0]] = True
        changed = True
  return dead


def late_ops(graph: Graph) -> np.ndarray:
  """[O] bool ops no result of which reaches an op that mixes elements (a
  contraction, reduction, gather...), e.g. the gradient reductions of a
  training step, read only by the optimizer's elementwise update. Their
  collectives are mutually independent, and XLA's combiners merge them:
  latency is paid once per kind and axes, not per collective."""
  late = np.zeros(graph.num_ops, bool)
  mixes = np.zeros(graph.num_values, bool)
  for o in range(graph.num_ops - 1, -1, -1):
    rule = graph.rules[o]
    downstream = any(mixes[v] for v in graph.results[o] if v >= 0)
    # A loop body's collectives repeat every step: never combined.
    late[o] = not downstream
    mixing = downstream or rule.replicated or any(rule.reduction)
    for v in graph.operands[o]:
      if v >= 0 and mixing:
        mixes[v] = True
  return late


def fusion_copies(graph: Graph, stored: np.ndarray,
                  dead: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """([O] int64 the fusions each op's computation runs in, and so reads its
  own operands in, [V] int64 the fusions that read each value), by
  `_fusion_roots`."""
  roots = _fusion_roots(graph, stored, dead)
  copies = np.array([len(r) for r in roots], np.int64)
  readers = np.array([len(frozenset().union(*(roots[r] for r, _ in graph.uses[v]
                                                if not dead[r])))
                      for v in range(graph.num_values)], np.int64)
  return copies, readers


def canonical_copies(rule, shapes) -> tuple[bool, bool]:
  """Whether XLA copies each operand of a contraction into a new layout
  first, given the operands' (per-device) shapes. Its `DotDecomposer`
  rewrites a dot with more than one contracting or free dim on an operand
  (or batch dims not major) into a batched matrix product, transposing
  the lhs to [batch, free, contracting] and the rhs to [batch, contracting,
  free]: an operand not already in that order is copied. A dot already in
  matrix form reads its operands as they lie, either way round (layout
  assignment). Dims of extent 1 are dropped first (a bitcast)."""
  lhs, rhs = ([f for f, n in zip(dims, shape) if n > 1]
              for dims, shape in zip(rule.operands[:2], shapes))
  # Factor ids follow the dimension numbers: batch, then contracting, in order.
  batch = sorted(f for f in lhs if f in rhs and not rule.reduction[f])
  contracting = sorted(f for f in lhs if rule.reduction[f])
  matrix = True
  wants = []
  for order, free_first in ((lhs, True), (rhs, False)):
    free = [f for f in order if f not in batch and not rule.reduction[f]]
    summed = [f for f in order if rule.reduction[f]]
    matrix &= order[:len(batch)] == batch and len(free) <= 1 and len(summed) <= 1
    wants.append(order == batch + (free + contracting if free_first else contracting + free))
  if matrix:
    return False, False
  return not wants[0], not wants[1]


def contraction_readers(graph: Graph, dead: np.ndarray) -> np.ndarray:
  """[V] int64 the contraction operands that read each value through a
  copy into a dot's layout (`canonical_copies`, on whole shapes): XLA makes
  one copy, and they share it."""
  readers = np.zeros(graph.num_values, np.int64)
  for o, prim in enumerate(graph.prims):
    if prim == "dot_general" and not dead[o]:
      copied = canonical_copies(graph.rules[o], graph.operand_shapes[o])
      for v, c in zip(graph.operands[o][:2], copied):
        if v >= 0 and c:
          readers[v] += 1
  return readers


class Dependencies(NamedTuple):
  """The op graph a schedule walks (`kernels.list_schedule`)."""

  operands: np.ndarray  # [O, K] int64 each op's operands, -1: none
  results: np.ndarray  # [O, R] int64 each op's results, -1: none
  succ_ptr: np.ndarray  # [O + 1] int64 CSR offsets into succ_idx, per op
  succ_idx: np.ndarray  # int64 the ops reading each op's results
  preds: np.ndarray  # [O] int64 distinct producers each op reads


def _padded(rows, width: int | None = None) -> np.ndarray:
  width = width or max((len(r) for r in rows), default=1) or 1
  return np.array([list(r) + [-1] * (width - len(r)) for r in rows],
                  np.int64).reshape(len(rows), width)


def dependencies(operands, results, num_values: int) -> Dependencies:
  """The dependencies of ops that read `operands` and make `results` (per
  op, value ids, -1: none). An op reading its own result (a loop's carry)
  does not wait for itself."""
  producer = np.full(num_values, -1, np.int64)
  for o, made in enumerate(results):
    for v in made:
      if v >= 0:
        producer[v] = o
  succs: list[list[int]] = [[] for _ in operands]
  preds = np.zeros(len(operands), np.int64)
  for o, read in enumerate(operands):
    for p in sorted({int(producer[v]) for v in read if v >= 0}):
      if p >= 0 and p != o:
        succs[p].append(o)
        preds[o] += 1
  succ_ptr = np.zeros(len(operands) + 1, np.int64)
  succ_ptr[1:] = np.cumsum([len(s) for s in succs])
  succ_idx = np.array([o for s in succs for o in s], np.int64)
  return Dependencies(_padded(operands), _padded(results), succ_ptr, succ_idx, preds)


# Ops that tie a loop or branch to its body: XLA's while or conditional
# instruction, scheduled as one with the body.
_TIES = graph_lib.CARRIES | {"scan_slice", "scan_stack", "while_enter"}


def breadth_first_positions(graph: Graph, stored: np.ndarray) -> np.ndarray:
  """[O] each op's place in a breadth-first schedule of the entry computation.

  XLA:CPU schedules its entry computation breadth-first (`BFScheduler`,
  `CpuCompiler::CreateHloSchedule`): an instruction as soon as all its
  operands are made, so the compiled sequence is sorted by depth, the
  longest path from the parameters (checked on the compiled sequence of
  unrolled remat'd stacks: depth never decreases along it). Depth is
  counted in instructions XLA emits: one per stored value (a fusion's
  elementwise ops are one), and a loop or branch, ties included, one
  instruction whose body keeps its order. So work that reads only the
  arguments and an early value runs early: a remat'd layer's recomputation
  beside the forward pass, not just before its layer's backward, its
  results held until that backward reads them. Ties keep program order.
  """
  n = graph.num_ops
  if not n:
    return np.zeros(0, np.int64)
  control = np.array([graph.trips[o] > 1 or graph.regions[o] != 0 or graph.prims[o] in _TIES
                      for o in range(n)], bool)
  # Each op's unit: a run of control-flow ops is one instruction.
  unit = np.arange(n)
  for o in range(1, n):
    if control[o] and control[o - 1]:
      unit[o] = unit[o - 1]
  ready = np.zeros(graph.num_values, np.int64)  # depth at which each value exists
  depth = np.zeros(n, np.int64)
  o = 0
  while o < n:
    end = o + 1
    while end < n and unit[end] == unit[o]:
      end += 1
    members = range(o, end)
    inside = {v for m in members for v in graph.results[m] if v >= 0}
    outer = [ready[v] for m in members for v in graph.operands[m] if v >= 0 and v not in inside]
    base = max(outer, default=0)
    if end - o > 1:  # a loop: one instruction after its operands
      depth[o:end] = base + 1
      for v in inside:
        ready[v] = base + 1
    else:
      made = [v for v in graph.results[o] if v >= 0]
      depth[o] = base + (1 if stored[made].any() else 0) if made else base
      ready[made] = depth[o]
    o = end
  order = np.lexsort((np.arange(n), depth))
  positions = np.empty(n, np.int64)
  positions[order] = np.arange(n)
  return positions


def remade_values(graph: Graph) -> np.ndarray:
  """[V] bool values XLA makes anew in whatever layout a reader wants (an
  iota, a broadcast constant scalar, an uninitialised array): reading one in
  another layout moves nothing."""
  free = np.zeros(graph.num_values, bool)
  for o, prim in enumerate(graph.prims):
    scalars = all(v < 0 or (graph.kind[v] == graph_lib.CONST and graph.rank(v) == 0)
                  for v in graph.operands[o])
    if prim in ("iota", "empty2") or (prim == "broadcast_in_dim" and scalars):
      free[[v for v in graph.results[o] if v >= 0]] = True
  return free


@dataclasses.dataclass(frozen=True)
class Analysis:
  """What a graph's buffers and ops are once XLA compiles it, layouts aside.

  Shape letters: V values, O ops, N results of the program that it makes,
  M members per op (its operands, results and stored broadcasts; padded by
  repeating the first, so ops of one class pad alike), R result slots per
  op. Times are places in the compiler's schedule of the entry computation,
  from 0 to `program_end` (= O): `at` maps ops to them (op indices, or a
  breadth-first order, `breadth_first_positions`).

  A value lives from `start` (the op making it; 0 for an input) to `end`
  (its last reader, or the last reader of a fused value made from it; the
  program's end for arguments and results). Arguments and results are
  `resident` for the whole program, as XLA's memory_analysis counts them;
  `temporary` buffers are the other stored values, live by liveness;
  `hostable` ones are outside loops (a loop's carries, stacked results and
  what its body makes are XLA's loop state, colocated apart), so a result's
  buffer may hold them before the result is made.
  """

  program_end: int
  at: np.ndarray  # [O] int64 each op's place in the schedule
  start: np.ndarray  # [V] int64
  end: np.ndarray  # [V] int64
  is_input: np.ndarray  # [V] bool: arguments and constants
  resident: np.ndarray  # [V] bool
  results_made: np.ndarray  # [N] int64 results an op makes, in the order made
  results_made_at: np.ndarray  # [N] int64 the op making each
  dead: np.ndarray  # [O] bool, `dead_ops`
  unread: np.ndarray  # [V] bool: no live op reads it and it is no output
  late: np.ndarray  # [O] bool, `late_ops`
  wide: np.ndarray  # [V] int64 the value a stored broadcast takes the shape of (`materialized`)
  stored: np.ndarray  # [V] bool: has a buffer once XLA fuses (`materialized`)
  copies: np.ndarray  # [O] int64 fusions each op runs in (`fusion_copies`)
  readers: np.ndarray  # [V] int64 fusions reading each value (`fusion_copies`)
  dot_readers: np.ndarray  # [V] int64 contraction operands reading it (`contraction_readers`)
  temporary: np.ndarray  # [V] bool: stored, not resident, made by a live op
  hostable: np.ndarray  # [V] bool
  free: np.ndarray  # [V] bool, `remade_values`
  loop_made: np.ndarray  # [V] bool: made by an op XLA loop-fuses
  loop_read: np.ndarray  # [V] bool: no output, and every reader loop-fuses
  loop_fused: np.ndarray  # [O] bool: an op XLA loop-fuses
  op_class: np.ndarray  # [O] int64: ops that cost the same in the same layouts share one
  member_table: np.ndarray  # [O, M] int64 the values whose layouts key an op's cost
  result_table: np.ndarray  # [O, R] int64 each op's results, -1: none
  touch_ptr: np.ndarray  # [V + 1] int64 CSR offsets into touch_idx, per value
  touch_idx: np.ndarray  # int64 the ops each value is a member of
  dependencies: Dependencies  # the op graph a schedule walks

  @classmethod
  def of(cls, graph: Graph, fuses_shared_producers: bool = True,
         expensive: frozenset[str] = frozenset(), breadth_first: bool = False) -> Analysis:
    """The analysis of `graph` under a compiler that does (or does not)
    fuse shared producers into reductions (`Compiler.fuses_shared_producers`),
    never duplicates `expensive` ops (`Compiler.expensive`) and schedules
    in program order or `breadth_first` (`Compiler.breadth_first`)."""
    program_end = graph.num_ops
    stored, wide = materialized(graph, fuses_shared_producers, expensive)
    at = (breadth_first_positions(graph, stored) if breadth_first
          else np.arange(graph.num_ops, dtype=np.int64))
    start = np.where(graph.producer >= 0, np.append(at, 0)[graph.producer], 0).astype(np.int64)
    end = start.copy()  # then each value's last reader in the schedule
    readers = [(v, o) for v, uses in enumerate(graph.uses) for o, _ in uses]
    if readers:
      v, o = np.array(readers, np.int64).T
      np.maximum.at(end, v, at[o])
    outs = [v for v in graph.outputs if v >= 0]
    end[outs] = program_end
    is_input = graph.kind != graph_lib.INTERMEDIATE
    end[is_input] = program_end
    resident = is_input.copy()
    resident[outs] = True
    made = np.array(sorted({v for v in outs if not is_input[v]}, key=lambda v: start[v]),
                    np.int64)
    dead = dead_ops(graph, outs)
    unread = np.ones(graph.num_values, bool)
    unread[outs] = False
    for o in np.flatnonzero(~dead):
      unread[[v for v in graph.operands[o] if v >= 0]] = False
    made_dead = np.zeros(graph.num_values, bool)
    for o in np.flatnonzero(dead):
      made_dead[[v for v in graph.results[o] if v >= 0]] = True
    temporary = stored & ~resident & ~made_dead
    looped = np.array([graph.trips[o] > 1 or graph.prims[o].startswith(("scan_", "while_"))
                       for o in range(graph.num_ops)], bool)
    hostable = temporary & ~np.append(looped, False)[graph.producer]
    end = fused_liveness(graph, stored, end, dead, resident, at)
    aliasing.share_loop_buffers(graph, start, end, temporary, hostable, dead, at)
    free = remade_values(graph)
    copies, readers = fusion_copies(graph, stored, dead)
    dot_readers = contraction_readers(graph, dead)
    # A copy or slice the compiler puts before or after a collective joins
    # a loop fusion next to it (`relayout_bytes`).
    loop_fused = np.array([p in _FUSIBLE for p in graph.prims], bool)
    loop_made = np.append(loop_fused, False)[graph.producer]
    loop_read = np.array([all(loop_fused[o] for o, _ in uses) for uses in graph.uses], bool)
    loop_read[outs] = False
    op_class, members, extra = _op_classes(graph, dead, free, wide, unread, stored, copies,
                                           readers, dot_readers, loop_made, loop_read)
    width = max((len(m) for m in members), default=1) or 1
    member_table = np.array(
        [(m or [0]) + [(m or [0])[0]] * (width - len(m or [0])) for m in members],
        np.int64).reshape(graph.num_ops, width)
    slots = max((len(r) for r in graph.results), default=1) or 1
    result_table = np.array(
        [list(r) + [-1] * (slots - len(r)) for r in graph.results],
        np.int64).reshape(graph.num_ops, slots)
    touching = [np.array(t, np.int64) for t in graph.touching]
    for o, ws in enumerate(extra):
      for w in ws:
        touching[w] = np.union1d(touching[w], [o])
    touch_ptr = np.zeros(graph.num_values + 1, np.int64)
    touch_ptr[1:] = np.cumsum([len(t) for t in touching])
    touch_idx = np.concatenate(touching) if touching else np.zeros(0, np.int64)
    return cls(
        program_end=program_end, at=at, start=start, end=end, is_input=is_input,
        resident=resident, results_made=made, results_made_at=start[made], dead=dead,
        unread=unread,
        late=late_ops(graph), wide=wide, stored=stored, copies=copies,
        readers=readers, dot_readers=dot_readers,
        temporary=temporary, hostable=hostable,
        free=free, loop_made=loop_made, loop_read=loop_read, loop_fused=loop_fused,
        op_class=op_class, member_table=member_table,
        result_table=result_table, touch_ptr=touch_ptr, touch_idx=touch_idx,
        dependencies=dependencies(graph.operands, graph.results, graph.num_values))


def _op_classes(graph: Graph, dead: np.ndarray, free: np.ndarray, wide: np.ndarray,
                unread: np.ndarray, stored: np.ndarray, copies: np.ndarray,
                readers: np.ndarray, dot_readers: np.ndarray, loop_made: np.ndarray,
                loop_read: np.ndarray) -> tuple[np.ndarray, list[list[int]], list[list[int]]]:
  """([O] class of each op, its members, the stored broadcasts among them).

  An op whose result is stored broadcast (`materialized`) prices that
  buffer in its reader's layout: the reader's result is a member too."""
  classes: dict[tuple, int] = {}
  op_class = np.empty(graph.num_ops, np.int64)
  members = []
  extra = [[int(wide[v]) for v in graph.results[o] if v >= 0 and wide[v] >= 0]
           for o in range(graph.num_ops)]
  for o in range(graph.num_ops):
    values = [v for v in graph.operands[o] + graph.results[o] if v >= 0] + extra[o]
    signature = (graph.prims[o], graph.rules[o], graph.operand_shapes[o],
                 tuple(graph.shapes[w] for w in extra[o]),
                 tuple(graph.operands[o].index(v) if v in graph.operands[o]
                       else -1 for v in graph.operands[o]),
                 tuple(str(graph.dtypes[v]) for v in values),
                 tuple(graph.shapes[v] for v in graph.results[o] if v >= 0),
                 float(graph.flops[o]), int(graph.trips[o]), bool(dead[o]),
                 tuple(bool(unread[v]) for v in graph.results[o] if v >= 0),
                 tuple(bool(free[v]) if v >= 0 else False for v in graph.operands[o]),
                 tuple(bool(stored[v]) for v in values), int(copies[o]),
                 tuple(int(readers[v]) for v in graph.results[o] if v >= 0),
                 tuple(int(dot_readers[v]) for v in graph.operands[o] if v >= 0),
                 tuple(bool(loop_made[v]) for v in graph.operands[o] if v >= 0),
                 tuple(bool(loop_read[v]) for v in values))
    op_class[o] = classes.setdefault(signature, len(classes))
    members.append(values)
  return op_class, members, extra
