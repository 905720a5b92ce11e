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

The class holds the mesh's and hardware's tables and the collectives'
prices; `layouts` derives an op's layout, `reshard` its reshards and
`pricing` the rest of its price. Costs are memoised per op class and layout
(`Memo`); `tracker.Tracker` sums them over a program and `analysis` says
which buffers XLA keeps.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from automap._src.cost import halo, layouts, pricing, reassociate, reshard
from automap._src.cost.analysis import Analysis
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
from automap._src.ir.graph import Graph
from automap._src.sharding.mesh import MeshSpec
from automap._src.sharding.state import UNSHARDED, State


@dataclasses.dataclass(frozen=True)
class Cost:
  """Predicted cost of one sharded step, per device.

  Attributes:
    step_time: seconds of the step as XLA runs it on the target, what every
      search minimises: compute_time + exposed_comm_time (the two equal
      where collectives run in place, as on XLA:CPU).
    compute_time: roofline time of every op (FLOPs, HBM traffic), seconds.
    comm_time: collective time, seconds.
    flops: FLOPs executed per device.
    comm_bytes: {(kind, axes): bytes} collective result bytes per device, as
      the compiled HLO shows them (a scan body's once; its time counts every
      step).
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
    # Per op, as Python values: read once per collective in the search's
    # inner loop (`combined`, `copy_key`), where a numpy scalar read costs
    # more than the lookup itself.
    self._late = [bool(x) for x in a.late]
    self._copy_where = [(o if p == "scan_slice" else -1, int(r), int(b)) for o, (p, r, b)
                        in enumerate(zip(graph.prims, graph.regions, graph.barriers))]
    # [kinds, masks] seconds of latency of one collective.
    self.latency = np.array(
        [[self.comm_time(k, m, 0.0) for m in range(self.masks)] for k in range(len(KINDS))])
    self.memo = Memo(a.result_table.shape[1], a.member_table.shape[1] * n)
    # The sums XLA may reassociate all-reduces across (`reassociate`).
    self.reassociable = (reassociate.candidates(graph)
                         if self.compiler.reassociates_all_reduces else ())

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
    loop, region, barrier = self._copy_where[o]
    return (self.graph.operands[o][position], kind, mask, target, nbytes, loop, region,
            barrier)

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
    return self._late[o] and kind in self.compiler.combines

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
    """Cost of op o under `state`, priced afresh (not memoised; `pricing.price`)."""
    return pricing.price(self, state, o)

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
