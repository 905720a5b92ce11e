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

from automap._src.cost import halo, layouts, partial_sums, reshard
from automap._src.cost.analysis import Analysis, canonical_copies
from automap._src.cost.collectives import (
  ALL_GATHER,
  ALL_REDUCE,
  KINDS,
  PERMUTE,
  REDUCE_SCATTER,
  ring_seconds,
  send_seconds,
  staged_seconds,
)
from automap._src.cost.collectives import levels as collective_levels
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
    # Per mask, the (size, bandwidth, latency) of its axes' levels, fastest
    # first (`collectives.levels`: an axis crossing nodes with several of
    # its devices in each runs within them, then across).
    hw = hardware
    fast, slow = (hw.link_bandwidth, hw.link_latency), (hw.network_bandwidth, hw.network_latency)

    def levels(a: int) -> list[tuple[int, float, float]]:
      return collective_levels(mesh.axis_sizes[a], strides[a], self.cross_node[1 << a],
                               hw.devices_per_node, fast, slow)

    self.stages = [sorted((level for a in range(n) if m >> a & 1 and mesh.axis_sizes[a] > 1
                           for level in levels(a)), key=lambda s: (-s[1], s[2]))
                   for m in range(self.masks)]
    self.itemsize = np.array([graph_lib.itemsize(d) for d in graph.dtypes])
    # [V] bytes per element an all-reduce of the value moves.
    self.reduced_itemsize = np.array([
        4 if self.compiler.reduce_in_f32 and size == 2 and graph_lib.is_float(d) else size
        for size, d in zip(self.itemsize, graph.dtypes)])
    a = self.analysis = Analysis.of(
        graph, self.compiler.fuses_shared_producers, self.compiler.expensive,
        self.compiler.breadth_first)
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
    branch and while body its own), each loop its own of what it scans, and
    a recomputation behind an optimization barrier its own: remat gathers
    FSDP's weights again for the backward."""
    g = self.graph
    loop = o if g.prims[o] == "scan_slice" else -1
    return (g.operands[o][position], kind, mask, target, nbytes, loop, int(g.regions[o]),
            int(g.barriers[o]))

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
                window.operand, reshard.layout_code(whole))
      return local * shards
    moved = 0.0
    for p in permutes:
      nbytes = p.size * local * shards / extent
      mask = _pair_axes(axes, sizes, p.pairs)
      self.emit(comms, PERMUTE, mask, nbytes, seconds=self.send_time(mask, nbytes))
      moved += nbytes
    return moved

  # -- one op --------------------------------------------------------------

  def tiles(self, state: State, v: int) -> int:
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
    """How op o computes under `state` (`layouts.derive`): per mesh axis the
    factor it tiles and whether its partial result is scattered over it,
    and per operand the dim each axis must tile on entry."""
    return layouts.derive(self, state, o)

  def transition(self, comms: list, have, want, local: float, value: int,
                 shape: tuple[int, ...] | None = None,
                 fused: tuple[bool, bool] = (False, False)) -> float:
    """The collectives that reshard a value from `have` to `want`, appended
    to `comms`; the bytes per device after (`reshard.transition`)."""
    return reshard.transition(self, comms, have, want, local, value, shape, fused)

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
      grouped = False  # the dot partitioner grouped devices on the contraction
      if scatter_mask and not self.compiler.reduce_scatter and g.prims[o] in _CONTRACTIONS:
        # No reduce-scatter: XLA's dot partitioner all-reduces and slices
        # (`partial_sums.finish`: as XLA:CPU compiles it, `P('data',
        # 'model')` from a contraction over both is two whole all-reduces).
        natural_bytes, made = partial_sums.finish(
            self, comms, natural, state[v], scatter_mask, reduce_mask, natural_bytes,
            float(g.nbytes[v]), widen)
        scatter_mask, grouped = 0, True
      elif scatter_mask and not self.compiler.reduce_scatter:
        # Other reductions all-reduce the whole partial result over every
        # axis at once, then keep this device's tile.
        reduce_mask |= scatter_mask
        scatter_mask = 0
      # One all-reduce per reduced factor (XLA reduces dim by dim), over
      # every axis that tiles it; after a contraction grouped on the axes
      # its result is scattered over, what the others hold partial is one
      # all-reduce over all of them (as XLA:CPU compiles it).
      by_factor: dict[int, int] = {}
      for a in range(num_axes):
        if reduce_mask >> a & 1:
          f = -1 if grouped else factor_of_axis[a]
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
