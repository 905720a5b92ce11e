"""Cost model: what each op costs per device under a layout, and reshards.

For each op the model derives, per mesh axis, which factor of its rule the
axis tiles (the result's layout wins; otherwise a reduction factor tiled on
the operands; otherwise none), then charges what the SPMD partitioner emits
to make the operands fit (all-gather, all-to-all; slicing is free) and to
finish the result (all-reduce of partial sums, or reduce-scatter when the
result is itself tiled on that axis). Collective sizes are per-device result
bytes, the figure compiled HLO shows; `collectives` turns them into time on
the link each axis maps to. Compute is a roofline per op of its FLOPs and
its HBM traffic as XLA's fusions move it: a value fused into its readers is
never stored, so it costs nothing to read or write; a stored one is read by
every fusion that reads it (a fused producer duplicated into several runs
in each), and a dot whose operands XLA's dot decomposition transposes reads
a copy (`analysis.materialized`, `fusion_copies`, `canonical_copies`).

Costs are memoised per op class and layout (`Memo`); `tracker.Tracker`
sums them over a program and `analysis` says which buffers XLA keeps.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from automap._src.cost import halo
from automap._src.cost.analysis import Analysis, canonical_copies
from automap._src.cost.collectives import (
  ALL_GATHER,
  ALL_REDUCE,
  ALL_TO_ALL,
  KINDS,
  PERMUTE,
  REDUCE_SCATTER,
  ring_seconds,
  send_seconds,
  staged_seconds,
)
from automap._src.cost.compiler import Compiler
from automap._src.cost.hardware import Hardware
from automap._src.cost.memo import Memo, OpCost
from automap._src.ir import graph as graph_lib
from automap._src.ir import rules
from automap._src.ir.graph import Graph
from automap._src.sharding.mesh import MeshSpec
from automap._src.sharding.state import UNSHARDED, State


@dataclasses.dataclass(frozen=True)
class Cost:
  """Predicted cost of one sharded step, per device.

  step_time: seconds of the step as XLA runs it on the target, what every
    search minimises: compute_time + exposed_comm_time (the two equal
    where collectives run in place, as on XLA:CPU).
  compute_time: roofline time of every op (FLOPs, HBM traffic), seconds.
  comm_time: collective time, seconds.
  flops: FLOPs executed per device.
  comm_bytes: {(kind, axes): bytes} collective result bytes per device, as
    the compiled HLO shows them (a scan body's once; its time counts every step).
  comm_count: {(kind, axes): number of collectives}.
  peak_memory: bytes live at the peak, per device.
  argument_memory: bytes of arguments per device (part of peak_memory).
  comm_seconds: {(kind, axes): seconds} of comm_time.
  memory_traffic: bytes read and written in HBM per device, as XLA counts
    them (`cost_analysis()["bytes accessed"]`: each fusion's operands and
    results, each collective's; a scan body's once).
  exposed_comm_time: seconds of comm_time compute does not hide where XLA
    runs collectives asynchronously (`overlap`); all of it on XLA:CPU.
    Negative: not computed (equal to comm_time).
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
  memory_traffic: float = 0.0
  exposed_comm_time: float = -1.0

  def __post_init__(self):
    if self.exposed_comm_time < 0:
      object.__setattr__(self, "exposed_comm_time", self.comm_time)

  @property
  def total_comm_bytes(self) -> float:
    return float(sum(self.comm_bytes.values()))

  @property
  def overlapped_step_time(self) -> float:
    """compute_time + exposed_comm_time: the step with collectives
    overlapped as XLA's latency-hiding scheduler can."""
    return self.compute_time + self.exposed_comm_time

  @property
  def serial_step_time(self) -> float:
    """compute_time + comm_time: every collective in full after compute,
    as if none ran beside it."""
    return self.compute_time + self.comm_time

  def to_json(self) -> dict:
    return {
        "step_time": self.step_time, "compute_time": self.compute_time,
        "comm_time": self.comm_time, "flops": self.flops,
        "comm_bytes": [[k, list(a), b] for (k, a), b in self.comm_bytes.items()],
        "comm_count": [[k, list(a), n] for (k, a), n in self.comm_count.items()],
        "peak_memory": self.peak_memory,
        "argument_memory": self.argument_memory,
        "comm_seconds": [[k, list(a), t] for (k, a), t in self.comm_seconds.items()],
        "memory_traffic": self.memory_traffic,
        "exposed_comm_time": self.exposed_comm_time,
    }

  @classmethod
  def from_json(cls, d: dict) -> Cost:
    return cls(
        step_time=d["step_time"], compute_time=d["compute_time"],
        comm_time=d["comm_time"], flops=d["flops"],
        comm_bytes={(k, tuple(a)): b for k, a, b in d["comm_bytes"]},
        comm_count={(k, tuple(a)): n for k, a, n in d["comm_count"]},
        peak_memory=d["peak_memory"], argument_memory=d["argument_memory"],
        comm_seconds={(k, tuple(a)): t for k, a, t in d.get("comm_seconds", ())},
        memory_traffic=d.get("memory_traffic", 0.0),
        exposed_comm_time=d.get("exposed_comm_time", -1.0))


# Contractions: XLA's dot partitioner handles their partial sums.
_CONTRACTIONS = frozenset({"dot_general", "conv_general_dilated"})
# Ops whose fusions read only the part of their first operand they return.
_SLICING = frozenset({"slice", "dynamic_slice", "gather", "scan_slice"})
# Ops XLA's partitioner chooses among several partitionings of by cost.
_LOOKUPS = frozenset({"gather", "scatter-add", "scatter_add", "scatter-max", "scatter-min"})


def _layout_code(row) -> int:
  """A layout (per-axis tiled dim, -1 for none) as one int: 4 bits an axis."""
  return sum((d + 1) << (4 * a) for a, d in enumerate(row))


class CostModel:
  """Prices ops of one graph on one mesh and hardware, as one compiler
  compiles them (default: the hardware's platform's, `Hardware.compiler`).

  `op_cost` / `entry_ids` price ops under a state (memoised per op class and
  layout in `memo`); `Tracker` sums them into a running total that `update`
  refreshes after an action.
  """

  def __init__(self, graph: Graph, mesh: MeshSpec, hardware: Hardware,
               compiler: Compiler | None = None):
    if compiler is not None and not isinstance(compiler, Compiler):
      raise TypeError(
          f"compiler must be a Compiler (compiler_for(platform) gives XLA's for a "
          f"platform name) or None for the hardware's platform's, got {compiler!r}.")
    self.graph, self.mesh, self.hw = graph, mesh, hardware
    self.compiler = compiler if compiler is not None else hardware.compiler
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
    self.itemsize = np.array([graph_lib.itemsize(d) for d in graph.dtypes])
    # [V] bytes per element an all-reduce of the value moves.
    self.reduced_itemsize = np.array([
        4 if self.compiler.reduce_in_f32 and size == 2 and graph_lib.is_float(d) else size
        for size, d in zip(self.itemsize, graph.dtypes)])
    a = self.analysis = Analysis.of(
        graph, self.compiler.fuses_shared_producers, self.compiler.expensive)
    # The analysis's arrays the search and the reports read off the model.
    self.start, self.end, self.resident, self.temporary = a.start, a.end, a.resident, a.temporary
    self.dead, self.late, self.free, self.op_class = a.dead, a.late, a.free, a.op_class
    # [kinds, masks] seconds of latency of one collective.
    self.latency = np.array(
        [[self.comm_time(k, m, 0.0) for m in range(self.masks)] for k in range(len(KINDS))])
    self.memo = Memo(a.result_table.shape[1], a.member_table.shape[1] * n)

  # -- collectives ---------------------------------------------------------

  def emit(self, comms: list, kind: int, mask: int, nbytes: float,
           position: int = -1, target: int = 0, seconds: float | None = None) -> None:
    """Records a collective (its time `comm_time`'s unless given);
    `position` >= 0 marks a reshard of that operand to layout `target` (a
    code), which XLA performs once however many ops read the resharded copy.
    The last field, HBM bytes of the copies laying its buffers out, is set
    by `transition`."""
    mask &= self.nontrivial
    if mask:
      if seconds is None:
        seconds = self.comm_time(kind, mask, nbytes)
      comms.append((kind, mask, nbytes, seconds, position, target, 0.0))

  def copy_key(self, o: int, position: int, kind: int, mask: int, target: int,
               nbytes: float) -> tuple:
    """Which resharded copy op o reads at operand `position`: XLA makes one
    per value and layout for all its readers in one computation (each cond
    branch and while body its own), and each loop its own of what it scans."""
    g = self.graph
    loop = o if g.prims[o] == "scan_slice" else -1
    return (g.operands[o][position], kind, mask, target, nbytes, loop, int(g.regions[o]))

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

  def relayout_time(self, nbytes: float) -> float:
    """Seconds of the copies that lay a collective's buffers out, `nbytes`
    of HBM traffic (`relayout_bytes`): fusions of their own, at HBM
    bandwidth."""
    return nbytes / self.hw.hbm_bandwidth

  def combined(self, o: int, kind: int) -> bool:
    """Whether op o's plain collective of `kind` joins the one its kind's
    late collectives are combined into (`analysis.late_ops`), paying one
    latency for all: late, and a kind the compiler combines."""
    return bool(self.late[o]) and kind in self.compiler.combines

  def send_time(self, mask: int, nbytes: float) -> float:
    """Seconds for each device to send `nbytes` to another over the axes in
    `mask` (a collective-permute: one hop on the slowest link they span)."""
    if self.cross_node[mask]:
      return send_seconds(nbytes, self.hw.network_bandwidth, self.hw.network_latency)
    return send_seconds(nbytes, self.hw.link_bandwidth, self.hw.link_latency)

  def exchange_halos(self, comms: list, o: int, window, axes: list[int],
                     want) -> float:
    """Collectives that bring each device the part of operand
    `window.operand` (in layout `want`) its window reads, the window's dim
    tiled over `axes` (`halo.windowed_exchange`); returns the bytes moved."""
    g, sizes = self.graph, self.mesh.axis_sizes
    shards = math.prod(sizes[a] for a in axes)
    extent = g.operand_shapes[o][window.operand][window.dim]
    v = g.operands[o][window.operand]
    local = float(g.nbytes[v]) / math.prod(sizes[a] for a, d in enumerate(want) if d >= 0)
    permutes = halo.windowed_exchange(extent, shards, window.low, window.high,
                                      window.stride)
    if permutes is None:  # the dim gathered whole, then sliced
      whole = [UNSHARDED if a in axes else d for a, d in enumerate(want)]
      self.emit(comms, ALL_GATHER, sum(1 << a for a in axes), local * shards,
                window.operand, _layout_code(whole))
      return local * shards
    moved = 0.0
    for p in permutes:
      nbytes = p.size * local * shards / extent
      mask = _pair_axes(axes, sizes, p.pairs)
      self.emit(comms, PERMUTE, mask, nbytes, seconds=self.send_time(mask, nbytes))
      moved += nbytes
    return moved

  def _moved_factor(self, state: State, o: int, a: int) -> int:
    """The factor axis a tiles while op o computes, its result tiled over a
    by a factor the op keeps whole (`Rule.moved`): XLA moves the dim's tiles
    to the first other dim whose size their product with its own divides
    (`GetFirstTargetDimToMoveShardingTiles`), else gathers it."""
    g, sizes = self.graph, self.mesh.axis_sizes
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

  # -- one op --------------------------------------------------------------

  def _tiles(self, state: State, v: int) -> int:
    """Devices value v is tiled over (1 for a literal)."""
    if v < 0:
      return 1
    return math.prod(n for n, d in zip(self.mesh.axis_sizes, state[v]) if d >= 0)

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
    windowed = {w.factor for w in rule.windows}
    slicing = bool(windowed) and g.prims[o] in ("slice", "split") and (
        self._tiles(state, operands[0]) > max(self._tiles(state, v) for v in results))
    first_result = len(rule.operands)
    for a in range(num_axes):
      res_f = UNSHARDED
      for r, v in enumerate(results):
        d = state[v, a] if v >= 0 else -1
        if d >= 0 and rule.results[r][d] >= 0:
          res_f = self._factor_on(state, o, first_result + r, v, a)
          if res_f >= 0:
            break
      op_fs = []
      for p, v in enumerate(operands):
        if v >= 0 and rule.operands[p] is not None:
          d = state[v, a]
          if d >= 0 and rule.operands[p][d] >= 0:
            f = self._factor_on(state, o, p, v, a)
            if f >= 0:
              op_fs.append(f)
      reductions = [f for f in op_fs if rule.reduction[f]]
      if res_f in rule.moved:
        res_f = self._moved_factor(state, o, a)
      f = UNSHARDED
      if g.prims[o] in rules.REDUCTIONS:
        # XLA reduces each device's tile as the operand holds it, combines
        # the partial sums over the reduced dims' axes, then reshards the
        # (smaller) result to its own layout: it never reshards the operand
        # to the result's (`SpmdPartitioningVisitor::HandleReduce`).
        res_f, reductions = UNSHARDED, []
        if op_fs:
          f = op_fs[0]
          scatter[a] = bool(rule.reduction[f]) and g.prims[o] not in rules.ARG_REDUCTIONS and any(
              v >= 0 and state[v, a] >= 0 for v in results)
      elif g.prims[o] == "scan_stack":
        # The loop stacks each step's result in the layout the body made
        # it in; the stacked result is resharded after the loop.
        res_f = op_fs[0] if op_fs else UNSHARDED
      if res_f >= 0:
        f = res_f
        if res_f not in op_fs and reductions:
          f, scatter[a] = reductions[0], True
      elif reductions:
        f = max(set(reductions), key=reductions.count)
      elif slicing and windowed.intersection(op_fs):
        # A slice of an operand with more tiles than its result is made in
        # the operand's layout, then resharded (XLA's HandleSlice).
        f = min(windowed.intersection(op_fs))
      if f >= 0 and rule.sizes[f] % (factor_tiles[f] * sizes[a]) == 0:
        factor_of_axis[a] = f
        factor_tiles[f] *= sizes[a]
      else:
        scatter[a] = False
    # Scattering a partial sum over axis a into a result dim already tiled by
    # a more minor axis b would need the tiles reordered; the partitioner
    # computes that dim without b instead (b's operands are gathered).
    # A reduction keeps b and all-reduces over a instead, then reshards.
    for a in range(num_axes):
      if not scatter[a]:
        continue
      for r, v in enumerate(results):
        d = state[v, a] if v >= 0 else -1
        if d < 0:
          continue
        for b in range(a + 1, num_axes):
          if g.prims[o] in rules.REDUCTIONS and factor_of_axis[b] == rule.results[r][d]:
            scatter[a] = False
          elif state[v, b] == d and factor_of_axis[b] == rule.results[r][d]:
            factor_of_axis[b] = UNSHARDED
    for member, e, minor in rule.minor:
      # A compound dim's minor factor is tiled only under a whole major
      # factor, by axes after the major's (mesh order); else not at all.
      major = rule.member_dims(member)[e]
      on_major = [a for a in range(num_axes) if factor_of_axis[a] == major]
      on_minor = [a for a in range(num_axes) if factor_of_axis[a] == minor]
      if on_minor and (math.prod(sizes[a] for a in on_major) != rule.sizes[major]
                       or max(on_major) > min(on_minor)):
        for a in on_minor:
          factor_of_axis[a] = UNSHARDED
          scatter[a] = False
    wants = []
    if g.prims[o] in _LOOKUPS:
      factor_of_axis, scatter = self._cheapest_lookup(state, o, factor_of_axis, scatter)
    for p, v in enumerate(operands):
      dims = rule.operands[p]
      if v < 0 or dims is None:
        wants.append(None)
        continue
      wants.append([rule.dim_of(p, f) if f >= 0 else UNSHARDED for f in factor_of_axis])
    return factor_of_axis, scatter, wants

  def _factor_on(self, state: State, o: int, member: int, v: int, a: int) -> int:
    """The factor axis a tiles on value v, member `member` of op o: its
    dim's major factor, or on a compound dim (`Rule.minor`) the one the
    axes before a leave it."""
    rule = self.graph.rules[o]
    d = int(state[v, a])
    if not rule.minor:
      return rule.member_dims(member)[d]
    sizes = self.mesh.axis_sizes
    return rule.factor_on(member, d, [sizes[b] for b in range(a) if state[v, b] == d], sizes[a])

  def _cheapest_lookup(self, state: State, o: int, factor_of_axis: list,
                       scatter: list) -> tuple[list, list]:
    """A gather or scatter whose members offer an axis two factors (a table
    tiled on the rows it is read from, its indices on the batch) can be
    partitioned either way; XLA dry-runs each way and takes the one of least
    (memory, communication) (`GatherPartitionMethodsOrderedByCost` and its
    scatter twin, by `EvaluatePartitionCost`)."""
    g, sizes = self.graph, self.mesh.axis_sizes
    rule = g.rules[o]
    offered: dict[int, list[int]] = {}  # factor -> the axes members offer it on
    for a in range(len(sizes)):
      for p, v in enumerate(g.operands[o]):
        d = int(state[v, a]) if v >= 0 and rule.operands[p] is not None else -1
        if d >= 0 and rule.operands[p][d] >= 0 and rule.operands[p][d] != factor_of_axis[a]:
          offered.setdefault(rule.operands[p][d], []).append(a)
    choice = (factor_of_axis, scatter)
    best = self._lookup_cost(state, o, factor_of_axis)
    for f, axes in sorted(offered.items()):  # one method: every axis it can have
      other = [f if a in axes else g_ for a, g_ in enumerate(factor_of_axis)]
      if rule.sizes[f] % math.prod(sizes[a] for a, h in enumerate(other) if h == f):
        continue
      cost = self._lookup_cost(state, o, other)
      if cost < best:
        best, choice = cost, (other, [s and a not in axes for a, s in enumerate(scatter)])
    return list(choice[0]), list(choice[1])

  def _lookup_cost(self, state: State, o: int, factor_of_axis: list) -> tuple[float, float]:
    """XLA's estimate of one partitioning of op o: the most bytes one of the
    instructions it emits makes per device (the partitioned op's result, a
    collective's), then the bytes its collectives make. Operands XLA makes
    anew in any layout (a broadcast zero) cost nothing."""
    g, sizes = self.graph, self.mesh.axis_sizes
    rule = g.rules[o]
    peak = moved = 0.0
    for p, v in enumerate(g.operands[o]):
      dims = rule.operands[p]
      if v < 0 or dims is None or self.free[v]:
        continue
      want = [dims.index(f) if f >= 0 and f in dims else UNSHARDED for f in factor_of_axis]
      comms: list = []
      self.transition(comms, state[v], want, self.local_bytes(state, v), p)
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

  def transition(self, comms: list, have, want, local: float, value: int,
                 shape: tuple[int, ...] | None = None,
                 fused: tuple[bool, bool] = (False, False)) -> float:
    """Collectives that move an array from layout `have` to `want` (per-axis
    tiled dims); returns its bytes per device after. Given the array's
    `shape`, each collective also carries the HBM bytes of the copies the
    compiler lays its buffers out with (`relayout_bytes`), `fused` saying
    whether the array's producer and its readers are loop fusions that
    take the first and last copies in.

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
    # Per collective: its entry in comms, whether its operand and result are
    # relaid, and their bytes.
    steps: list[tuple[int, bool, bool, float, float]] = []
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
        at = len(comms)
        self.emit(comms, ALL_GATHER, gathers[d], gathered, value, key)
        if len(comms) > at:  # relaid unless every dim before d is one element here
          copied = self.compiler.major_collective_dims and shape is not None and any(
              shape[e] > math.prod(sizes[a] for a in range(len(sizes)) if step[a] == e)
              for e in range(d))
          steps.append((at, copied, copied, gathered / grow, gathered))
    # Then one all-to-all per (source dim, target dim) of the axes moving.
    pairs: dict[tuple[int, int], int] = {}
    for a in range(len(sizes)):
      if a2a_mask >> a & 1:
        pair = (have[a], want[a])
        pairs[pair] = pairs.get(pair, 0) | 1 << a
    for mask in pairs.values():
      at = len(comms)
      self.emit(comms, ALL_TO_ALL, mask, gathered, value, target)
      if len(comms) > at:
        split = self.compiler.tuple_all_to_all and shape is not None
        steps.append((at, split, split, gathered, gathered))
    for (i, *_), relaid in zip(steps, relayout_bytes([s[1:] for s in steps], *fused)):
      comms[i] = comms[i][:6] + (relaid,)
    return after

  def op_cost(self, state: State, o: int) -> OpCost:
    """Cost of op o under `state`."""
    return self.memo.entries[int(self.entry_ids(state, np.array([o]))[0])]

  def entry_ids(self, state: State, ops: np.ndarray) -> np.ndarray:
    """Memo entry ids of the costs of `ops` [n] under `state`.

    Ops of one class in the same layouts share an entry, so the repeated
    layers of a model are costed once. Entries are found by a compiled
    lookup (`kernels.find_entries`); what it misses is looked up, and
    priced if new, by its exact key.
    """
    ops = np.asarray(ops, np.int64)
    a = self.analysis
    ids, hashes = self.memo.find(state, a.member_table, a.op_class, ops)
    miss = np.flatnonzero(ids < 0)
    if not len(miss):
      return ids
    # Price one op per new layout hash, then look the misses up again; what
    # still misses (a hash collision) is found by its exact key.
    _, first = np.unique(hashes[miss], return_index=True)
    for i in miss[first].tolist():
      self._exact(state, int(ops[i]), hashes[i])
    ids[miss] = self.memo.find(state, a.member_table, a.op_class, ops[miss])[0]
    for i in np.flatnonzero(ids < 0).tolist():
      ids[i] = self._exact(state, int(ops[i]), hashes[i])
    return ids

  def _exact(self, state: State, o: int, key_hash: np.uint64) -> int:
    """The entry of op o under `state` by its exact key; priced if new."""
    a = self.analysis
    rows = state[a.member_table[o]]
    key = a.op_class[o].tobytes() + rows.tobytes()
    entry = self.memo.get(key)
    if entry is None:
      entry = self.memo.add(key, self.price(state, o), a.op_class[o], rows, key_hash)
    return entry

  def price(self, state: State, o: int) -> OpCost:
    """Cost of op o under `state`, priced afresh (not memoised)."""
    g, sizes = self.graph, self.mesh.axis_sizes
    rule = g.rules[o]
    operands, results = g.operands[o], g.results[o]
    if self.dead[o]:
      return OpCost(0.0, 0.0, [], {}, (0.0,) * len(results),
                    tuple(None if v < 0 else tuple(int(d) for d in state[v]) for v in results),
                    0.0)
    num_axes = len(sizes)
    comms: list[tuple[int, int, float, float, int, int, float]] = []
    factor_of_axis, scatters, wants = self.layout(state, o)
    reducing = g.prims[o] in rules.REDUCTIONS
    # Operands: gather or exchange what the factor layout does not match.
    # HBM bytes as XLA's fusions move them: stored operands read once per
    # fusion the op runs in, stored results written; fused values never.
    traffic = 0.0
    # HBM bytes of the copies laying its results' collectives' buffers out
    # (`relayout_bytes`), fusions of their own beside the op's.
    relaid = 0.0
    stored, copies = self.analysis.stored, int(self.analysis.copies[o])
    reshards = {}
    reads = [0.0] * len(operands)
    once = 0.0  # stored operands' bytes, read once
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
        # Each step reads its slice (a loop body is counted once).
        once += self.transition(inner, whole, want_row, local / steps, p)
        comms += [(k, m, b, sec * steps, q, t, r) for k, m, b, sec, q, t, r in inner]
      else:
        # Its collectives carry their relaid buffers' bytes: XLA lays out
        # one resharded copy for all its readers (the tracker counts it so).
        fused = (bool(self.analysis.loop_made[v]), bool(self.analysis.loop_read[v]))
        read = self.transition([] if self.free[v] else comms, have, want_row, local, p,
                               g.shapes[v], fused)
        reads[p] = read
        if p == 0 and g.prims[o] in _SLICING:  # a fusion reads only the slice
          read = min(read, self.local_bytes(state, results[0]))
        if stored[v]:
          # In the layout the op wants (a reshard's collectives' own bytes
          # are the tracker's, once per copy). A fused-away operand read
          # resharded is taken to stay fused (XLA writes it for the
          # collective): so an op's price is that of its operands' layouts,
          # as the exact solver prices strategies.
          once += read
      if any(int(state[v, a]) != w for a, w in enumerate(want_row)):
        reshards[p] = tuple(want_row)
    if copies > 1:
      # A fused producer is duplicated into each fusion that reads it,
      # reading its operands in each, unless storing its result once
      # moves fewer bytes (what XLA's fusion cost model weighs).
      made = sum(self.local_bytes(state, v) for v in results if v >= 0)
      traffic += min(once * copies, made * (1 + copies))
    else:
      traffic += once
    if g.prims[o] == "dot_general":
      tiles = [tuple(n // math.prod(sizes[a] for a in range(num_axes) if w[a] == d)
                     for d, n in enumerate(shape)) if w is not None else shape
               for shape, w in zip(g.operand_shapes[o][:2], wants[:2])]
      for p, copied in enumerate(canonical_copies(rule, tiles)):
        if copied:
          # A copy into the decomposed dot's layout: it reads the operand
          # and writes the copy, once for the dots that read the value.
          traffic += 2 * reads[p] / max(int(self.analysis.dot_readers[operands[p]]), 1)
    for window in rule.windows:
      axes = [a for a in range(num_axes) if factor_of_axis[a] == window.factor]
      made = results[window.result]
      # XLA drops a slice nothing reads.
      if axes and operands[window.operand] >= 0 and made >= 0 and not self.analysis.unread[made]:
        # The halos arrive in buffers of their own, read by the op.
        traffic += self.exchange_halos(comms, o, window, axes, wants[window.operand])
    # Results: combine partial sums, then match the result's own layout.
    footprint, naturals = [], []
    for r, v in enumerate(results):
      if v < 0:
        footprint.append(0.0)
        naturals.append(None)
        continue
      before_results = len(comms)
      reduce_mask = scatter_mask = 0
      natural = [UNSHARDED] * num_axes
      for a in range(num_axes):
        f = factor_of_axis[a]
        if f >= 0 and rule.reduction[f]:
          if state[v, a] >= 0 and (scatters[a] or not reducing):
            scatter_mask |= 1 << a
          else:
            reduce_mask |= 1 << a
        elif f >= 0:
          natural[a] = rule.dim_of(len(rule.operands) + r, f)
      natural_bytes = float(g.nbytes[v]) / math.prod(
          sizes[a] for a in range(num_axes) if natural[a] >= 0)
      made = natural_bytes  # the partial result the op makes
      widen = self.reduced_itemsize[v] / self.itemsize[v]
      if scatter_mask and not self.compiler.reduce_scatter and g.prims[o] in _CONTRACTIONS:
        # No reduce-scatter: XLA's dot partitioner all-reduces the whole
        # partial result once per result dim tiled over axes of its
        # contracted dim (over the axes tiling that dim), each device keeps
        # its tile, and the other axes reduce that tile (as XLA:CPU
        # compiles it: `P('data', 'model')` from a contraction over both is
        # two whole all-reduces, `P(('data', 'model'))` one).
        by_dim: dict[int, int] = {}
        for a in range(num_axes):
          if scatter_mask >> a & 1:
            natural[a] = state[v, a]
            by_dim[int(state[v, a])] = by_dim.get(int(state[v, a]), 0) | 1 << a
        for mask in by_dim.values():
          self.emit(comms, ALL_REDUCE, mask, natural_bytes * widen)
        natural_bytes /= self.group_size[scatter_mask]
        scatter_mask = 0
      elif scatter_mask and not self.compiler.reduce_scatter:
        # Other reductions all-reduce the whole partial result over every
        # axis at once, then keep this device's tile.
        reduce_mask |= scatter_mask
        scatter_mask = 0
      # One all-reduce per reduced factor (XLA reduces dim by dim), over
      # every axis that tiles it.
      by_factor: dict[int, int] = {}
      for a in range(num_axes):
        if reduce_mask >> a & 1:
          f = factor_of_axis[a]
          by_factor[f] = by_factor.get(f, 0) | 1 << a
      for mask in by_factor.values():
        if g.prims[o] in rules.ARG_REDUCTIONS:
          # No all-reduce combines (value, index) pairs: XLA all-gathers
          # both partial results over the axes and reduces them again.
          gathered = natural_bytes * self.group_size[mask]
          values = gathered * self.reduced_itemsize[operands[0]] / self.itemsize[v]
          self.emit(comms, ALL_GATHER, mask, gathered)
          self.emit(comms, ALL_GATHER, mask, values)
          made = max(made, gathered + values)
        else:
          self.emit(comms, ALL_REDUCE, mask, natural_bytes * widen)
      if scatter_mask:
        for a in range(num_axes):
          if scatter_mask >> a & 1:
            natural[a] = state[v, a]
        natural_bytes /= self.group_size[scatter_mask]
        self.emit(comms, REDUCE_SCATTER, scatter_mask, natural_bytes)
      made_here = len(comms) == before_results  # else by this result's reductions
      moved = len(comms)
      self.transition(comms, natural, state[v], natural_bytes, -1, g.shapes[v],
                      (made_here and bool(self.analysis.loop_fused[o]),
                       bool(self.analysis.loop_read[v])))
      relaid += sum(c[6] for c in comms[moved:])
      if len(comms) > before_results:
        traffic += made  # the partial result, for its collectives to finish
      elif stored[v]:
        traffic += self.local_bytes(state, v)
      naturals.append(tuple(int(d) for d in natural))
      foot = max(made, self.local_bytes(state, v))
      if stored[v] and made > self.local_bytes(state, v):
        # Made whole and sliced by each reader: every fusion reading it
        # reads the whole buffer (XLA's bytes accessed).
        traffic += (made - self.local_bytes(state, v)) * int(self.analysis.readers[v])
      w = self.analysis.wide[v]
      if w >= 0:  # and its broadcast, in the reader's layout and its own dtype
        foot += self.local_bytes(state, w) * self.itemsize[v] / self.itemsize[w]
      footprint.append(foot)
    tiles = 1
    for a in range(num_axes):
      if factor_of_axis[a] >= 0:
        tiles *= sizes[a]
    flops = float(g.flops[o]) / tiles
    if g.prims[o] in ("dot_general", "conv_general_dilated"):
      itemsize = int(self.itemsize[operands[0]]) if operands[0] >= 0 else 4
      contracted = minor = 0.0
      if g.prims[o] == "dot_general" and flops > 0:
        # In the layout the op computes in: its output's elements and minor
        # dim per device, the contracted size from its FLOPs (2 per MAC).
        shape, natural = g.shapes[results[0]], naturals[0]
        elements, minor = float(np.prod(shape)), float(shape[-1]) if len(shape) else 1.0
        for a in range(num_axes):
          if natural[a] >= 0:
            elements /= sizes[a]
            if natural[a] == len(shape) - 1:
              minor /= sizes[a]
        contracted = flops / (2 * elements)
      peak = self.hw.matmul_rate(itemsize, contracted, minor)
    else:  # vector units: an order of magnitude below the matrix units
      peak = self.hw.fp32_flops / 16
    # A roofline per op, its traffic the fusions' (`traffic` above).
    time = max(flops / peak, traffic / self.hw.hbm_bandwidth) + self.relayout_time(relaid)
    trips = int(g.trips[o])
    if trips > 1:  # A scan body's op: every step pays; the program holds one copy.
      time, flops = time * trips, flops * trips
      comms = [(k, m, b, sec * trips, p, t, r) for k, m, b, sec, p, t, r in comms]
    return OpCost(time, flops, comms, reshards, tuple(footprint), tuple(naturals),
                  traffic + relaid)

  # -- whole state ---------------------------------------------------------

  def value_bytes(self, state: State) -> np.ndarray:
    """[V] bytes per device of every value."""
    tiles = np.where(state >= 0, self.sizes[None, :], 1).prod(axis=1)
    return self.graph.nbytes / tiles


def relayout_bytes(steps: list[tuple[bool, bool, float, float]], fused_before: bool,
                   fused_after: bool) -> list[float]:
  """HBM bytes per device of the fusions a compiler adds around each of one
  reshard's collectives (per collective: whether its operand is relaid,
  whether its result is, their bytes) to lay their buffers out as the
  collectives need (`Compiler.major_collective_dims`,
  `Compiler.tuple_all_to_all`). Each fusion reads the array and writes it
  anew: before the first collective unless the array's producer is a loop
  fusion that takes it in, between two collectives once (charged to the
  first), after the last unless its readers are loop fusions that take it
  in."""
  out = []
  for i, (before, after, operand, result) in enumerate(steps):
    total = 0.0
    if before and not (fused_before if i == 0 else steps[i - 1][1]):
      total += 2 * operand
    if after and (i < len(steps) - 1 or not fused_after):
      total += 2 * result
    out.append(total)
  return out


def _pair_axes(axes: list[int], sizes, pairs) -> int:
  """The mesh axes (a bitmask) along which the shards of each (source,
  target) pair differ, the shards numbered over `axes` major to minor."""
  mask = 0
  for pair in pairs:
    coords = []
    for shard in pair:
      row = []
      for a in reversed(axes):
        row.append(shard % sizes[a])
        shard //= sizes[a]
      coords.append(row[::-1])
    mask |= sum(1 << a for a, x, y in zip(axes, *coords) if x != y)
  return mask
