"""Timeline: the memory of one state, as XLA's `memory_analysis` counts it.

Arguments and results are held for the whole program; on top of them, the
peak over program order of the temporaries alive (producer to last reader)
that fusion leaves in memory, the resharded copies of operands (one per
value and layout, from their first reader to their last), and the inputs
late reductions hold until XLA's combiners reduce them. `tracker.Tracker`
owns one and tells it what an action changes. It reads the model through
its public surface: `analysis`'s per-value and per-op arrays, `memo`'s
footprints, `compiler`, `local_bytes`, `value_bytes`, and the mesh tables
`group_size`, `sizes`, `itemsize`, `reduced_itemsize`.
"""

from __future__ import annotations

import numpy as np

from automap._src.cost import combiners, kernels
from automap._src.cost.collectives import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from automap._src.cost.model import CostModel
from automap._src.sharding.state import State

# Ops that change only an array's type or labels, not its elements' order in
# a way XLA needs a copy for.
_RELABELS = frozenset({"reshape", "transpose", "convert_element_type", "copy", "name",
                       "squeeze", "expand_dims"})

# Most classes of result buffers `Timeline.peak` matches temporaries to.
_CLASSES = 64


class Timeline:
  """The bytes per device one state holds, over op indices.

  `live` [O + 1] is a timeline of the temporaries alive: each
  intermediate's buffer from producer to last reader, and each resharded
  copy of an operand from its first to its last reader (XLA computes one
  copy per value and layout and reuses it, forward and backward). `held`
  [V] are the resident buffers, held throughout. `state` is the tracker's,
  changed in place; each change is told here op by op.
  """

  def __init__(self, model: CostModel, state: State):
    self.model = model
    self.state = state
    g = model.graph
    # Late collectives per kind and axes, combined into one (`analysis.late_ops`),
    # and the inputs they hold: (kind, mask) -> {op: (first op held, bytes,
    # last reader of its result, result bytes held at the collective)},
    # and their share of the memory timeline. An op reduced over two groups
    # of axes feeds the first combined collective's result to the second:
    # `chained` maps (key, op) of the second to the first's key.
    self.pending: dict[tuple[int, int], dict[int, tuple[int, float, int, float]]] = {}
    self.chained: dict[tuple[tuple[int, int], int], tuple[int, int]] = {}
    # (key, op) -> the reduced value an unsliced combined result ends in
    # (after relabels), which its elementwise readers update in place.
    self.reduced: dict[tuple[tuple[int, int], int], int] = {}
    self.pending_live: dict[tuple[int, int], np.ndarray] = {}
    self.dirty: set[tuple[int, int]] = set()
    # {value: the earliest time it is made}, for the values that wait for a
    # combined reduction (`waiting`), until the groups change.
    self._waiting: dict[int, int] | None = None
    # A resharded copy (`CostModel.copy_key`) -> its readers.
    self.reshards: dict[tuple, list[int]] = {}
    self.passing: dict[tuple, list[int]] = {}  # readers a copy is a step on the way for
    local = model.value_bytes(state)
    a = model.analysis
    self.held = np.where(a.resident, local, 0.0)  # [V] resident bytes
    self.resident = float(self.held.sum())
    self.args = float(self.held[a.is_input].sum())
    # [V] footprint of each temporary, and the timeline they make.
    self.footprint = np.zeros(g.num_values)
    self.live = np.zeros(g.num_ops + 1)

  def _add_live(self, times: list[int], nbytes: float) -> None:
    """Adds `nbytes` to the timeline from the first of `times` to the last."""
    self.live[min(times):max(times) + 1] += nbytes

  def read_copy(self, key: tuple, o: int, nbytes: float, sign: int, passing: bool) -> int:
    """Adds (sign 1) or removes (-1) op o as a reader of the resharded copy
    `key` (`CostModel.copy_key`) of `nbytes`, a step on the way to another
    copy for o where `passing`, and redraws the copy's span; returns how
    many readers the copy has after."""
    readers = self.reshards.get(key)
    if readers:
      self._add_live(self.copy_span(key, readers), -nbytes)
    on_the_way = self.passing.setdefault(key, []) if passing else None
    if sign > 0:
      readers = readers or []
      readers.append(o)
      self.reshards[key] = readers
      if on_the_way is not None:
        on_the_way.append(o)
    else:
      readers.remove(o)
      if on_the_way is not None:
        on_the_way.remove(o)
      if not readers:
        del self.reshards[key]
    if not self.passing.get(key, True):
      del self.passing[key]
    if readers:
      self._add_live(self.copy_span(key, readers), nbytes)
    return len(readers)

  def copy_span(self, key: tuple, readers: list[int]) -> list[int]:
    """The times (places in the schedule) a resharded copy
    (`CostModel.copy_key`) is live across: its readers'; a step on the way
    to another copy for some readers, from the first reader to the last
    that keeps it (the first alone if none does);
    on a breadth-first schedule (`Compiler.breadth_first`) an all-gather,
    whole or in part, read in the entry computation (not inside a loop or
    branch) from when what it gathers is made, where the schedule makes it:
    every FSDP weight's gather at the program's start (a stacked weight's
    slices' once sliced), the recomputation's too (XLA expands remat's
    barriers before it schedules), and the optimizer state's to its
    update's layout. Other copies (permutes, all-to-alls) are taken to be
    made by their first reader, as compiled programs of Megatron layouts
    show."""
    model, at = self.model, self.model.analysis.at
    passing = self.passing.get(key)
    if passing:
      kept = list(readers)
      for o in passing:
        kept.remove(o)
      readers = [min(readers, key=at.__getitem__), *kept]
    times = at[readers].tolist()
    value, kind, loop, region = key[0], key[1], key[5], key[6]
    if (not model.compiler.breadth_first or loop >= 0 or region or kind != ALL_GATHER
        or (model.graph.trips[readers] > 1).any()):
      return times
    return [*times, int(model.analysis.start[value])]

  def track_combined(self, o: int, kind: int, mask: int, nbytes: float, sign: int,
                     after: tuple[int, int] | None = None, last: bool = True) -> None:
    """Tracks a late reduction of op o. XLA combines the group's reductions
    into one collective after the last of them is produced, so each input
    lives until then: in the op's own buffer (and its relabels') until
    their last reader, then held; where the program's result takes that
    buffer, as a temporary of its own from the op. The combined collective
    makes every result at once, beside its inputs; a sliced result whose
    readers precede it in program order is then held there too. An op reduced over several
    groups of axes reduces each group's result in the next (XLA chains
    them): a reduction `after` another group's holds its input from that
    group's collective; one not `last` hands its result on, held as the
    next one's input. Drawn on the timeline by `redraw_combined`."""
    model, a = self.model, self.model.analysis
    v = model.graph.results[o][0] if model.graph.results[o] else -1
    if kind not in (ALL_REDUCE, REDUCE_SCATTER) or v < 0:
      return
    group = self.pending.setdefault((kind, mask), {})
    self.dirty.add((kind, mask))
    self._waiting = None
    if sign < 0:
      del group[o]
      self.chained.pop(((kind, mask), o), None)
      self.reduced.pop(((kind, mask), o), None)
      return
    if after is not None:
      self.chained[((kind, mask), o)] = after
    wire = nbytes  # the collective's result bytes, what combiners limit
    if kind == REDUCE_SCATTER:
      nbytes *= model.group_size[mask]
    else:  # Buffers at the value's own dtype, however wide the wire.
      nbytes *= model.itemsize[v] / model.reduced_itemsize[v]
    elements = nbytes / model.itemsize[v]

    def sliced(v: int) -> bool:  # stored smaller than reduced
      return elements > model.local_bytes(self.state, v) / model.itemsize[v] * (1 + 1e-9)

    # Follow the result through ops that only relabel it (XLA makes them
    # bitcasts or folds them into the collective's readers).
    held_from = int(a.end[v]) + 1 if a.temporary[v] else int(a.at[o])
    while len(model.graph.uses[v]) == 1:
      reader = model.graph.uses[v][0][0]
      if model.graph.prims[reader] not in _RELABELS or len(model.graph.results[reader]) != 1:
        break
      v = model.graph.results[reader][0]
      if not sliced(v) and a.temporary[v]:
        held_from = int(a.end[v]) + 1
    # Sliced (here or by a relabel), the reduced result is a temporary of its
    # own beside the inputs at the collective: the whole sum of an all-reduce,
    # a reduce-scatter's tile; unsliced, a result can take the buffer of what
    # its readers make (an output, updated in place).
    if not last:
      early, end = 0.0, 1 << 62
    elif sliced(v):
      early, end = (wire if kind == REDUCE_SCATTER else nbytes), -1
    else:
      early, end = 0.0, int(a.end[model.graph.results[o][0]])
    # The input is the reduced op's own buffer (its footprint, as computed),
    # then the unsliced relabels' that are temporaries, each until its last
    # reader, then held for the collective; where none is (a result of the
    # program takes the buffer), a temporary of its own from the op.
    group[o] = (held_from, nbytes, end, early, wire)
    if last and not early:
      self.reduced[(kind, mask), o] = v

  def held_inputs(self, key: tuple[int, int]
                  ) -> list[tuple[int, int, float, int, float, int]]:
    """[(op, first time held, bytes, time of the last reader of its result,
    result bytes held at the collective, time of the collective)] of the
    late reductions of `key`: an input is held from `first` to the combined
    collective that reduces it (`windows`), one chained after another
    group's from that group's."""
    group = self.pending.get(key)
    if not group:
      return []
    windows, before = self.windows(key), {}
    rows = []
    for o, (first, nbytes, end, early, _) in group.items():
      after = self.chained.get((key, o))
      if after is not None:
        if after not in before:
          before[after] = self.windows(after)
        first = max(first, before[after].get(o, -1))
      rows.append((o, first, nbytes, end, early, windows[o]))
    return rows

  def windows(self, key: tuple[int, int], depth: int = 0) -> dict[int, int]:
    """{op: time of the combined collective that reduces it} for the late
    reductions of `key`. XLA's combiners (`CombineInstructionsByKey`) walk
    the schedule and close a group where the next collective would take it
    past the compiler's byte or count limit (`Compiler.combine_bytes`,
    `combine_count`); one over the byte limit runs alone. A group runs
    after its last input is made, or later where an input is another
    group's result (chained). XLA:CPU has no byte limit: one group holds
    every gradient until the last is made; XLA:GPU's 30 MiB reduces them as
    the backward pass makes them; on XLA:TPU each is priced reduced as made
    (`Compiler.holds_combined`)."""
    group = self.pending.get(key)
    if not group:
      return {}
    at, compiler = self.model.analysis.at, self.model.compiler
    ready, earlier = {}, {}
    for o in group:
      ready[o] = int(at[o])
      after = self.chained.get((key, o))
      if after is not None and depth < 4:
        if after not in earlier:  # one group's windows serve all its chained ops
          earlier[after] = self.windows(after, depth + 1)
        ready[o] = max(ready[o], earlier[after].get(o, -1))
    if not compiler.holds_combined:
      return ready
    return combiners.windows(ready, {o: group[o][4] for o in group}, compiler)

  def redraw_combined(self) -> None:
    """Redraws the memory held by the groups `track_combined` changed, and
    by those chained after them."""
    if not self.dirty:
      return
    dirty = self.dirty | {key for (key, _), after in self.chained.items() if after in self.dirty}
    n = len(self.live)
    for key in dirty:
      old = self.pending_live.pop(key, None)
      if old is not None:
        self.live -= old
      rows = self.held_inputs(key)
      held = np.array([(first, at, nbytes) for _, first, nbytes, _, _, at in rows
                       if first <= at]).reshape(-1, 3)
      if len(held):
        steps = np.zeros(n + 1)
        np.add.at(steps, held[:, 0].astype(np.int64), held[:, 2])
        np.add.at(steps, held[:, 1].astype(np.int64) + 1, -held[:, 2])
        new = np.cumsum(steps[:n])
        for _, _, _, end, early, at in rows:
          if end < at:
            new[at] += early
        self.pending_live[key] = new
        self.live += new
    self.dirty.clear()

  def set_footprints(self, ops: np.ndarray, ids: np.ndarray) -> None:
    """Sets the footprints of the results of `ops` to those of entries `ids`."""
    a = self.model.analysis
    kernels.set_footprints(ops, ids, a.result_table, self.model.memo.footprint, a.temporary,
                           self.footprint, a.start, a.end, self.live)

  def resize_residents(self, changed: np.ndarray) -> None:
    """Re-sizes the resident buffers among the `changed` values to their
    layouts in `state`."""
    model, a = self.model, self.model.analysis
    self.resident, self.args = kernels.resize_residents(
        changed, a.resident, self.state, model.sizes, model.graph.nbytes, self.held,
        a.is_input, self.resident, self.args)

  @property
  def peak_memory(self) -> float:
    return self.resident + self.peak()[0]

  def peak_bound(self) -> float:
    """An upper bound of `peak_memory` without the buffer matching: every
    temporary held apart (a limit it meets needs no more work)."""
    return self.resident + (max(float(self.live.max()), 0.0) if len(self.live) else 0.0)

  def peak(self) -> tuple[float, int]:
    """(bytes of temporaries at the memory peak, op index of the peak).

    Before a result of the program is made, its buffer holds temporaries
    that fit in it and die before it is made, one at a time (XLA's buffer
    assignment shares live-out allocations), so a temporary with such a
    host costs nothing extra (`kernels.hosted_at`).
    """
    if not len(self.live):
      return 0.0, 0
    net, t = kernels.peak_after_hosting(self.live, *self._hosting())
    return max(float(net), 0.0), int(t)

  def _hostable_temporaries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first op, last op, bytes) of the temporary buffers a result's buffer
    may hold: values outside loops, the inputs of combined reductions held
    until the collective, and resharded copies read outside loops."""
    a = self.model.analysis
    values = np.flatnonzero((self.footprint > 0) & a.hostable)
    held = [(first, last, nbytes) for key in self.pending
            for _, first, nbytes, _, _, last in self.held_inputs(key) if first <= last]
    trips, regions = self.model.graph.trips, self.model.graph.regions
    held += [(min(span), max(span), key[4]) for key, readers in self.reshards.items()
             if not regions[readers].any() and (trips[readers] == 1).all()
             for span in (self.copy_span(key, readers),)]
    first, last, nbytes = (np.array(x).reshape(-1) for x in zip(*held)) if held else (
        np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0))
    return (np.concatenate([a.start[values], first.astype(np.int64)]),
            np.concatenate([a.end[values], last.astype(np.int64)]),
            np.concatenate([self.footprint[values], nbytes.astype(np.float64)]))

  def _hosting(self) -> tuple[np.ndarray, ...]:
    """(start, end, bytes, class) of the temporaries a result buffer may
    hold, and (op made at, class) of those buffers, for `kernels.hosted_at`:
    classes of buffer sizes, largest first."""
    a = self.model.analysis
    sizes = self.held[a.results_made]
    ascending = np.unique(sizes)
    if len(ascending) > _CLASSES:  # a geometric grid, rounded down
      sizes = np.exp2(np.floor(np.log2(np.maximum(sizes, 1.0)) * 8) / 8)
      ascending = np.unique(sizes)
    m = len(ascending)
    slot = m - 1 - np.searchsorted(ascending, sizes)  # classes largest first
    start, end, foot = self._hostable_temporaries()
    fits = m - np.searchsorted(ascending, foot, side="left")  # classes a buffer fits
    temps = np.flatnonzero((foot > 0) & (fits > 0))
    made = a.results_made_at.copy()
    waiting, taken = self.waiting(), self.taken_by_reductions()
    if waiting or taken:
      at = {int(v): i for i, v in enumerate(a.results_made)}
      for v, t in waiting.items():
        if v in at:
          made[at[v]] = max(made[at[v]], t)
      for v, op in taken.items():
        if v in at:
          made[at[v]] = min(made[at[v]], op)
      order = np.argsort(made, kind="stable")
      made, slot = made[order], slot[order]
    return start[temps], end[temps], foot[temps], fits[temps] - 1, made, slot

  def waiting(self) -> dict[int, int]:
    """{value: the earliest time it is made} for the values made from a
    combined reduction's result: XLA's combined all-reduce is one
    instruction whose results every reader of a reduced gradient reads, so
    those readers (the optimizer's update) run after it, however early the
    gradient itself is made. On XLA:CPU's breadth-first schedule the model's
    places put the update at the gradient's own depth; the compiled GPT
    step's data parallelism runs every `multiply_add_fusion` of its Adam
    update after `all-reduce.30` and its `get-tuple-element`s, and its
    buffer assignment hosts the unreduced partial sums in the update's
    result allocations (`ynn_fusion.1` in `multiply_add_fusion.18`'s):
    a result made after the collective hosts what dies there."""
    if self._waiting is not None:
      return self._waiting
    g, a = self.model.graph, self.model.analysis
    ready: dict[int, int] = {}
    for key, group in self.pending.items():
      if not group:
        continue
      windows = self.windows(key)
      for o in group:
        for v in g.results[o]:
          if v >= 0:
            ready[v] = max(ready.get(v, -1), windows[o] + 1)
    if ready:
      for o in np.flatnonzero(a.late & ~a.dead).tolist():
        t = max((ready.get(u, -1) for u in g.operands[o] if u >= 0), default=-1)
        if t >= 0:
          for v in g.results[o]:
            if v >= 0:
              ready[v] = max(ready.get(v, -1), t)
    self._waiting = ready
    return ready

  def taken_by_reductions(self) -> dict[int, int]:
    """{result of the program: op from which its buffer is taken} for the
    results an optimizer's elementwise update makes in place from a
    combined reduction's result: the collective writes the buffer the
    update then overwrites (XLA shares a dying operand's buffer with an
    elementwise fusion's result), so it holds nothing before."""
    g, a = self.model.graph, self.model.analysis
    outputs = set(g.outputs)
    taken: dict[int, int] = {}
    ats: dict[tuple[int, int], dict[int, int]] = {}  # each group's `windows`
    for (key, o), v in self.reduced.items():
      if o not in self.pending.get(key, ()):
        continue
      if key not in ats:
        ats[key] = self.windows(key)
      at = ats[key][o]
      for _ in range(8):  # along same-shaped elementwise readers
        if v in outputs:
          taken[v] = min(taken.get(v, at), at)
          break
        nxt = [r for u, _ in g.uses[v] if a.late[u] for r in g.results[u]
               if r >= 0 and g.shapes[r] == g.shapes[v]]
        if not nxt:
          break
        v = nxt[-1]
    return taken
