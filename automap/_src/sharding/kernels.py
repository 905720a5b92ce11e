"""Compiled inner loop of propagation.

The search applies and undoes thousands of actions, each touching up to a
third of a program's values; `spread` runs them at machine speed. It is
plain numpy-typed Python compiled by numba (cached on disk), so `.py_func`
runs the same code uncompiled.

Shape letters: V values, O ops, M members per op (padded), R rank (padded),
F factors per op (padded), A mesh axes.
"""

from __future__ import annotations

import numba
import numpy as np


def interrupted(error: BaseException) -> bool:
  """Whether `error` carries a KeyboardInterrupt: one raised while numba's
  dispatcher runs Python code (compiling, loading from its cache, boxing
  results) comes back wrapped in a SystemError."""
  seen = set()
  while error is not None and id(error) not in seen:
    if isinstance(error, KeyboardInterrupt):
      return True
    seen.add(id(error))
    error = error.__cause__ or error.__context__
  return False


@numba.njit(cache=True, nogil=True)
def _takers(state, o, slot, a, sizes, fixed, shape, mval, role, mdims, fdim, msize,
            elements, direction, sends, takes, busy, out_value, out_dim):
  """The members of op o that take the tiling on axis a its member at `slot`
  offers: writes them and the dims they take to out_value, out_dim [M];
  returns how many. Values with busy[u] >= 0 are passed over.

  The tiled dim is offered, through the op's factor, to the members the
  factor's `direction` lets it update (bit 0 results, bit 1 operands; a
  one-way factor offers only from the other side; `sends` and `takes`
  [O, M] say which members may offer and take at all). The offer is a
  with the axes before it on the dim (mesh order, major first). A member
  takes it where it is free on a and not fixed, the factor's extent and
  the member's dim divide by the offer's tiles, the member's dim holds
  exactly the offer's other axes, and no other member offers it a
  different factor on a from a larger tensor (more `elements`; ties to
  the earlier member, then the lower factor): Shardy's aggressive
  propagation resolves conflicts between factors so, tensor by tensor."""
  num_axes = state.shape[1]
  width = mval.shape[1]
  if not sends[o, slot]:
    return 0
  v = mval[o, slot]
  d = state[v, a]
  # The offer is the dim's axes up to a, major first (mesh order): a goes
  # where the axes before it went, as Shardy propagates a factor's
  # compatible major axes and extends only a member holding a prefix.
  tiles = 1
  offered = 0
  for b in range(a + 1):
    if state[v, b] == d:
      tiles *= sizes[b]
      offered |= 1 << b
  f = mdims[o, slot, d]
  if f < 0 or msize[o, f] % tiles:
    return 0
  way = direction[o, f]
  if way == 0 or (way == 1 and role[o, slot] == 1) or (way == 2 and role[o, slot] == 0):
    return 0
  n = 0
  for j in range(width):
    u = mval[o, j]
    if u < 0 or u == v or busy[u] >= 0 or state[u, a] >= 0 or fixed[u] or not takes[o, j]:
      continue
    if (way >> (1 - role[o, j])) & 1 == 0:  # results: bit 0, operands: bit 1
      continue
    e = fdim[o, j, f]
    if e < 0 or shape[u, e] % tiles:
      continue
    nested = 0
    for b in range(num_axes):
      if state[u, b] == e:
        nested |= 1 << b
    if nested != offered & ~(1 << a):
      continue
    beaten = False
    for w in range(width):
      x = mval[o, w]
      if w == j or x < 0 or state[x, a] < 0 or not sends[o, w]:
        continue
      g = mdims[o, w, state[x, a]]
      if g < 0 or g == f or fdim[o, j, g] < 0:
        continue
      rival = direction[o, g]
      if rival == 0 or (rival >> (1 - role[o, j])) & 1 == 0:
        continue
      if (rival == 1 and role[o, w] == 1) or (rival == 2 and role[o, w] == 0):
        continue
      if (elements[o, w] > elements[o, slot]
          or (elements[o, w] == elements[o, slot] and (w < slot or (w == slot and g < f)))):
        beaten = True
        break
    if beaten:
      continue
    out_value[n] = u
    out_dim[n] = e
    n += 1
  return n


@numba.njit(cache=True, nogil=True)
def spread(state, frontier, a, sizes, fixed, shape, vptr, vop, vslot, mval, role, mdims,
           fdim, msize, elements, direction, sends, takes, offer):
  """Spreads the tilings on mesh axis `a` of the values in `frontier`
  through the factor rules, wave by wave, until nothing changes; in place.

  A wave visits each source value's (op, member slot) views in order, and
  the op's members take its tiling as `_takers` says. Offers are decided
  against the state at the start of the wave, and the first offer to a
  value wins. The values taken are the next wave's sources.

  state: [V, A] int8, the dim each axis tiles or -1. frontier: [n] int64.
  sizes: [A] int64. fixed: [V] bool. shape: [V, R] int64. vptr: [V + 1],
  vop, vslot: CSR of each value's views. mval: [O, M] member values (-1
  pads). role: [O, M] int8, 1 for a result. mdims: [O, M, R] the factor of
  each member dim (-2 pads). fdim: [O, M, F] the member dim each factor
  indexes (-1: none). msize: [O, F] factor extents. elements: [O, M] int64,
  each member's size. direction: [O, F] uint8.
  sends, takes: [O, M] bool. offer: [V] int64 scratch, all -1 on entry and exit.
  Returns the values changed, in the order they changed.
  """
  width = mval.shape[1]
  # Each value changes at most once: the waves' targets go one after the
  # other into `changed`, and a wave's sources are the previous wave's.
  changed = np.empty(state.shape[0], np.int64)
  dims = np.empty(state.shape[0], np.int64)
  takers = np.empty(width, np.int64)
  taken = np.empty(width, np.int64)
  src = frontier
  n = 0
  while len(src):
    start = n
    for v in src:
      if state[v, a] < 0:
        continue
      for k in range(vptr[v], vptr[v + 1]):
        m = _takers(state, vop[k], vslot[k], a, sizes, fixed, shape, mval, role, mdims,
                    fdim, msize, elements, direction, sends, takes, offer, takers, taken)
        for i in range(m):
          offer[takers[i]] = taken[i]
          changed[n] = takers[i]
          dims[n] = taken[i]
          n += 1
    for i in range(start, n):
      state[changed[i], a] = dims[i]
      offer[changed[i]] = -1
    src = changed[start:n]
  return changed[:n]


@numba.njit(cache=True, nogil=True)
def sweep(state, order, sizes, fixed, shape, vptr, vop, mval, role, mdims, fdim, msize,
          elements, direction, sends, takes, offer):
  """Spreads every tiling as Shardy's propagation visits ops (MLIR's greedy
  rewrite driver, top-down, `basic_propagation.cc`): a worklist of every
  op in the module's order (`order` [O]); an op that changes a value puts
  the value's other ops (its producer and readers) back on top of the
  worklist unless they are on it already, so a change is chased depth
  first before that order resumes. At each op its tiled members offer
  their tilings, axis by axis (`_takers`), taken at once. Runs until the
  worklist is empty. Other arguments as `spread`'s (`offer` stays all
  -1). Returns the values changed, in order."""
  num_ops, width = mval.shape
  num_axes = state.shape[1]
  changed = np.empty(state.shape[0] * num_axes, np.int64)
  pending = np.ones(num_ops, np.bool_)
  stack = np.empty(num_ops, np.int64)  # ops put back, popped last in first out
  takers = np.empty(width, np.int64)
  taken = np.empty(width, np.int64)
  n = top = ahead = 0
  while True:
    if top > 0:
      top -= 1
      o = stack[top]
    elif ahead < num_ops:
      o = order[ahead]
      ahead += 1
    else:
      break
    pending[o] = False
    for a in range(num_axes):
      for slot in range(width):
        v = mval[o, slot]
        if v < 0 or state[v, a] < 0:
          continue
        m = _takers(state, o, slot, a, sizes, fixed, shape, mval, role, mdims, fdim,
                    msize, elements, direction, sends, takes, offer, takers, taken)
        for i in range(m):
          u = takers[i]
          state[u, a] = taken[i]
          changed[n] = u
          n += 1
          for k in range(vptr[u], vptr[u + 1]):
            p = vop[k]
            if p != o and not pending[p]:
              pending[p] = True
              stack[top] = p
              top += 1
  return changed[:n]
