"""Compiled inner loops of costing.

The search applies and undoes thousands of actions, each touching up to a
third of a program's values; these loops run them at machine speed. Each is
plain numpy-typed Python compiled by numba (cached on disk), so `.py_func`
runs the same code uncompiled.

Shape letters: V values, O ops, M members per op (padded), R rank (padded),
F factors per op (padded), A mesh axes.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def gather(items, ptr, idx, mark):
  """The sorted distinct entries of the CSR rows `items` of (ptr, idx).

  mark: [len(ptr) - 1] bool scratch, all False on entry and exit."""
  out = np.empty(len(mark), np.int64)
  n = 0
  for v in items:
    for k in range(ptr[v], ptr[v + 1]):
      o = idx[k]
      if not mark[o]:
        mark[o] = True
        out[n] = o
        n += 1
  if 16 * n < len(mark):
    out = np.sort(out[:n])
  else:  # many: a scan of the marks beats a sort
    n = 0
    for o in range(len(mark)):
      if mark[o]:
        out[n] = o
        n += 1
    out = out[:n]
  for o in out:
    mark[o] = False
  return out


@numba.njit(cache=True, nogil=True)
def _layout_hash(state, member_table, op_class, o):
  """A hash of op o's class and its members' state rows: the row entries
  as base-32 digits (exact up to twelve), mixed with the class."""
  digits = np.uint64(0)
  for j in range(member_table.shape[1]):
    v = member_table[o, j]
    for a in range(state.shape[1]):
      digits = (digits << np.uint64(5)) + np.uint64(state[v, a] + 2)
  x = digits ^ (np.uint64(op_class[o]) * np.uint64(0x9E3779B97F4A7C15))
  x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return x ^ (x >> np.uint64(31))


@numba.njit(cache=True, nogil=True)
def find_entries(state, member_table, op_class, ops, slot_hash, slot_entry, entry_class,
                 entry_rows):
  """Memo entries of `ops` under `state`, from an open-addressing table.

  The table maps a layout hash to an entry: slot_hash [C] uint64 and
  slot_entry [C] int64 (-1: empty), C a power of two. An entry found is
  checked against its key (entry_class [E], entry_rows [E, K] int8: the
  members' state rows, flattened), so a hash collision is never taken for
  a hit. Returns ([n] entry ids, -1 where missing; [n] layout hashes).
  """
  n = len(ops)
  ids = np.full(n, -1, np.int64)
  hashes = np.empty(n, np.uint64)
  num_axes = state.shape[1]
  mask = np.uint64(len(slot_hash) - 1)
  for i in range(n):
    o = ops[i]
    h = _layout_hash(state, member_table, op_class, o)
    hashes[i] = h
    s = h & mask
    while slot_entry[s] >= 0 and slot_hash[s] != h:
      s = (s + np.uint64(1)) & mask
    e = slot_entry[s]
    if e < 0 or entry_class[e] != op_class[o]:
      continue
    same = True
    for j in range(member_table.shape[1]):
      for a in range(num_axes):
        if entry_rows[e, j * num_axes + a] != state[member_table[o, j], a]:
          same = False
    if same:
      ids[i] = e
  return ids, hashes


@numba.njit(cache=True, nogil=True)
def insert_entries(slot_hash, slot_entry, hashes, entries):
  """Files each entry under its hash unless the hash is taken (by a
  colliding key, which then stays a miss, found in the exact memo)."""
  mask = np.uint64(len(slot_hash) - 1)
  for i in range(len(hashes)):
    h = hashes[i]
    s = h & mask
    while slot_entry[s] >= 0 and slot_hash[s] != h:
      s = (s + np.uint64(1)) & mask
    if slot_entry[s] < 0:
      slot_hash[s] = h
      slot_entry[s] = entries[i]


@numba.njit(cache=True, nogil=True)
def tally(removed, added, start, end, kind, mask, nbytes, seconds, out_bytes, out_count,
          out_seconds):
  """Takes the collectives of entries `removed` out of the totals and puts
  those of `added` in; in place. Entry e's collectives are rows start[e] to
  end[e] of (kind, mask, nbytes, seconds); totals are [kinds, masks]."""
  for i in range(len(removed) + len(added)):
    sign, e = (-1, removed[i]) if i < len(removed) else (1, added[i - len(removed)])
    for r in range(start[e], end[e]):
      out_bytes[kind[r], mask[r]] += sign * nbytes[r]
      out_count[kind[r], mask[r]] += sign
      out_seconds[kind[r], mask[r]] += sign * seconds[r]


@numba.njit(cache=True, nogil=True)
def swap_entries(ops, new, op_ids, entry_time, entry_flops):
  """Points each of `ops` at its entry in `new`; in place on op_ids [O].
  Returns the ops that moved, their old and new entries, and the change
  of total time and FLOPs."""
  keep = np.empty(len(ops), np.bool_)
  time = flops = 0.0
  for i in range(len(ops)):
    old = op_ids[ops[i]]
    keep[i] = old != new[i]
    if keep[i]:
      time += entry_time[new[i]] - entry_time[old]
      flops += entry_flops[new[i]] - entry_flops[old]
  moved = ops[keep]
  olds = op_ids[moved]
  news = new[keep]
  op_ids[moved] = news
  return moved, olds, news, time, flops


@numba.njit(cache=True, nogil=True)
def set_footprints(ops, ids, result_table, entry_footprint, temporary, footprint, start, end,
                   live):
  """Sets the footprints footprint [V] of the results of `ops` to those of
  entries `ids` (entry_footprint [E, R]), redrawing the memory timeline
  live [O + 1] where the temporaries that changed are alive; in place."""
  n = len(live)
  steps = np.zeros(n + 1)
  lo, hi = n, 0
  for i in range(len(ops)):
    for r in range(result_table.shape[1]):
      v = result_table[ops[i], r]
      if v < 0 or not temporary[v] or entry_footprint[ids[i], r] == footprint[v]:
        continue
      delta = entry_footprint[ids[i], r] - footprint[v]
      footprint[v] = entry_footprint[ids[i], r]
      steps[start[v]] += delta
      steps[end[v] + 1] -= delta
      lo, hi = min(lo, start[v]), max(hi, end[v] + 1)
  running = 0.0
  for t in range(lo, min(hi, n)):
    running += steps[t]
    live[t] += running


@numba.njit(cache=True, nogil=True)
def resize_residents(values, resident, state, sizes, nbytes, held, is_input, total, args):
  """Re-sizes the resident buffers (arguments, outputs) among `values` to
  their tiles under `state`; in place on held [V]. Returns the bytes held
  by all residents and by the arguments (`total`, `args` as they were when
  no resident is among `values`)."""
  moved = False
  for v in values:
    if resident[v]:
      tiles = 1
      for a in range(state.shape[1]):
        if state[v, a] >= 0:
          tiles *= sizes[a]
      held[v] = nbytes[v] / tiles
      moved = True
  if not moved:
    return total, args
  total = args = 0.0
  for v in range(len(held)):
    total += held[v]
    if is_input[v]:
      args += held[v]
  return total, args


@numba.njit(cache=True, nogil=True)
def temporaries_in_result_buffers(n, by_start, by_end, start, end, footprint, fits_class,
                                  made, slot_class, classes):
  """[n] bytes of temporaries that results not yet made hold, per op index.

  Temporaries (start, end, footprint, fits_class: the smallest class of
  result buffers each fits, classes ordered largest first) are sorted by start
  (`by_start`) and by end (`by_end`); result buffers by the op that makes
  them (`made`, `slot_class`). A buffer hosts a temporary that dies before
  its result is made (XLA's buffer assignment shares a live-out
  allocation between values whose live ranges do not interfere). At each
  point the buffers are matched to the temporaries alive there by class,
  largest first: a temporary fits its class and every larger one, so unused
  larger buffers carry down. Class c's temporaries and the larger ones
  matched before them take buffers made after the latest of their own ends,
  so a small long-lived one (a gradient the optimizer reads last) holds
  back only its own class and the smaller, not every buffer. Where a class
  has more temporaries than buffers, the share held is its bytes in
  proportion."""
  out = np.zeros(n)
  count = np.zeros(classes)
  nbytes = np.zeros(classes)
  last = np.full(classes, -1)  # per class, the latest end of a temporary started
  # after[c, x]: buffers of class c or larger made after op x.
  span = n + 2
  after = np.zeros((classes, span))
  for k in range(len(slot_class)):  # a histogram by class and op made...
    after[slot_class[k], min(max(made[k], 0), span - 1)] += 1
  for c in range(classes):  # ...summed over later ops: made after x
    running = 0.0
    for x in range(span - 1, -1, -1):
      made_here = after[c, x]
      after[c, x] = running
      running += made_here
  for c in range(1, classes):
    after[c] += after[c - 1]
  i = j = 0
  for t in range(n):
    while i < len(by_start) and start[by_start[i]] <= t:
      c = fits_class[by_start[i]]
      count[c] += 1
      nbytes[c] += footprint[by_start[i]]
      last[c] = max(last[c], end[by_start[i]])
      i += 1
    while j < len(by_end) and end[by_end[j]] < t:
      count[fits_class[by_end[j]]] -= 1
      nbytes[fits_class[by_end[j]]] -= footprint[by_end[j]]
      j += 1
    # Ends of temporaries already dead are below t: max(t, ...) discounts them.
    cutoff = t
    taken = 0.0
    total = 0.0
    for c in range(classes):
      cutoff = max(cutoff, last[c]) if count[c] > 0 else cutoff
      left = after[c, min(cutoff, span - 1)] - taken
      if count[c] > 0 and left > 0:
        take = min(count[c], left)
        total += nbytes[c] * take / count[c]
        taken += take
    out[t] = total
  return out
