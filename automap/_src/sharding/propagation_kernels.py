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
def _offer(state, v, o, slot, a, sizes, mdims, mminor, msize):
  """What member `slot` (value v) of op o offers on axis a: (factor, its
  tiles, a bitmask of the axes tiling it up to a). The offer is a with the
  axes before it on the dim (mesh order, major first): a goes where the
  axes before it went, as Shardy propagates a factor's compatible major
  axes and extends only a member holding a prefix. On a compound dim the
  axes fill the major factor while it divides, then the minor one; the
  offer is only the part on a's factor. Factor -1: nothing to offer."""
  d = state[v, a]
  f = mdims[o, slot, d]
  g = mminor[o, slot, d]
  tiles = 1
  offered = 0
  inner = 1  # tiles on the minor factor
  minor = 0
  for b in range(a + 1):
    if state[v, b] != d:
      continue
    if minor == 0 and (g < 0 or (f >= 0 and msize[o, f] % (tiles * sizes[b]) == 0)):
      tiles *= sizes[b]
      offered |= 1 << b
    elif f >= 0 and tiles == msize[o, f]:
      inner *= sizes[b]
      minor |= 1 << b
    else:
      return -1, 1, 0
  if minor:
    if msize[o, g] % inner:
      return -1, 1, 0
    return g, inner, minor
  if f < 0 or msize[o, f] % tiles:
    return -1, 1, 0
  return f, tiles, offered


@numba.njit(cache=True, nogil=True)
def _takers(state, o, slot, a, sizes, fixed, shape, mval, role, mdims, mminor, fdim, msize,
            elements, direction, sends, takes, busy, out_value, out_dim):
  """The members of op o that take the tiling on axis a its member at `slot`
  offers (`_offer`): writes them and the dims they take to out_value,
  out_dim [M]; returns how many. Values with busy[u] >= 0 are passed over.

  The offer is made, through the op's factor, to the members the factor's
  `direction` lets it update (bit 0 results, bit 1 operands; a one-way
  factor offers only from the other side; `sends` and `takes` [O, M] say
  which members may offer and take at all). A member takes it where it is
  free on a and not fixed, the factor's extent and the member's dim
  divide by the offer's tiles, the member's dim holds exactly the offer's
  other axes (and, where the factor is the dim's minor one, before them
  axes filling its major factor), and no other member offers it a
  different factor on a from a larger tensor (more `elements`; ties to
  the earlier member, then the lower factor): Shardy's aggressive
  propagation resolves conflicts between factors so, tensor by tensor."""
  num_axes = state.shape[1]
  width = mval.shape[1]
  if not sends[o, slot]:
    return 0
  v = mval[o, slot]
  f, tiles, offered = _offer(state, v, o, slot, a, sizes, mdims, mminor, msize)
  if f < 0:
    return 0
  way = direction[o, f]
  if way == 0 or (way == 1 and role[o, slot] == 1) or (way == 2 and role[o, slot] == 0):
    return 0
  others = offered & ~(1 << a)
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
    if mminor[o, j, e] == f:
      # The minor factor: the dim's other axes fill its major factor,
      # before the offer's in mesh order, and a comes last.
      major = nested & ~others
      if nested & others != others or nested >> a:
        continue
      filled = 1
      last = -1
      for b in range(num_axes):
        if major >> b & 1:
          filled *= sizes[b]
          last = b
      if filled != msize[o, mdims[o, j, e]] or (others and others & ((1 << (last + 1)) - 1)):
        continue
    elif nested != others:
      continue
    beaten = False
    for w in range(width):
      x = mval[o, w]
      if w == j or x < 0 or state[x, a] < 0 or not sends[o, w]:
        continue
      g, _, _ = _offer(state, x, o, w, a, sizes, mdims, mminor, msize)
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
           mminor, fdim, msize, elements, direction, sends, takes, offer):
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
  each member dim (-2 pads); mminor: [O, M, R] its minor factor (-1). fdim:
  [O, M, F] the member dim each factor indexes (-1: none). msize: [O, F]
  factor extents. elements: [O, M] int64, each member's size. direction:
  [O, F] uint8.
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
                    mminor, fdim, msize, elements, direction, sends, takes, offer, takers,
                    taken)
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
def sweep(state, order, sizes, fixed, shape, vptr, vop, mval, role, mdims, mminor, fdim,
          msize, elements, direction, sends, takes, offer):
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
        m = _takers(state, o, slot, a, sizes, fixed, shape, mval, role, mdims, mminor,
                    fdim, msize, elements, direction, sends, takes, offer, takers, taken)
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
