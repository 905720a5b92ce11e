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
def hosted_at(t, start, end, footprint, fits_class, made, slot_class):
  """Bytes of the temporaries alive at op t that result buffers not yet made
  hold (XLA's buffer assignment shares a live-out allocation between values
  whose live ranges do not interfere, so a buffer made after a temporary
  dies can hold it).

  Temporaries (start, end, footprint, fits_class: the smallest class of
  result buffers each fits, classes ordered largest first); result buffers
  by the op making them (`made`, ascending) and class (`slot_class`). A
  temporary fits its class and every larger one. Classes are matched
  largest first; within one, the temporaries that die last take the
  buffers made last, which hosts as many as any matching can (the buffers
  a temporary may take are nested by its end)."""
  alive = np.empty(len(start), np.int64)
  k = 0
  for i in range(len(start)):
    if start[i] <= t <= end[i]:
      alive[k] = i
      k += 1
  first = np.searchsorted(made, t, side="right")
  if k == 0 or first == len(made):
    return 0.0
  alive = alive[:k]
  span = np.int64(end.max()) + 2
  order = alive[np.argsort(fits_class[alive] * span + (span - 1 - end[alive]))]
  used = np.zeros(len(made), np.bool_)
  total = 0.0
  i = 0
  while i < k:
    c = fits_class[order[i]]
    p = len(made) - 1
    while i < k and fits_class[order[i]] == c:
      v = order[i]
      i += 1
      while p >= first and (used[p] or slot_class[p] > c):
        p -= 1
      if p >= first and made[p] > end[v]:
        used[p] = True
        total += footprint[v]
        p -= 1
  return total


@numba.njit(cache=True, nogil=True)
def peak_after_hosting(live, start, end, footprint, fits_class, made, slot_class):
  """(bytes, op) of the peak of `live` less what result buffers hold
  (`hosted_at`); the earliest op where several tie.

  What is hosted at an op depends only on the temporaries alive there (a
  buffer a temporary may take is made after the temporary dies, so after
  the op), and that set changes only where a temporary starts or ends: the
  ops are cut into runs between those points, each run's peak is its most
  live op, and the runs are tried from the most live down, until no
  untried run can beat the best found. A training step's live memory stays
  near its peak over much of its backward pass, where trying each op
  priced the hosting thousands of times."""
  n = len(live)
  if n == 0:
    return -np.inf, 0
  cut = np.zeros(n, np.bool_)
  cut[0] = True
  for i in range(len(start)):
    if start[i] <= end[i]:
      if 0 <= start[i] < n:
        cut[start[i]] = True
      if 0 <= end[i] + 1 < n:
        cut[end[i] + 1] = True
  firsts = np.flatnonzero(cut)
  runs = len(firsts)
  peak = np.empty(runs)
  at = np.empty(runs, np.int64)
  for k in range(runs):
    stop = firsts[k + 1] if k + 1 < runs else n
    t = firsts[k]
    for u in range(firsts[k] + 1, stop):
      if live[u] > live[t]:
        t = u
    peak[k], at[k] = live[t], t
  best, where = -np.inf, 0
  for k in np.argsort(-peak, kind="mergesort"):
    if peak[k] < best:
      break
    t = at[k]
    net = peak[k] - hosted_at(t, start, end, footprint, fits_class, made, slot_class)
    if net > best or (net == best and t < where):
      best, where = net, t
  return best, where


@numba.njit(cache=True, nogil=True)
def after_seconds(ops, entries, comm_start, comm_end, comm_kind, comm_mask, comm_seconds,
                  comm_after, late, combines, latency, after):
  """Adds to `after` [O] each op's seconds of collectives that finish its
  result (`OpCost.comms` of position -1). A late collective of a kind the
  compiler combines pays no latency of its own; its combination pays one,
  on the last op it combines (`CostModel.combined`)."""
  last = np.full(latency.shape, -1, np.int64)
  for i in range(len(ops)):
    o, e = ops[i], entries[i]
    for r in range(comm_start[e], comm_end[e]):
      if not comm_after[r]:
        continue
      k, m = comm_kind[r], comm_mask[r]
      seconds = comm_seconds[r]
      if late[o] and combines[k]:
        seconds -= latency[k, m]
        last[k, m] = max(last[k, m], o)
      after[o] += seconds
  for k in range(latency.shape[0]):
    for m in range(latency.shape[1]):
      if last[k, m] >= 0:
        after[last[k, m]] += latency[k, m]


@numba.njit(cache=True, nogil=True)
def _before(keys, items, i, j):
  """Whether heap entry i orders before j: the earlier key, then the lower op."""
  return keys[i] < keys[j] or (keys[i] == keys[j] and items[i] < items[j])


@numba.njit(cache=True, nogil=True)
def _swap(keys, items, i, j):
  keys[i], keys[j] = keys[j], keys[i]
  items[i], items[j] = items[j], items[i]


@numba.njit(cache=True, nogil=True)
def _sift_down(keys, items, n, i):
  while True:
    child = 2 * i + 1
    if child >= n:
      return
    if child + 1 < n and _before(keys, items, child + 1, child):
      child += 1
    if not _before(keys, items, child, i):
      return
    _swap(keys, items, i, child)
    i = child


@numba.njit(cache=True, nogil=True)
def _sift_up(keys, items, i):
  while i > 0 and _before(keys, items, i, (i - 1) // 2):
    _swap(keys, items, i, (i - 1) // 2)
    i = (i - 1) // 2


@numba.njit(cache=True, nogil=True)
def list_schedule(operand_table, result_table, succ_ptr, succ_idx, preds, compute, before,
                  after, num_values):
  """Seconds the two-stream list schedule of `overlap` takes: of the ops
  whose producers have all run, the compute stream runs the one whose
  operands arrived first (the lower op on ties); an op's `before`
  collectives run on the communication stream once its operands arrived,
  its `after` ones once it has computed, and its results are ready then."""
  n = len(compute)
  waiting = preds.copy()
  ready = np.zeros(num_values)
  keys = np.zeros(n)
  items = np.zeros(n, np.int64)
  size = 0
  for o in range(n):
    if waiting[o] == 0:
      keys[size], items[size] = 0.0, o
      size += 1
  compute_free = comm_free = end = 0.0
  while size:
    at, o = keys[0], items[0]
    size -= 1
    keys[0], items[0] = keys[size], items[size]
    _sift_down(keys, items, size, 0)
    if before[o] > 0:
      comm_free = max(comm_free, at) + before[o]
      at = comm_free
    done = max(compute_free, at) + compute[o]
    compute_free = done
    if after[o] > 0:
      comm_free = max(comm_free, done) + after[o]
      done = comm_free
    for j in range(result_table.shape[1]):
      v = result_table[o, j]
      if v >= 0:
        ready[v] = done
    end = max(end, done)
    for k in range(succ_ptr[o], succ_ptr[o + 1]):
      s = succ_idx[k]
      waiting[s] -= 1
      if waiting[s] == 0:
        arrived = 0.0
        for j in range(operand_table.shape[1]):
          v = operand_table[s, j]
          if v >= 0:
            arrived = max(arrived, ready[v])
        keys[size], items[size] = arrived, s
        _sift_up(keys, items, size)
        size += 1
  return max(end, max(compute_free, comm_free))
