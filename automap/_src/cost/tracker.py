"""Tracker: the running cost of one state, refreshed after each action.

It sums the memoised op costs of `model.CostModel` into step time and
collective totals, and re-sums only what an action changes; the memory the
state holds is its `timeline.Timeline`, told of each change here. Peak
memory is counted as XLA's `memory_analysis` counts it: arguments and
results for the whole program, plus the peak over program order of the
temporaries alive that fusion leaves in memory. It reads the model through
its public surface: `memo`'s per-entry arrays, `analysis`'s per-op arrays,
`entry_ids`, `copy_key`, `combined`, `latency`, `relayout_time`,
`compiler`, and the mesh tables `masks`, `group_size`.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from automap._src.cost import combiners, kernels, overlap, reassociate
from automap._src.cost.collectives import ALL_GATHER, ALL_REDUCE, KINDS, REDUCE_SCATTER
from automap._src.cost.memo import OpCost
from automap._src.cost.model import Cost, CostModel
from automap._src.cost.timeline import Timeline
from automap._src.sharding.state import State


class Tracker:
  """A running cost of a state, refreshed incrementally after actions.

  The clock (compute and collective seconds, how much of the latter
  compute hides) and the collective totals are kept here; the memory, a
  timeline over op indices of the temporaries alive, in `timeline`.
  Compute, FLOPs and buffers are updated as array operations over the ops
  an action touches; only ops with collectives are visited one by one.
  """

  def __init__(self, model: CostModel, state: State):
    self.model = model
    self.state = state
    g = model.graph
    self.bytes = np.zeros((len(KINDS), model.masks))
    self.count = np.zeros((len(KINDS), model.masks), np.int64)
    self.seconds = np.zeros((len(KINDS), model.masks))
    # HBM bytes of the copies laying operand reshards' buffers out, each
    # resharded copy's once (a result's are its op's traffic and time);
    # their seconds are compute's.
    self.relaid = 0.0
    # Late collectives per kind and axes, combined into one (`analysis.late_ops`);
    # the inputs they hold are the timeline's.
    self.combined = np.zeros((len(KINDS), model.masks), np.int64)
    # A resharded copy (`CostModel.copy_key`) -> the seconds, relaid bytes
    # and their seconds charged for it (its readers are the timeline's).
    self.charged: dict[tuple, tuple[float, float, float]] = {}
    self.timeline = Timeline(model, state)
    ops = np.arange(g.num_ops)
    self.op_ids = model.entry_ids(state, ops) if g.num_ops else np.zeros(0, np.int64)
    self._scratch = np.zeros(g.num_ops, bool)  # `kernels.gather`'s scratch
    self.compute = float(model.memo.time[self.op_ids].sum())
    self.flops = float(model.memo.flops[self.op_ids].sum())
    none = np.zeros(0, np.int64)
    self._swap_collectives(ops, none, self.op_ids)
    self.timeline.set_footprints(ops, self.op_ids)
    self._exposed: float | None = None  # `exposed_comm_time`, until the next update
    self._saved: tuple | None = None  # `reassociated`, until the next update

  @property
  def ops(self) -> list[OpCost]:
    """Per op, its current cost."""
    return [self.model.memo.entries[i] for i in self.op_ids]

  def _swap_collectives(self, ops: np.ndarray, old: np.ndarray, new: np.ndarray) -> None:
    """Swaps the collectives of `ops` from entries `old` (none if empty) to
    `new`. Plain ones are tallied at once; reshards (shared between
    readers) and late reductions (combined) are settled op by op."""
    memo = self.model.memo
    comms = memo.has_comms[new] if not len(old) else memo.has_comms[old] | memo.has_comms[new]
    special = self.model.analysis.late[ops] | memo.has_reshard[new]
    if len(old):
      special |= memo.has_reshard[old]
    plain = comms & ~special
    kernels.tally(old[plain] if len(old) else old, new[plain], memo.comm_start, memo.comm_end,
                  memo.comm_kind, memo.comm_mask, memo.comm_bytes, memo.comm_seconds,
                  self.bytes, self.count, self.seconds)
    for i in np.flatnonzero(comms & special).tolist():
      o = int(ops[i])
      if len(old):
        self._count_collectives(o, memo.entries[old[i]], -1)
      self._count_collectives(o, memo.entries[new[i]], 1)
    self.timeline.redraw_combined()

  def _count_collectives(self, o: int, c: OpCost, sign: int) -> None:
    """Adds (sign 1) or removes (-1) the collectives of op o's cost c."""
    # The op's late reductions, each reducing the result of the one before.
    chain = [i for i, (kind, _, _, _, position, *_) in enumerate(c.comms)
             if position < 0 and kind in (ALL_REDUCE, REDUCE_SCATTER)
             and self.model.combined(o, kind)] or [-1]
    first = None
    # A reshard in steps (permute, gathers axis by axis): each step's result
    # is the next one's input, freed once read; only the last is kept.
    last_step = {c.comms[i][4]: i for i in range(len(c.comms))}
    for i, (kind, mask, nbytes, seconds, position, target, relaid) in enumerate(c.comms):
      if position >= 0:  # A reshard of an operand: one copy for all its readers.
        key = self.model.copy_key(o, position, kind, mask, target, nbytes)
        readers = self.timeline.read_copy(key, o, nbytes, sign, i != last_step[position])
        if sign > 0 and readers == 1:
          # The copy costs what its first reader priced it at (readers inside
          # a loop price it per step); the same amount is refunded with it.
          copying = self.model.relayout_time(relaid) * int(self.model.graph.trips[o])
          self.charged[key] = seconds, relaid, copying
        elif sign < 0 and not readers:
          seconds, relaid, copying = self.charged.pop(key)
        else:
          continue
        self.relaid += sign * relaid
        self.compute += sign * copying
      self.bytes[kind, mask] += sign * nbytes
      self.count[kind, mask] += sign
      if position < 0 and self.model.combined(o, kind):
        self.combined[kind, mask] += sign
        seconds -= self.model.latency[kind, mask]
        self.timeline.track_combined(o, kind, mask, nbytes, sign, first, i == chain[-1])
        if i in chain:
          first = (kind, mask)
      self.seconds[kind, mask] += sign * seconds

  def move_to(self, target: State) -> None:
    """Sets `self.state` to `target` in place and re-costs the values that
    differ: how a search walks one working state between the states it
    prices."""
    diff = np.flatnonzero((self.state != target).any(axis=1))
    if len(diff):
      self.state[diff] = target[diff]
      self.update(diff)

  def update(self, changed: Iterable[int]) -> None:
    """Re-costs the ops around `changed` values of `self.state`."""
    model, state, a = self.model, self.state, self.model.analysis
    changed = np.asarray(changed if isinstance(changed, np.ndarray) else list(changed),
                         np.int64).ravel()
    if not len(changed):
      return
    self._exposed = self._saved = None
    ops = kernels.gather(changed, a.touch_ptr, a.touch_idx, self._scratch)
    ops, old, new, time, flops = kernels.swap_entries(
        ops, model.entry_ids(state, ops), self.op_ids, model.memo.time, model.memo.flops)
    self.compute += time
    self.flops += flops
    self._swap_collectives(ops, old, new)
    self.timeline.set_footprints(ops, new)
    self.timeline.resize_residents(changed)

  def ops_with_collectives(self) -> np.ndarray:
    """[n] the ops whose current cost includes a collective or a reshard."""
    return np.flatnonzero(self.model.memo.has_comms[self.op_ids])

  def reassociated(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, frozenset[int]]:
    """([kinds, masks] bytes, count, seconds) of the all-reduces XLA's
    reassociation removes from the tally, and the ops whose all-reduce
    goes (`reassociate.saved`)."""
    if self._saved is None:
      self._saved = reassociate.saved(self.model, self.op_ids, self.model.reassociable)
    return self._saved

  @property
  def comm_time(self) -> float:
    return float(self.seconds.sum() - self.reassociated()[2].sum()
                 + self.model.latency[self.combined > 0].sum())

  @property
  def serial_step_time(self) -> float:
    """Compute plus every collective in full, one after another: the step
    as XLA:CPU runs it."""
    return self.compute + self.comm_time

  @property
  def step_time(self) -> float:
    """The step as XLA runs it on the model's compiler, what every search
    minimises: compute plus the communication it does not hide
    (`exposed_comm_time`); serial where collectives run in place."""
    if not self.model.compiler.async_collectives:
      return self.serial_step_time
    return self.compute + self.exposed_comm_time()

  def combined_away(self) -> dict[tuple[int, int], int]:
    """{(kind, axes mask): how many collectives XLA's combiners merge away}
    (`combiners.merged_away`)."""
    return combiners.merged_away(self.model, self.op_ids, self.reassociated()[3])

  def comm_traffic(self) -> float:
    """HBM bytes the collectives read and write, per device: each reads its
    operand and writes its result (a gather's operand is its result over the
    group's size, a reduce-scatter's that times it)."""
    n = np.maximum(self.model.group_size, 1)
    operand = np.ones_like(self.bytes)
    operand[ALL_GATHER] = 1.0 / n
    operand[REDUCE_SCATTER] = n
    return float(((self.bytes - self.reassociated()[0]) * (1.0 + operand)).sum())

  def exposed_comm_time(self) -> float:
    """Of comm_time, what compute does not hide (`overlap`); all of it where
    collectives run in place."""
    if not self.model.compiler.async_collectives:
      return self.comm_time
    if self._exposed is None:
      compute, before, after = self.op_seconds_split()
      g = self.model.graph
      exposed = overlap.exposed(
          self.model.analysis.dependencies, compute, before, after, g.num_values)
      saved = float(self.reassociated()[2].sum())
      if saved > 0:
        # The schedule above runs every op's collectives; those XLA's
        # reassociation removes are taken to be hidden as the rest are.
        exposed *= self.comm_time / (self.comm_time + saved)
      self._exposed = min(self.comm_time, exposed)
    return self._exposed

  def op_seconds_split(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per op, (compute, communication before it, after it) seconds as this
    tracker counts them, the inputs of `overlap.schedule`: a resharded copy
    and the layout copies around it paid by the reader that priced it (in
    a fresh tracker, the first in program order), a combination of late
    collectives' latency once, on its last op."""
    model, memo, a = self.model, self.model.memo, self.model.analysis
    compute = memo.time[self.op_ids].astype(np.float64)
    before, after = np.zeros(len(compute)), np.zeros(len(compute))
    for key, readers in self.timeline.reshards.items():
      seconds, _, copying = self.charged[key]
      first = min(readers)
      before[first] += seconds
      compute[first] += copying
    ops = self.ops_with_collectives()
    combines = np.zeros(len(KINDS), bool)
    combines[list(model.compiler.combines)] = True
    kernels.after_seconds(ops, self.op_ids[ops], memo.comm_start, memo.comm_end, memo.comm_kind,
                          memo.comm_mask, memo.comm_seconds, memo.comm_after, a.late, combines,
                          model.latency, after)
    return compute, before, after

  # -- the memory timeline's, for its readers (`timeline.Timeline`) -------

  @property
  def peak_memory(self) -> float:
    return self.timeline.peak_memory

  def peak_bound(self) -> float:
    """An upper bound of `peak_memory` (`Timeline.peak_bound`)."""
    return self.timeline.peak_bound()

  def peak(self) -> tuple[float, int]:
    """(bytes of temporaries at the memory peak, op index of the peak)."""
    return self.timeline.peak()

  @property
  def live(self) -> np.ndarray:
    """[O + 1] bytes of temporaries alive at each op index."""
    return self.timeline.live

  @property
  def footprint(self) -> np.ndarray:
    """[V] bytes of each temporary."""
    return self.timeline.footprint

  @property
  def held(self) -> np.ndarray:
    """[V] bytes of each resident buffer (arguments, results)."""
    return self.timeline.held

  @property
  def reshards(self) -> dict[tuple, list[int]]:
    """A resharded copy (`CostModel.copy_key`) -> its readers."""
    return self.timeline.reshards

  @property
  def passing(self) -> dict[tuple, list[int]]:
    """A resharded copy -> the readers it is a step on the way for."""
    return self.timeline.passing

  @property
  def pending(self) -> dict[tuple[int, int], dict[int, tuple]]:
    """(kind, mask) -> the inputs its combined late reductions hold."""
    return self.timeline.pending

  @property
  def chained(self) -> dict[tuple[tuple[int, int], int], tuple[int, int]]:
    """(key, op) of a late reduction -> the key of the one it follows."""
    return self.timeline.chained

  def copy_span(self, key: tuple, readers: list[int]) -> list[int]:
    """The times a resharded copy is live across (`Timeline.copy_span`)."""
    return self.timeline.copy_span(key, readers)

  def held_inputs(self, key: tuple[int, int]
                  ) -> list[tuple[int, int, float, int, float, int]]:
    """The inputs the late reductions of `key` hold (`Timeline.held_inputs`)."""
    return self.timeline.held_inputs(key)

  def windows(self, key: tuple[int, int]) -> dict[int, int]:
    """{op: time of the combined collective that reduces it} (`Timeline.windows`)."""
    return self.timeline.windows(key)

  def taken_by_reductions(self) -> dict[int, int]:
    """Results made in place from a combined reduction's (`Timeline.taken_by_reductions`)."""
    return self.timeline.taken_by_reductions()

  def cost(self) -> Cost:
    names = self.model.mesh.axis_names
    comm_bytes, comm_count, comm_seconds = {}, {}, {}
    away = self.combined_away()
    saved_bytes, saved_count, saved_seconds, _ = self.reassociated()
    for kind, mask in zip(*np.nonzero(self.count - saved_count > 0)):
      key = (KINDS[kind], tuple(n for a, n in enumerate(names) if mask >> a & 1))
      comm_bytes[key] = float(self.bytes[kind, mask] - saved_bytes[kind, mask])
      comm_count[key] = (int(self.count[kind, mask] - saved_count[kind, mask])
                         - away.get((int(kind), int(mask)), 0))
      comm_seconds[key] = float(self.seconds[kind, mask] - saved_seconds[kind, mask] + (
          self.model.latency[kind, mask] if self.combined[kind, mask] else 0.0))
    return Cost(
        step_time=self.step_time, compute_time=float(self.compute),
        comm_time=self.comm_time, flops=float(self.flops),
        comm_bytes=comm_bytes, comm_count=comm_count,
        peak_memory=self.peak_memory, argument_memory=self.timeline.args,
        comm_seconds=comm_seconds,
        memory_traffic=(float(self.model.memo.traffic[self.op_ids].sum()) + self.comm_traffic()
                        + self.relaid),
        exposed_comm_time=self.exposed_comm_time())
