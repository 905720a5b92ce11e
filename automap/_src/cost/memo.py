"""The memo of op costs: one entry per op class and layout, as arrays.

The search prices the same op in the same layouts over and over, and the
repeated layers of a model in the same layouts alike: each is priced once,
then found by a compiled hash lookup (`kernels.find_entries`).
"""

from __future__ import annotations

import numpy as np

from automap._src.cost import kernels
from automap._src.cost.collectives import ALL_REDUCE
from automap._src.sharding.state import State


class OpCost:
  """Cost of one op under one state.

  time: compute seconds; flops: per device; comms: (kind, axes bitmask,
  bytes, seconds, resharded operand position or -1, target layout code,
  HBM bytes of the copies laying its buffers out) per collective;
  reshards: operand position -> the per-axis dims it is resharded to on
  entry, where that differs from its own; footprint: per
  result, the bytes its buffer holds (more than its tile when the op makes
  the whole array and slices it, e.g. an all-reduce standing in for a
  reduce-scatter); natural: per result, the per-axis dims of the layout the
  op produces it in (partial sums combined), before any reshard to its own;
  traffic: HBM bytes per device its fusions read and write (a loop body's
  once; its time counts every step).
  """

  __slots__ = ("time", "flops", "comms", "reshards", "footprint", "natural", "traffic")

  def __init__(self, time: float, flops: float,
               comms: list[tuple[int, int, float, float, int, int, float]],
               reshards: dict[int, tuple[int, ...]],
               footprint: tuple[float, ...], natural: tuple, traffic: float = 0.0):
    self.time, self.flops = time, flops
    self.comms = comms
    self.reshards = reshards
    self.footprint = footprint
    self.natural = natural  # per result: the layout the op computes it in
    self.traffic = traffic


class Memo:
  """The op costs priced so far: one entry per op class and layout, and the
  figures of each that `Tracker` totals, as arrays indexed by entry id.

  Shape letters: E entries (arrays have spare rows past `len(memo)`), R
  result slots per op, C collectives of all entries.
  entries: [E] each entry's OpCost.
  time, flops, traffic: [E] its compute seconds, FLOPs and HBM bytes per device.
  footprint: [E, R] bytes its results' buffers hold (`OpCost.footprint`).
  has_comms: [E] whether it has any collective.
  lone_all_reduce: [E] whether exactly one of them is an all-reduce of its
    result (what `reassociate` may fold into a sum's).
  has_reshard: [E] whether one of them reshards an operand (a copy all the
    operand's readers in that layout share).
  comm_start, comm_end: [E] its collectives are rows comm_start to comm_end
    of comm_kind (index into KINDS), comm_mask (axes bitmask), comm_bytes
    and comm_seconds, each [C]; comm_after [C] whether it finishes the
    op's result (else it reshards an operand before the op).
  """

  def __init__(self, result_slots: int, key_width: int):
    self.entries: list[OpCost] = []
    self.time = np.zeros(256)
    self.flops = np.zeros(256)
    self.traffic = np.zeros(256)
    self.footprint = np.zeros((256, result_slots))
    self.has_comms = np.zeros(256, bool)
    self.lone_all_reduce = np.zeros(256, bool)
    self.has_reshard = np.zeros(256, bool)
    self.comm_start = np.zeros(256, np.int64)
    self.comm_end = np.zeros(256, np.int64)
    self.comm_kind = np.zeros(256, np.int64)
    self.comm_mask = np.zeros(256, np.int64)
    self.comm_bytes = np.zeros(256)
    self.comm_seconds = np.zeros(256)
    self.comm_after = np.zeros(256, bool)
    # Each entry's exact key -> its id; and its key as arrays (class,
    # members' state rows [E, key_width]) and the key's hash, with the
    # open-addressing table of hashes `kernels.find_entries` searches.
    self._ids: dict[bytes, int] = {}
    self._class = np.zeros(256, np.int64)
    self._rows = np.zeros((256, key_width), np.int8)
    self._hash = np.zeros(256, np.uint64)
    self._slot_hash = np.zeros(1024, np.uint64)
    self._slot_entry = np.full(1024, -1, np.int64)

  def __len__(self) -> int:
    return len(self.entries)

  def find(self, state: State, member_table: np.ndarray, op_class: np.ndarray,
           ops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([n] entry ids of `ops` under `state`, -1 where none is filed under
    its layout hash; [n] the hashes), by `kernels.find_entries`."""
    return kernels.find_entries(state, member_table, op_class, ops, self._slot_hash,
                                self._slot_entry, self._class, self._rows)

  def get(self, key: bytes) -> int | None:
    """The entry of an exact key, None if none."""
    return self._ids.get(key)

  def add(self, key: bytes, c: OpCost, op_class: int, rows: np.ndarray,
          key_hash: np.uint64) -> int:
    """Files cost c under its exact key (an op class and its members' state
    rows) and the key's hash; returns its entry id."""
    k = len(self.entries)
    if k == len(self.time):  # grow geometrically
      self._grow(("time", "flops", "traffic", "footprint", "has_comms", "_class", "_rows", "_hash",
                  "has_reshard", "comm_start", "comm_end", "lone_all_reduce"), 2 * k)
    rows_at = int(self.comm_end[k - 1]) if k else 0
    while rows_at + len(c.comms) > len(self.comm_kind):
      self._grow(("comm_kind", "comm_mask", "comm_bytes", "comm_seconds", "comm_after"),
                 2 * len(self.comm_kind))
    for r, (kind, mask, nbytes, seconds, position, *_) in enumerate(c.comms, rows_at):
      self.comm_kind[r], self.comm_mask[r], self.comm_bytes[r], self.comm_seconds[r] = (
          kind, mask, nbytes, seconds)
      self.comm_after[r] = position < 0
    self.comm_start[k], self.comm_end[k] = rows_at, rows_at + len(c.comms)
    self.has_reshard[k] = any(position >= 0 for *_, position, _, _ in c.comms)
    self.lone_all_reduce[k] = [kind == ALL_REDUCE and position < 0
                               for kind, _, _, _, position, *_ in c.comms].count(True) == 1
    self.entries.append(c)
    self.time[k], self.flops[k], self.has_comms[k] = c.time, c.flops, bool(c.comms)
    self.traffic[k] = c.traffic
    self.footprint[k] = 0.0
    self.footprint[k, :len(c.footprint)] = c.footprint
    self._class[k], self._rows[k], self._hash[k] = op_class, rows.ravel(), key_hash
    if 2 * (k + 1) > len(self._slot_hash):  # keep the table at most half full
      self._slot_hash = np.zeros(4 * len(self._slot_hash), np.uint64)
      self._slot_entry = np.full(len(self._slot_hash), -1, np.int64)
      kernels.insert_entries(self._slot_hash, self._slot_entry, self._hash[:k + 1],
                             np.arange(k + 1))
    else:
      kernels.insert_entries(self._slot_hash, self._slot_entry, self._hash[k:k + 1],
                             np.array([k]))
    self._ids[key] = k
    return k

  def _grow(self, names: tuple[str, ...], n: int) -> None:
    """Resizes the named per-entry (or per-row) arrays to n rows."""
    for name in names:
      a = getattr(self, name)
      setattr(self, name, np.resize(a, (n,) + a.shape[1:]))
