"""Cost model: per-device FLOPs, collectives, peak memory and step time.

For each op the model derives, per mesh axis, which factor of its rule the
axis tiles (the result's layout wins; otherwise a reduction factor tiled on
the operands; otherwise none), then charges what the SPMD partitioner emits
to make the operands fit (all-gather, all-to-all; slicing is free) and to
finish the result (all-reduce of partial sums, or reduce-scatter when the
result is itself tiled on that axis). Collective sizes are per-device result
bytes, the figure compiled HLO shows; `collectives` turns them into time on
the link each axis maps to (axis by axis, fastest link first, for a
reduction or gather over several axes).

Peak memory is counted as XLA's `memory_analysis` counts it: arguments and
results for the whole program, plus the peak over program order of the
temporaries alive (producer to last reader) that fusion leaves in memory.

The evaluation is incremental: an action re-costs only the ops around the
values it changed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import numpy as np

from automap._src.cost import kernels
from automap._src.cost.collectives import (
  ALL_GATHER,
  ALL_REDUCE,
  ALL_TO_ALL,
  KINDS,
  PERMUTE,
  REDUCE_SCATTER,
  ring_seconds,
  staged_seconds,
)
from automap._src.cost.hardware import Hardware
from automap._src.ir import graph as graph_lib
from automap._src.ir import rules
from automap._src.ir.graph import Graph
from automap._src.sharding.mesh import MeshSpec
from automap._src.sharding.state import UNSHARDED, State


@dataclasses.dataclass(frozen=True)
class Cost:
  """Predicted cost of one sharded step, per device.

  step_time: compute_time + comm_time, seconds (no overlap assumed).
  compute_time: roofline time of every op, seconds.
  comm_time: collective time, seconds.
  flops: FLOPs executed per device.
  comm_bytes: {(kind, axes): bytes} collective result bytes per device, as
    the compiled HLO shows them (a scan body's once; its time counts every step).
  comm_count: {(kind, axes): number of collectives}.
  peak_memory: bytes live at the peak, per device.
  argument_memory: bytes of arguments per device (part of peak_memory).
  comm_seconds: {(kind, axes): seconds} of comm_time.
  """

  step_time: float
  compute_time: float
  comm_time: float
  flops: float
  comm_bytes: dict[tuple[str, tuple[str, ...]], float]
  comm_count: dict[tuple[str, tuple[str, ...]], int]
  peak_memory: float
  argument_memory: float
  comm_seconds: dict[tuple[str, tuple[str, ...]], float] = dataclasses.field(
      default_factory=dict)

  @property
  def total_comm_bytes(self) -> float:
    return float(sum(self.comm_bytes.values()))

  def to_json(self) -> dict:
    return {
        "step_time": self.step_time, "compute_time": self.compute_time,
        "comm_time": self.comm_time, "flops": self.flops,
        "comm_bytes": [[k, list(a), b] for (k, a), b in self.comm_bytes.items()],
        "comm_count": [[k, list(a), n] for (k, a), n in self.comm_count.items()],
        "peak_memory": self.peak_memory,
        "argument_memory": self.argument_memory,
        "comm_seconds": [[k, list(a), t] for (k, a), t in self.comm_seconds.items()],
    }

  @classmethod
  def from_json(cls, d: dict) -> Cost:
    return cls(
        step_time=d["step_time"], compute_time=d["compute_time"],
        comm_time=d["comm_time"], flops=d["flops"],
        comm_bytes={(k, tuple(a)): b for k, a, b in d["comm_bytes"]},
        comm_count={(k, tuple(a)): n for k, a, n in d["comm_count"]},
        peak_memory=d["peak_memory"], argument_memory=d["argument_memory"],
        comm_seconds={(k, tuple(a)): t for k, a, t in d.get("comm_seconds", ())})


class OpCost:
  """Cost of one op under one state.

  time: compute seconds; flops: per device; comms: (kind, axes bitmask,
  bytes, seconds, resharded operand position or -1, target layout code) per
  collective; reshards: operand position -> the per-axis dims it is
  resharded to on entry, where that differs from its own; footprint: per
  result, the bytes its buffer holds (more than its tile when the op makes
  the whole array and slices it, e.g. an all-reduce standing in for a
  reduce-scatter); natural: per result, the per-axis dims of the layout the
  op produces it in (partial sums combined), before any reshard to its own.
  """

  __slots__ = ("time", "flops", "comms", "reshards", "footprint", "natural")

  def __init__(self, time: float, flops: float,
               comms: list[tuple[int, int, float, float, int, int]],
               reshards: dict[int, tuple[int, ...]],
               footprint: tuple[float, ...], natural: tuple):
    self.time, self.flops = time, flops
    self.comms = comms
    self.reshards = reshards
    self.footprint = footprint
    self.natural = natural  # per result: the layout the op computes it in


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


def materialized(graph: Graph, fuses_shared: bool = True) -> tuple[np.ndarray, np.ndarray]:
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
  """
  out = np.ones(graph.num_values, bool)
  for v in range(graph.num_values):
    p = graph.producer[v]
    if p < 0 or not graph.uses[v]:
      continue
    if graph.prims[p] in _FUSIBLE:
      out[v] = not all(graph.prims[o] in _ABSORBING for o, _ in graph.uses[v])
    elif graph.prims[p] in _FUSED_ONCE:
      out[v] = len(graph.uses[v]) > 1 or graph.prims[graph.uses[v][0][0]] not in _FUSIBLE
  out[[v for v in graph.outputs if v >= 0]] = True
  wide = np.full(graph.num_values, -1, np.int64)
  if fuses_shared:
    return out, wide
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
  return out, wide


def _fused_liveness(graph: Graph, stored: np.ndarray, end: np.ndarray, dead: np.ndarray,
                    resident: np.ndarray) -> np.ndarray:
  """[V] liveness ends once values that are never `stored` are accounted for.

  XLA recomputes such a value inside each of its readers' loops, so what it
  is made from stays alive until its last reader: a layer norm's input is
  held until the backward pass recomputes its fused `x - mean`. A reader
  that makes a result of the program updates its operands in the result's
  own buffer (a gradient in the new optimizer state) and holds nothing.
  Ops are in dependency order, so one reverse pass follows fused chains.
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
          last = max(last, r)
    reach[results] = last
    for v in graph.operands[o]:
      if v >= 0 and end[v] < last:
        end[v] = last
  return end


# Ops that change only an array's type or labels, not its elements' order in
# a way XLA needs a copy for.
_RELABELS = frozenset({"reshape", "transpose", "convert_element_type", "copy",
                       "squeeze", "expand_dims"})


def _layout_code(row) -> int:
  """A layout (per-axis tiled dim, -1 for none) as one int: 4 bits an axis."""
  return sum((d + 1) << (4 * a) for a, d in enumerate(row))


class CostModel:
  """Prices ops of one graph on one mesh and hardware.

  `op_cost` / `entry_ids` price ops under a state (memoised per op class and
  layout); `Tracker` sums them into a running total that `update` refreshes
  after an action.
  """

  def __init__(self, graph: Graph, mesh: MeshSpec, hardware: Hardware):
    self.graph, self.mesh, self.hw = graph, mesh, hardware
    self.sizes = np.array(mesh.axis_sizes, np.int64)
    n = mesh.num_axes
    self.masks = 1 << n
    # Devices in a group over a set of axes, and whether it crosses nodes.
    self.group_size = np.array(
        [math.prod(s for a, s in enumerate(mesh.axis_sizes) if m >> a & 1)
         for m in range(self.masks)], np.int64)
    strides = [math.prod(mesh.axis_sizes[a + 1:]) for a in range(n)]
    # Axes of size one take part in no collective.
    self.nontrivial = sum(1 << a for a, s in enumerate(mesh.axis_sizes) if s > 1)
    self.cross_node = [
        max((strides[a] * mesh.axis_sizes[a] for a in range(n) if m >> a & 1),
            default=1) > hardware.devices_per_node for m in range(self.masks)]
    # Per mask, the (size, bandwidth, latency) of its axes, fastest first.
    hw = hardware
    link = {a: (hw.network_bandwidth, hw.network_latency) if self.cross_node[1 << a]
            else (hw.link_bandwidth, hw.link_latency) for a in range(n)}
    self.stages = [sorted(((mesh.axis_sizes[a],) + link[a] for a in range(n)
                           if m >> a & 1 and mesh.axis_sizes[a] > 1),
                          key=lambda s: (-s[1], s[2]))
                   for m in range(self.masks)]
    self.itemsize = np.array([graph_lib._itemsize(d) for d in graph.dtypes])
    # [V] bytes per element an all-reduce of the value moves.
    self.reduced_itemsize = np.array([
        4 if hardware.reduce_in_f32 and size == 2 and graph_lib.is_float(d) else size
        for size, d in zip(self.itemsize, graph.dtypes)])
    self.program_end = graph.num_ops
    # Liveness interval of each value over op indices.
    self.start = np.where(graph.producer >= 0, graph.producer, 0).astype(np.int64)
    end = np.maximum(graph.last_use.astype(np.int64), self.start)
    outs = [v for v in graph.outputs if v >= 0]
    end[outs] = self.program_end
    is_input = graph.kind != graph_lib.INTERMEDIATE
    end[is_input] = self.program_end
    self.end = end
    # XLA's accounting (memory_analysis): arguments and results are
    # resident for the whole program; temporaries live by liveness.
    self.is_input = is_input
    self.resident = is_input.copy()
    self.resident[outs] = True
    # Results the program makes, by the op that makes them.
    made = np.array(sorted({v for v in outs if not is_input[v]}, key=lambda v: self.start[v]),
                    np.int64)
    self.results_made, self.results_made_at = made, self.start[made]
    # Dead ops: no result reaches an output. XLA removes them, so they cost
    # nothing and hold no memory.
    # A scan body reads its carry as the initial value; the next step's
    # carry is what the body makes: a "scan_carry" tie is live when its
    # result or its initial value is needed. Passes until nothing changes.
    self.dead = np.ones(graph.num_ops, bool)
    needed = np.zeros(graph.num_values, bool)
    needed[outs] = True
    changed = True
    while changed:
      changed = False
      for o in range(graph.num_ops - 1, -1, -1):
        ties = graph.operands[o][:1] if graph.prims[o] == "scan_carry" else ()
        if self.dead[o] and any(needed[v] for v in (*graph.results[o], *ties) if v >= 0):
          self.dead[o] = False
          needed[[v for v in graph.operands[o] if v >= 0]] = True
          changed = True
    made_dead = np.zeros(graph.num_values, bool)
    for o in np.flatnonzero(self.dead):
      made_dead[[v for v in graph.results[o] if v >= 0]] = True
    stored, self.wide = materialized(graph, hardware.fuses_shared_producers)
    self.temporary = stored & ~self.resident & ~made_dead
    # Buffers of a loop (its carries and stacked results, and what its body
    # makes) are XLA's loop state, colocated apart from results' buffers.
    looped = np.array([graph.trips[o] > 1 or graph.prims[o].startswith("scan_")
                       for o in range(graph.num_ops)], bool)
    self.hostable = self.temporary & ~np.append(looped, False)[graph.producer]
    self.end = _fused_liveness(graph, stored, self.end, self.dead, self.resident)
    # Late ops: no result reaches an op that mixes elements (a contraction,
    # reduction, gather...), e.g. the gradient reductions of a training
    # step, read only by the optimizer's elementwise update. Their
    # collectives are mutually independent, and XLA's combiners merge them:
    # latency is paid once per kind and axes, not per collective.
    self.late = np.zeros(graph.num_ops, bool)
    mixes = np.zeros(graph.num_values, bool)
    for o in range(graph.num_ops - 1, -1, -1):
      rule = graph.rules[o]
      downstream = any(mixes[v] for v in graph.results[o] if v >= 0)
      # A loop body's collectives repeat every step: never combined.
      self.late[o] = not downstream
      mixing = downstream or rule.replicated or any(rule.reduction)
      for v in graph.operands[o]:
        if v >= 0 and mixing:
          mixes[v] = True
    self.latency = np.array(
        [[self.comm_time(k, m, 0.0) for m in range(self.masks)] for k in range(len(KINDS))])
    # Values XLA makes anew in whatever layout a reader wants (an iota, a
    # broadcast constant scalar): reading one in another layout moves nothing.
    self.free = np.zeros(graph.num_values, bool)
    for o, prim in enumerate(graph.prims):
      scalars = all(v < 0 or (graph.kind[v] == graph_lib.CONST and graph.rank(v) == 0)
                    for v in graph.operands[o])
      if prim == "iota" or (prim == "broadcast_in_dim" and scalars):
        self.free[[v for v in graph.results[o] if v >= 0]] = True
    # Ops that cost the same in the same layouts share a class.
    classes: dict[tuple, int] = {}
    self.op_class = np.empty(graph.num_ops, np.int64)
    members = []
    # An op whose result is stored broadcast (`materialized`) prices that
    # buffer in its reader's layout: the reader's result is a member too.
    extra = [[int(self.wide[v]) for v in graph.results[o] if v >= 0 and self.wide[v] >= 0]
             for o in range(graph.num_ops)]
    for o in range(graph.num_ops):
      values = [v for v in graph.operands[o] + graph.results[o] if v >= 0] + extra[o]
      signature = (graph.prims[o], graph.rules[o], graph.operand_shapes[o],
                   tuple(graph.shapes[w] for w in extra[o]),
                   tuple(graph.operands[o].index(v) if v in graph.operands[o]
                         else -1 for v in graph.operands[o]),
                   tuple(str(graph.dtypes[v]) for v in values),
                   tuple(graph.shapes[v] for v in graph.results[o] if v >= 0),
                   float(graph.flops[o]), int(graph.trips[o]), bool(self.dead[o]),
                   tuple(bool(self.free[v]) if v >= 0 else False for v in graph.operands[o]))
      self.op_class[o] = classes.setdefault(signature, len(classes))
      members.append(values)
    # Tables for costing many ops at once: members padded by repeating the
    # first (ops of one class pad alike), result slots (-1: none), and per
    # value the ops touching it (CSR).
    width = max((len(m) for m in members), default=1) or 1
    self.member_table = np.array(
        [(m or [0]) + [(m or [0])[0]] * (width - len(m or [0])) for m in members],
        np.int64).reshape(graph.num_ops, width)
    slots = max((len(r) for r in graph.results), default=1) or 1
    self.result_table = np.array(
        [list(r) + [-1] * (slots - len(r)) for r in graph.results],
        np.int64).reshape(graph.num_ops, slots)
    touching = [np.array(t, np.int64) for t in graph.touching]
    for o, ws in enumerate(extra):
      for w in ws:
        touching[w] = np.union1d(touching[w], [o])
    self.touch_ptr = np.zeros(graph.num_values + 1, np.int64)
    self.touch_ptr[1:] = np.cumsum([len(t) for t in touching])
    self.touch_idx = np.concatenate(touching) if touching else np.zeros(0, np.int64)
    # The memo: layout key -> entry id; per entry its OpCost and, for
    # vectorised totals, its time, FLOPs, footprints and whether it talks.
    self.memo: dict[bytes, int] = {}
    self.entries: list[OpCost] = []
    self._e_time = np.zeros(256)
    self._e_flops = np.zeros(256)
    self._e_foot = np.zeros((256, slots))
    self._e_comms = np.zeros(256, bool)
    # ... and its key (class, members' state rows) and the key's hash, with
    # the open-addressing table of hashes `kernels.find_entries` searches.
    self._e_class = np.zeros(256, np.int64)
    self._e_rows = np.zeros((256, self.member_table.shape[1] * n), np.int8)
    self._e_hash = np.zeros(256, np.uint64)
    self._slot_hash = np.zeros(1024, np.uint64)
    self._slot_entry = np.full(1024, -1, np.int64)
    # ... and its collectives, rows _c_start[e] to _c_end[e] of the _c_*
    # columns, and whether one is a reshard (`Tracker._talk` shares those).
    self._e_reshard = np.zeros(256, bool)
    self._c_start = np.zeros(256, np.int64)
    self._c_end = np.zeros(256, np.int64)
    self._c_kind = np.zeros(256, np.int64)
    self._c_mask = np.zeros(256, np.int64)
    self._c_bytes = np.zeros(256)
    self._c_seconds = np.zeros(256)

  # -- collectives ---------------------------------------------------------

  def emit(self, comms: list, kind: int, mask: int, nbytes: float,
           position: int = -1, target: int = 0) -> None:
    """Records a collective; `position` >= 0 marks a reshard of that operand
    to layout `target` (a code), which XLA performs once however many ops
    read the resharded copy."""
    mask &= self.nontrivial
    if mask:
      comms.append((kind, mask, nbytes, self.comm_time(kind, mask, nbytes),
                    position, target))

  def copy_key(self, o: int, position: int, kind: int, mask: int, target: int,
               nbytes: float) -> tuple:
    """Which resharded copy op o reads at operand `position`: XLA makes one
    per value and layout for all its readers, and each loop its own of what
    it scans."""
    g = self.graph
    loop = o if g.prims[o] == "scan_slice" else -1
    return (g.operands[o][position], kind, mask, target, nbytes, loop)

  def comm_time(self, kind: int, mask: int, nbytes: float) -> float:
    """Seconds of a collective of `kind` over the axes in `mask`, `nbytes`
    its per-device result bytes: axis by axis, fastest link first, when it
    reduces or gathers over several axes (`staged_seconds`); else one ring
    on the slowest link the axes span."""
    n = int(self.group_size[mask])
    if n <= 1:
      return 0.0
    stages = self.stages[mask]
    if len(stages) > 1 and kind in (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER):
      return staged_seconds(kind, nbytes, n, stages)
    cross = self.cross_node[mask]
    bw = self.hw.network_bandwidth if cross else self.hw.link_bandwidth
    lat = self.hw.network_latency if cross else self.hw.link_latency
    return ring_seconds(kind, nbytes, n, bw, lat)

  # -- one op --------------------------------------------------------------

  def local_bytes(self, state: State, v: int) -> float:
    row = state[v]
    div = 1
    for a in range(len(row)):
      if row[a] >= 0:
        div *= self.mesh.axis_sizes[a]
    return float(self.graph.nbytes[v]) / div

  def layout(self, state: State, o: int) -> tuple[list[int], list[bool], list]:
    """How op o computes under `state`.

    Returns, per mesh axis, the factor it tiles (or UNSHARDED) and whether the
    op's partial result is scattered over it; and per operand (None for a
    literal) the dim each axis must tile on entry.
    """
    g, sizes = self.graph, self.mesh.axis_sizes
    rule = g.rules[o]
    operands, results = g.operands[o], g.results[o]
    num_axes = len(sizes)
    factor_of_axis = [UNSHARDED] * num_axes
    scatter = [False] * num_axes
    factor_tiles = [1] * len(rule.sizes)
    for a in range(num_axes):
      res_f = UNSHARDED
      for r, v in enumerate(results):
        d = state[v, a] if v >= 0 else -1
        if d >= 0 and rule.results[r][d] >= 0:
          res_f = rule.results[r][d]
          break
      op_fs = []
      for p, v in enumerate(operands):
        if v >= 0 and rule.operands[p] is not None:
          d = state[v, a]
          if d >= 0 and rule.operands[p][d] >= 0:
            op_fs.append(rule.operands[p][d])
      reductions = [f for f in op_fs if rule.reduction[f]]
      f = UNSHARDED
      if g.prims[o] == "scan_stack":
        # The loop stacks each step's result in the layout the body made
        # it in; the stacked result is resharded after the loop.
        res_f = op_fs[0] if op_fs else UNSHARDED
      if res_f >= 0:
        f = res_f
        if res_f not in op_fs and reductions:
          f, scatter[a] = reductions[0], True
      elif reductions:
        f = max(set(reductions), key=reductions.count)
      if f >= 0 and rule.sizes[f] % (factor_tiles[f] * sizes[a]) == 0:
        factor_of_axis[a] = f
        factor_tiles[f] *= sizes[a]
      else:
        scatter[a] = False
    # Scattering a partial sum over axis a into a result dim already tiled by
    # a more minor axis b would need the tiles reordered; the partitioner
    # computes that dim without b instead (b's operands are gathered).
    for a in range(num_axes):
      if not scatter[a]:
        continue
      for r, v in enumerate(results):
        d = state[v, a] if v >= 0 else -1
        if d < 0:
          continue
        for b in range(a + 1, num_axes):
          if state[v, b] == d and factor_of_axis[b] == rule.results[r][d]:
            factor_of_axis[b] = UNSHARDED
    wants = []
    for p, v in enumerate(operands):
      dims = rule.operands[p]
      if v < 0 or dims is None:
        wants.append(None)
        continue
      wants.append([dims.index(f) if f >= 0 and f in dims else UNSHARDED
                    for f in factor_of_axis])
    return factor_of_axis, scatter, wants

  def transition(self, comms: list, have, want, local: float, value: int) -> float:
    """Collectives that move an array from layout `have` to `want` (per-axis
    tiled dims); returns its bytes per device after.

    As XLA reshards: where every device's target tile lies within some
    device's current tile (each dim's tile count only refined), it slices
    and, unless the tile is its own, collective-permutes the slice. Else axes
    leaving the array are all-gathered (dim by dim), axes moving between dims
    exchanged all-to-all (unless another axis arrives on their target dim:
    then the whole array is gathered), axes arriving sliced for free; a dim
    whose axes are swapped for others is first permuted, then gathered only
    as far as the coarser target. Tiles of one dim nest major to minor in
    mesh order, so keeping a minor axis while dropping a major one, or adding
    a major axis under a kept minor one, reorders tiles: a collective-permute
    first.
    """
    sizes = self.mesh.axis_sizes
    # An axis of one device tiles nothing: which dim it names is moot.
    have = [UNSHARDED if n == 1 else int(h) for h, n in zip(have, sizes)]
    want = [UNSHARDED if n == 1 else int(w) for w, n in zip(want, sizes)]
    a2a_mask = permute_mask = moved = 0
    gathers: dict[int, int] = {}  # dim -> the axes leaving it
    arrivals: dict[int, int] = {}  # dim -> the axes arriving on it
    # Tiles per dim: before, after, and of the axes tiling the array both.
    have_tiles: dict[int, int] = {}
    want_tiles: dict[int, int] = {}
    kept_tiles: dict[int, int] = {}
    after = local
    for a in range(len(sizes)):
      h, w = have[a], want[a]
      if h >= 0:
        have_tiles[h] = have_tiles.get(h, 1) * sizes[a]
      if w >= 0:
        want_tiles[w] = want_tiles.get(w, 1) * sizes[a]
      if h >= 0 and w >= 0:
        kept_tiles[h] = kept_tiles.get(h, 1) * sizes[a]
      if h == w:
        continue
      moved |= 1 << a
      if h >= 0 and w < 0:
        gathers[h] = gathers.get(h, 0) | 1 << a
        after *= sizes[a]
      elif h >= 0:
        a2a_mask |= 1 << a
      else:
        arrivals[w] = arrivals.get(w, 0) | 1 << a
        after /= sizes[a]
    for d in have_tiles:
      on_h = [a for a in range(len(sizes)) if have[a] == d]
      kept = [a for a in on_h if want[a] == d]
      on_w = [a for a in range(len(sizes)) if want[a] == d]
      if kept != on_h[:len(kept)] or on_w[:len(kept)] != kept:
        for a in on_h + on_w:
          permute_mask |= 1 << a
    if not (gathers or a2a_mask or permute_mask):
      return after  # slices of what each device holds
    target = _layout_code(want)
    if all(want_tiles.get(d, 1) % t == 0 for d, t in have_tiles.items()):
      self.emit(comms, PERMUTE, moved | permute_mask, after, value, target)
      return after
    leaving = {have[a] for a in range(len(sizes)) if a2a_mask >> a & 1}
    incoming = {want[a] for a in range(len(sizes)) if moved >> a & 1}
    if any(d in leaving and d not in incoming for d in gathers):
      # A dim losing one axis to another dim and another to a gather, with
      # none coming in: XLA's partitioner finds no collective for it and
      # rematerialises the whole array, then slices.
      whole = local * math.prod(have_tiles.values())
      self.emit(comms, ALL_GATHER, moved, whole, value, target)
      return after
    if any(a2a_mask >> a & 1 and want[a] in arrivals for a in range(len(sizes))):
      # An axis moving to a dim that another axis arrives on too: no
      # all-to-all makes those tiles; XLA gathers the whole array, then slices.
      whole = local * math.prod(have_tiles.values())
      sharded = sum(1 << a for a in range(len(sizes)) if have[a] >= 0)
      self.emit(comms, ALL_GATHER, sharded, whole, value, target)
      return after
    # If the target's tiles lie within those of the axes that stay, one
    # permute moves them into place before gathering.
    permuted = True
    if (a2a_mask or permute_mask or any(d in arrivals for d in gathers)) and all(
        want_tiles.get(d, 1) % t == 0 for d, t in kept_tiles.items()):
      self.emit(comms, PERMUTE, moved | permute_mask, local, value, target)
      a2a_mask = 0
    elif permute_mask:
      self.emit(comms, PERMUTE, permute_mask, local, value, target)
    else:
      permuted = False
    # An all-gather concatenates along one dim: XLA gathers dims one at a
    # time, the last first, each result the input of the next. Unpermuted,
    # each step's result is a layout of its own, which every reader that
    # passes through it shares (XLA caches reshards per value and layout).
    gathered = local
    step = list(have)
    for d in sorted(gathers, reverse=True):
      grow = self.group_size[gathers[d]]
      if d in arrivals:  # gathered only to the target's tiles
        grow /= self.group_size[arrivals[d]]
      if grow > 1:
        gathered *= grow
        for a in range(len(sizes)):
          if gathers[d] >> a & 1:
            step[a] = UNSHARDED
        key = target if permuted else _layout_code(step)
        self.emit(comms, ALL_GATHER, gathers[d], gathered, value, key)
    # Then one all-to-all per (source dim, target dim) of the axes moving.
    pairs: dict[tuple[int, int], int] = {}
    for a in range(len(sizes)):
      if a2a_mask >> a & 1:
        pair = (have[a], want[a])
        pairs[pair] = pairs.get(pair, 0) | 1 << a
    for mask in pairs.values():
      self.emit(comms, ALL_TO_ALL, mask, gathered, value, target)
    return after

  def op_cost(self, state: State, o: int) -> OpCost:
    """Cost of op o under `state`."""
    return self.entries[int(self.entry_ids(state, np.array([o]))[0])]

  def entry_ids(self, state: State, ops: np.ndarray) -> np.ndarray:
    """Memo entry ids of the costs of `ops` [n] under `state`.

    Ops of one class in the same layouts share an entry, so the repeated
    layers of a model are costed once. Entries are found by a compiled
    lookup (`kernels.find_entries`); what it misses is looked up, and
    priced if new, by its exact key.
    """
    ops = np.asarray(ops, np.int64)
    find = lambda ops: kernels.find_entries(  # noqa: E731
        state, self.member_table, self.op_class, ops, self._slot_hash, self._slot_entry,
        self._e_class, self._e_rows)
    ids, hashes = find(ops)
    miss = np.flatnonzero(ids < 0)
    if not len(miss):
      return ids
    # Price one op per new layout hash, then look the misses up again; what
    # still misses (a hash collision) is found by its exact key.
    _, first = np.unique(hashes[miss], return_index=True)
    for i in miss[first].tolist():
      self._exact(state, int(ops[i]), hashes[i])
    ids[miss] = find(ops[miss])[0]
    for i in np.flatnonzero(ids < 0).tolist():
      ids[i] = self._exact(state, int(ops[i]), hashes[i])
    return ids

  def _exact(self, state: State, o: int, key_hash: np.uint64) -> int:
    """The entry of op o under `state` by its exact key; priced if new."""
    rows = state[self.member_table[o]]
    key = self.op_class[o].tobytes() + rows.tobytes()
    entry = self.memo.get(key)
    if entry is None:
      entry = self.memo[key] = self._register(self._op_cost(state, o), o, rows, key_hash)
    return entry

  def _register(self, c: OpCost, o: int, rows: np.ndarray, key_hash: np.uint64) -> int:
    k = len(self.entries)
    if k == len(self._e_time):  # grow geometrically
      self._grow(("_e_time", "_e_flops", "_e_foot", "_e_comms", "_e_class", "_e_rows",
                  "_e_hash", "_e_reshard", "_c_start", "_c_end"), 2 * k)
    rows_at = int(self._c_end[k - 1]) if k else 0
    while rows_at + len(c.comms) > len(self._c_kind):
      self._grow(("_c_kind", "_c_mask", "_c_bytes", "_c_seconds"), 2 * len(self._c_kind))
    for r, (kind, mask, nbytes, seconds, _, _) in enumerate(c.comms, rows_at):
      self._c_kind[r], self._c_mask[r], self._c_bytes[r], self._c_seconds[r] = (
          kind, mask, nbytes, seconds)
    self._c_start[k], self._c_end[k] = rows_at, rows_at + len(c.comms)
    self._e_reshard[k] = any(position >= 0 for *_, position, _ in c.comms)
    self.entries.append(c)
    self._e_time[k], self._e_flops[k], self._e_comms[k] = c.time, c.flops, bool(c.comms)
    self._e_foot[k] = 0.0
    self._e_foot[k, :len(c.footprint)] = c.footprint
    self._e_class[k], self._e_rows[k], self._e_hash[k] = self.op_class[o], rows.ravel(), key_hash
    if 2 * (k + 1) > len(self._slot_hash):  # keep the table at most half full
      self._slot_hash = np.zeros(4 * len(self._slot_hash), np.uint64)
      self._slot_entry = np.full(len(self._slot_hash), -1, np.int64)
      kernels.insert_entries(self._slot_hash, self._slot_entry, self._e_hash[:k + 1],
                             np.arange(k + 1))
    else:
      kernels.insert_entries(self._slot_hash, self._slot_entry, self._e_hash[k:k + 1],
                             np.array([k]))
    return k

  def _grow(self, names: tuple[str, ...], n: int) -> None:
    """Resizes the named per-entry (or per-row) arrays to n rows."""
    for name in names:
      a = getattr(self, name)
      setattr(self, name, np.resize(a, (n,) + a.shape[1:]))

  def _op_cost(self, state: State, o: int) -> OpCost:
    g, sizes = self.graph, self.mesh.axis_sizes
    rule = g.rules[o]
    operands, results = g.operands[o], g.results[o]
    if self.dead[o]:
      return OpCost(0.0, 0.0, [], {}, (0.0,) * len(results),
                    tuple(None if v < 0 else tuple(int(d) for d in state[v]) for v in results))
    num_axes = len(sizes)
    comms: list[tuple[int, int, float, float, int, int]] = []
    factor_of_axis, _, wants = self.layout(state, o)
    # Operands: gather or exchange what the factor layout does not match.
    hbm = 0.0
    reshards = {}
    for p, (v, want_row) in enumerate(zip(operands, wants)):
      if want_row is None:
        continue
      have, local = state[v], self.local_bytes(state, v)
      if g.prims[o] == "scan_slice" and any(int(d) == 0 for d in have):
        # XLA makes only the step dim whole before the loop (its axes moved
        # to the dims they are wanted on where those are free, else
        # gathered); the rest of the reshard happens to each step's slice.
        held = {int(d) for d in have if int(d) > 0}
        whole = [int(d) if int(d) != 0 else
                 int(w) if int(w) > 0 and int(w) not in held else UNSHARDED
                 for d, w in zip(have, want_row)]
        local = self.transition(comms, have, whole, local, p)
        inner: list = []
        steps = g.shapes[v][0]
        hbm += self.transition(inner, whole, want_row, local / steps, p) * steps
        comms += [(k, m, b, sec * steps, q, t) for k, m, b, sec, q, t in inner]
      else:
        hbm += self.transition([] if self.free[v] else comms, have, want_row, local, p)
      if any(int(state[v, a]) != w for a, w in enumerate(want_row)):
        reshards[p] = tuple(want_row)
    # Results: combine partial sums, then match the result's own layout.
    footprint, naturals = [], []
    for r, v in enumerate(results):
      if v < 0:
        footprint.append(0.0)
        naturals.append(None)
        continue
      dims = rule.results[r]
      hbm += self.local_bytes(state, v)
      reduce_mask = scatter_mask = 0
      natural = [UNSHARDED] * num_axes
      for a in range(num_axes):
        f = factor_of_axis[a]
        if f >= 0 and rule.reduction[f]:
          if state[v, a] >= 0:
            scatter_mask |= 1 << a
          else:
            reduce_mask |= 1 << a
        elif f >= 0 and f in dims:
          natural[a] = dims.index(f)
      if scatter_mask and not self.hw.reduce_scatter:
        # All-reduce the whole partial result, then keep this device's tile.
        reduce_mask |= scatter_mask
        scatter_mask = 0
      natural_bytes = float(g.nbytes[v]) / math.prod(
          sizes[a] for a in range(num_axes) if natural[a] >= 0)
      # One all-reduce per reduced factor (XLA reduces dim by dim), over
      # every axis that tiles it.
      by_factor: dict[int, int] = {}
      for a in range(num_axes):
        if reduce_mask >> a & 1:
          f = factor_of_axis[a]
          by_factor[f] = by_factor.get(f, 0) | 1 << a
      widen = self.reduced_itemsize[v] / self.itemsize[v]
      for mask in by_factor.values():
        self.emit(comms, ALL_REDUCE, mask, natural_bytes * widen)
      if scatter_mask:
        for a in range(num_axes):
          if scatter_mask >> a & 1:
            natural[a] = state[v, a]
        natural_bytes /= self.group_size[scatter_mask]
        self.emit(comms, REDUCE_SCATTER, scatter_mask, natural_bytes)
      self.transition(comms, natural, state[v], natural_bytes, -1)
      naturals.append(tuple(int(d) for d in natural))
      foot = max(natural_bytes, self.local_bytes(state, v))
      w = self.wide[v]
      if w >= 0:  # and its broadcast, in the reader's layout and its own dtype
        foot += self.local_bytes(state, w) * self.itemsize[v] / self.itemsize[w]
      footprint.append(foot)
    tiles = 1
    for a in range(num_axes):
      if factor_of_axis[a] >= 0:
        tiles *= sizes[a]
    flops = float(g.flops[o]) / tiles
    if g.prims[o] in ("dot_general", "conv_general_dilated"):
      peak = self.hw.matmul_flops(int(self.itemsize[operands[0]])
                                  if operands[0] >= 0 else 4)
    else:  # vector units: an order of magnitude below the matrix units
      peak = self.hw.fp32_flops / 16
    time = max(flops / peak, hbm / self.hw.hbm_bandwidth)
    trips = int(g.trips[o])
    if trips > 1:  # A scan body's op: every step pays; the program holds one copy.
      time, flops = time * trips, flops * trips
      comms = [(k, m, b, sec * trips, p, t) for k, m, b, sec, p, t in comms]
    return OpCost(time, flops, comms, reshards, tuple(footprint), tuple(naturals))

  # -- whole state ---------------------------------------------------------

  def value_bytes(self, state: State) -> np.ndarray:
    """[V] bytes per device of every value."""
    tiles = np.where(state >= 0, self.sizes[None, :], 1).prod(axis=1)
    return self.graph.nbytes / tiles


# Most classes of result buffers `Tracker.peak` matches temporaries to.
_CLASSES = 64


class Tracker:
  """A running cost of a state, refreshed incrementally after actions.

  Memory is a timeline over op indices of the temporaries alive: each
  intermediate's buffer from producer to last reader, and each resharded
  copy of an operand from its first to its last reader (XLA computes one
  copy per value and layout and reuses it, forward and backward). Compute,
  FLOPs and buffers are updated as array operations over the ops an action
  touches; only ops that talk (collectives) are visited one by one.
  """

  def __init__(self, model: CostModel, state: State):
    self.model = model
    self.state = state
    g = model.graph
    self.bytes = np.zeros((len(KINDS), model.masks))
    self.count = np.zeros((len(KINDS), model.masks), np.int64)
    self.seconds = np.zeros((len(KINDS), model.masks))
    # Late collectives per kind and axes, combined into one (see CostModel),
    # and the inputs they hold: (kind, mask) -> {op: (first op held, bytes,
    # last reader of its result, result bytes held at the collective)},
    # and their share of the memory timeline.
    self.combined = np.zeros((len(KINDS), model.masks), np.int64)
    self.pending: dict[tuple[int, int], dict[int, tuple[int, float, int, float]]] = {}
    self.pending_live: dict[tuple[int, int], np.ndarray] = {}
    self.dirty: set[tuple[int, int]] = set()
    # A resharded copy (`CostModel.copy_key`) -> its readers, and the
    # seconds charged for it.
    self.reshards: dict[tuple, list[int]] = {}
    self.charged: dict[tuple, float] = {}
    local = model.value_bytes(state)
    self.held = np.where(model.resident, local, 0.0)  # [V] resident bytes
    self.resident = float(self.held.sum())
    self.args = float(self.held[model.is_input].sum())
    ops = np.arange(g.num_ops)
    self.op_ids = model.entry_ids(state, ops) if g.num_ops else np.zeros(0, np.int64)
    self._mark = np.zeros(g.num_ops, bool)  # `kernels.gather`'s scratch
    self.compute = float(model._e_time[self.op_ids].sum())
    self.flops = float(model._e_flops[self.op_ids].sum())
    # [V] footprint of each temporary, and the timeline they make.
    self.foot = np.zeros(g.num_values)
    self.live = np.zeros(g.num_ops + 1)
    none = np.zeros(0, np.int64)
    self._retalk(ops, none, self.op_ids)
    self._feet(ops, self.op_ids)

  @property
  def ops(self) -> list[OpCost]:
    """Per op, its current cost."""
    return [self.model.entries[i] for i in self.op_ids]

  def _span(self, ops: list[int], nbytes: float) -> None:
    self.live[min(ops):max(ops) + 1] += nbytes

  def _retalk(self, ops: np.ndarray, old: np.ndarray, new: np.ndarray) -> None:
    """Swaps the collectives of `ops` from entries `old` (none if empty) to
    `new`. Plain ones are tallied at once; reshards (shared between
    readers) and late reductions (combined) are settled op by op."""
    model = self.model
    talks = model._e_comms[new] if not len(old) else model._e_comms[old] | model._e_comms[new]
    special = model.late[ops] | model._e_reshard[new]
    if len(old):
      special |= model._e_reshard[old]
    plain = talks & ~special
    kernels.tally(old[plain] if len(old) else old, new[plain], model._c_start, model._c_end,
                  model._c_kind, model._c_mask, model._c_bytes, model._c_seconds,
                  self.bytes, self.count, self.seconds)
    for i in np.flatnonzero(talks & special).tolist():
      o = int(ops[i])
      if len(old):
        self._talk(o, model.entries[old[i]], -1)
      self._talk(o, model.entries[new[i]], 1)
    self._settle()

  def _talk(self, o: int, c: OpCost, sign: int) -> None:
    """Adds (sign 1) or removes (-1) the collectives of op o's cost c."""
    for kind, mask, nbytes, seconds, position, target in c.comms:
      if position >= 0:  # A reshard of an operand: one copy for all its readers.
        key = self.model.copy_key(o, position, kind, mask, target, nbytes)
        readers = self.reshards.get(key)
        if readers:
          self._span(readers, -nbytes)
        if sign > 0:
          readers = readers or []
          readers.append(o)
          self.reshards[key] = readers
        else:
          readers.remove(o)
          if not readers:
            del self.reshards[key]
        if readers:
          self._span(readers, nbytes)
        if sign > 0 and len(readers) == 1:
          # The copy costs what its first reader priced it at (readers inside
          # a loop price it per step); the same amount is refunded with it.
          self.charged[key] = seconds
        elif sign < 0 and not readers:
          seconds = self.charged.pop(key)
        else:
          continue
      self.bytes[kind, mask] += sign * nbytes
      self.count[kind, mask] += sign
      if position < 0 and self.model.late[o]:
        self.combined[kind, mask] += sign
        seconds -= self.model.latency[kind, mask]
        self._pend(o, kind, mask, nbytes, c.footprint[0] if c.footprint else 0.0, sign)
      self.seconds[kind, mask] += sign * seconds

  def _pend(self, o: int, kind: int, mask: int, nbytes: float, out: float,
            sign: int) -> None:
    """Tracks a late reduction of op o. XLA combines the group's reductions
    into one collective after the last of them is produced, so each input
    lives until then: a program output's unreduced input as a temporary of
    its own from the producer, an intermediate's buffer past its last
    reader. The combined collective makes every result (`out` bytes) at
    once, beside its inputs; a sliced result whose readers precede it in
    program order is then held there too."""
    model = self.model
    v = model.graph.results[o][0] if model.graph.results[o] else -1
    if kind not in (ALL_REDUCE, REDUCE_SCATTER) or v < 0:
      return
    group = self.pending.setdefault((kind, mask), {})
    self.dirty.add((kind, mask))
    if sign < 0:
      del group[o]
      return
    if kind == REDUCE_SCATTER:
      nbytes *= model.group_size[mask]
    else:  # Buffers at the value's own dtype, however wide the wire.
      nbytes *= model.itemsize[v] / model.reduced_itemsize[v]
    elements = nbytes / model.itemsize[v]

    def sliced(v: int) -> bool:  # stored smaller than reduced
      return elements > model.local_bytes(self.state, v) / model.itemsize[v] * (1 + 1e-9)

    # Follow the result through ops that only relabel it (XLA makes them
    # bitcasts or folds them into the collective's readers); `whole` is the
    # last unsliced buffer on the way.
    whole = v
    while len(model.graph.uses[v]) == 1:
      reader = model.graph.uses[v][0][0]
      if model.graph.prims[reader] not in _RELABELS or len(model.graph.results[reader]) != 1:
        break
      v = model.graph.results[reader][0]
      whole = whole if sliced(v) else v
    # Sliced (here or by a relabel), the whole reduced result is a temporary
    # of its own beside the inputs at the collective; unsliced, a result can
    # take the buffer of what its readers make (an output, updated in place).
    if sliced(v):
      early, end = nbytes, -1
    else:
      early, end = 0.0, int(model.end[model.graph.results[o][0]])
    # The input is the reduced op's own buffer (its footprint, as computed)
    # until its last reader, then held for the collective; a result of the
    # program takes its buffer, so the input is a temporary of its own.
    held_from = int(model.end[whole]) + 1 if model.temporary[whole] else o
    group[o] = (held_from, nbytes, end, early)

  def _settle(self) -> None:
    """Redraws the memory held by the groups `_pend` changed."""
    for key in self.dirty:
      old = self.pending_live.pop(key, None)
      if old is not None:
        self.live -= old
      group = self.pending[key]
      if not group:
        continue
      last = max(group)
      held = [(a, b) for a, b, _, _ in group.values() if a <= last]
      if held:
        starts = np.array([a for a, _ in held], np.int64)
        new = np.cumsum(np.bincount(starts, np.array([b for _, b in held]),
                                    len(self.live)))
        new[last + 1:] = 0.0
        new[last] += sum(out for _, _, end, out in group.values() if end < last)
        self.pending_live[key] = new
        self.live += new
    self.dirty.clear()

  def _feet(self, ops: np.ndarray, ids: np.ndarray) -> None:
    """Sets the footprints of the results of `ops` to those of entries `ids`."""
    model = self.model
    kernels.refoot(ops, ids, model.result_table, model._e_foot, model.temporary, self.foot,
                   model.start, model.end, self.live)

  def update(self, changed: Iterable[int]) -> None:
    """Re-costs the ops around `changed` values of `self.state`."""
    model, state = self.model, self.state
    changed = np.asarray(changed if isinstance(changed, np.ndarray) else list(changed),
                         np.int64).ravel()
    if not len(changed):
      return
    ops = kernels.gather(changed, model.touch_ptr, model.touch_idx, self._mark)
    ops, old, new, time, flops = kernels.swap_entries(
        ops, model.entry_ids(state, ops), self.op_ids, model._e_time, model._e_flops)
    self.compute += time
    self.flops += flops
    self._retalk(ops, old, new)
    self._feet(ops, new)
    self.resident, self.args = kernels.reheld(
        changed, model.resident, state, model.sizes, model.graph.nbytes, self.held,
        model.is_input, self.resident, self.args)

  def talking_ops(self) -> np.ndarray:
    """[n] the ops whose current cost includes a collective or a reshard."""
    return np.flatnonzero(self.model._e_comms[self.op_ids])

  @property
  def comm_time(self) -> float:
    return float(self.seconds.sum() + self.model.latency[self.combined > 0].sum())

  @property
  def step_time(self) -> float:
    return self.compute + self.comm_time

  @property
  def peak_memory(self) -> float:
    return self.resident + self.peak()[0]

  def peak(self) -> tuple[float, int]:
    """(bytes of temporaries at the memory peak, op index of the peak).

    Before a result of the program is made, its buffer holds temporaries
    that fit in it and die before it is made, one at a time (XLA's buffer
    assignment shares live-out allocations), so a temporary with such a
    host costs nothing extra. Counted conservatively: at each point, only
    results made after every temporary alive there dies offer their buffers.
    """
    if not len(self.live):
      return 0.0, 0
    net = self.live - self._hosted()
    t = int(np.argmax(net))
    return max(float(net[t]), 0.0), t

  def _temporaries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first op, last op, bytes) of the temporary buffers a result's buffer
    may hold: values outside loops, and the inputs of combined reductions
    held until the collective."""
    model = self.model
    values = np.flatnonzero((self.foot > 0) & model.hostable)
    held = [(first, last, nbytes) for group in self.pending.values() if group
            for last in (max(group),)
            for first, nbytes, _, _ in group.values() if first <= last]
    first, last, nbytes = (np.array(x).reshape(-1) for x in zip(*held)) if held else (
        np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0))
    return (np.concatenate([model.start[values], first.astype(np.int64)]),
            np.concatenate([model.end[values], last.astype(np.int64)]),
            np.concatenate([self.foot[values], nbytes.astype(np.float64)]))

  def _hosted(self) -> np.ndarray:
    """[O + 1] bytes of temporaries that results' buffers hold."""
    model = self.model
    sizes = self.held[model.results_made]
    ascending = np.unique(sizes)
    if len(ascending) > _CLASSES:  # a geometric grid, rounded down
      sizes = np.exp2(np.floor(np.log2(np.maximum(sizes, 1.0)) * 8) / 8)
      ascending = np.unique(sizes)
    m = len(ascending)
    slot = m - 1 - np.searchsorted(ascending, sizes)  # classes largest first
    start, end, foot = self._temporaries()
    fits = m - np.searchsorted(ascending, foot, side="left")  # classes a buffer fits
    temps = np.flatnonzero((foot > 0) & (fits > 0))
    by_start = temps[np.argsort(start[temps], kind="stable")]
    by_end = temps[np.argsort(end[temps], kind="stable")]
    return kernels.hosted(len(self.live), by_start, by_end, start, end, foot, fits - 1,
                          model.results_made_at, slot, m)

  def cost(self) -> Cost:
    names = self.model.mesh.axis_names
    comm_bytes, comm_count, comm_seconds = {}, {}, {}
    for kind, mask in zip(*np.nonzero(self.count > 0)):
      key = (KINDS[kind], tuple(n for a, n in enumerate(names) if mask >> a & 1))
      comm_bytes[key] = float(self.bytes[kind, mask])
      comm_count[key] = int(self.count[kind, mask])
      comm_seconds[key] = float(self.seconds[kind, mask] + (
          self.model.latency[kind, mask] if self.combined[kind, mask] else 0.0))
    return Cost(
        step_time=self.step_time, compute_time=float(self.compute),
        comm_time=self.comm_time, flops=float(self.flops),
        comm_bytes=comm_bytes, comm_count=comm_count,
        peak_memory=self.peak_memory, argument_memory=self.args,
        comm_seconds=comm_seconds)
