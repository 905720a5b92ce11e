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
def spread(state, frontier, a, sizes, fixed, shape, vptr, vop, vslot, mval, mdims, fdim,
           msize, offer):
  """Spreads the tilings on mesh axis `a` of the values in `frontier`
  through the factor rules, wave by wave, until nothing changes; in place.

  A wave visits each source value's (op, member slot) views in order: the
  value's tiled dim is offered, through the op's factor, to the op's other
  members. An offer is taken where the op has no other factor on axis a,
  the factor's extent and the member's dim divide by the tiles, the member
  is free on a and not fixed, and any axes already on that dim nest inside
  the offer's. Offers are decided against the state at the start of the
  wave, and the first offer to a value wins. The values taken are the next
  wave's sources.

  state: [V, A] int8, the dim each axis tiles or -1. frontier: [n] int64.
  sizes: [A] int64. fixed: [V] bool. shape: [V, R] int64. vptr: [V + 1],
  vop, vslot: CSR of each value's views. mval: [O, M] member values (-1
  pads). mdims: [O, M, R] the factor of each member dim (-2 pads). fdim:
  [O, M, F] the member dim each factor indexes (-1: none). msize: [O, F]
  factor extents. offer: [V] int64 scratch, all -1 on entry and exit.
  Returns the values changed, in the order they changed.
  """
  num_axes = state.shape[1]
  width = mval.shape[1]
  # Each value changes at most once: the waves' targets go one after the
  # other into `changed`, and a wave's sources are the previous wave's.
  changed = np.empty(state.shape[0], np.int64)
  dims = np.empty(state.shape[0], np.int64)
  src = frontier
  n = 0
  while len(src):
    start = n
    for v in src:
      d = state[v, a]
      if d < 0:
        continue
      tiles = 1
      offered = 0
      for b in range(num_axes):
        if state[v, b] == d:
          tiles *= sizes[b]
          offered |= 1 << b
      for k in range(vptr[v], vptr[v + 1]):
        o, slot = vop[k], vslot[k]
        f = mdims[o, slot, d]
        if f < 0 or msize[o, f] % tiles:
          continue
        clash = False
        for j in range(width):
          u = mval[o, j]
          if u >= 0 and state[u, a] >= 0 and mdims[o, j, state[u, a]] != f:
            clash = True
            break
        if clash:
          continue
        for j in range(width):
          u = mval[o, j]
          if u < 0 or u == v or offer[u] >= 0 or state[u, a] >= 0 or fixed[u]:
            continue
          e = fdim[o, j, f]
          if e < 0 or shape[u, e] % tiles:
            continue
          nested = 0
          for b in range(num_axes):
            if state[u, b] == e:
              nested |= 1 << b
          if nested & ~offered:
            continue
          offer[u] = e
          changed[n] = u
          dims[n] = e
          n += 1
    for i in range(start, n):
      state[changed[i], a] = dims[i]
      offer[changed[i]] = -1
    src = changed[start:n]
  return changed[:n]
