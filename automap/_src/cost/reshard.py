"""Reshard routes: the collectives that take a value from one layout to another.

All-gathers of the axes leaving a dim, then one all-to-all per (source dim,
target dim) of the axes moving, slicing for free; with the copies XLA adds
around them to lay their buffers out (`relayout_bytes`). Functions of a
`CostModel` (its mesh, compiler and `emit`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from automap._src.cost.collectives import ALL_GATHER, ALL_TO_ALL, PERMUTE
from automap._src.sharding.state import UNSHARDED


def transition(model, comms: list, have, want, local: float, value: int,
               shape: tuple[int, ...] | None = None,
               fused: tuple[bool, bool] = (False, False)) -> float:
  """Collectives that move an array from layout `have` to `want` (per-axis
  tiled dims); returns its bytes per device after. Given the array's
  `shape`, each collective also carries the HBM bytes of the copies the
  compiler lays its buffers out with (`relayout_bytes`), `fused` saying
  whether the array's producer and its readers are loop fusions that
  take the first and last copies in.

  As XLA reshards: where every device's target tile lies within some
  device's current tile (each dim's tile count only refined), it slices
  and, unless the tile is its own, collective-permutes the slice. Else axes
  leaving the array are all-gathered (dim by dim), axes moving between dims
  exchanged all-to-all (unless another axis arrives on their target dim:
  then the whole array is gathered), axes arriving sliced for free; a dim
  whose axes are swapped for others is first permuted, then gathered only
  as far as the coarser target. Tiles of one dim nest major to minor in
  mesh order, so keeping a minor axis while dropping a major one, or adding
  a major axis under a kept minor one, reorders tiles: a collective-permute
  first.
  """
  sizes = model.mesh.axis_sizes
  # An axis of one device tiles nothing: which dim it names is moot.
  have = [UNSHARDED if n == 1 else int(h) for h, n in zip(have, sizes)]
  want = [UNSHARDED if n == 1 else int(w) for w, n in zip(want, sizes)]
  m = _moves(have, want, sizes, local)
  after = m.after
  if not (m.gathers or m.a2a or m.permute):
    return after  # slices of what each device holds
  target = layout_code(want)
  if all(m.want_tiles.get(d, 1) % t == 0 for d, t in m.have_tiles.items()):
    model.emit(comms, PERMUTE, m.moved | m.permute, after, value, target)
    return after
  leaving = {have[a] for a in range(len(sizes)) if m.a2a >> a & 1}
  incoming = {want[a] for a in range(len(sizes)) if m.moved >> a & 1}
  if any(d in leaving and d not in incoming for d in m.gathers):
    # A dim losing one axis to another dim and another to a gather, with
    # none coming in: XLA's partitioner finds no collective for it and
    # rematerialises the whole array, then slices.
    whole = local * math.prod(m.have_tiles.values())
    model.emit(comms, ALL_GATHER, m.moved, whole, value, target)
    return after
  if any(m.a2a >> a & 1 and want[a] in m.arrivals for a in range(len(sizes))):
    # An axis moving to a dim that another axis arrives on too: no
    # all-to-all makes those tiles; XLA gathers the whole array, then slices.
    whole = local * math.prod(m.have_tiles.values())
    sharded = sum(1 << a for a in range(len(sizes)) if have[a] >= 0)
    model.emit(comms, ALL_GATHER, sharded, whole, value, target)
    return after
  # Per collective: its entry in comms, whether its operand and result are
  # relaid, and their bytes.
  steps: list[tuple[int, bool, bool, float, float]] = []
  permuted, a2a_mask = _permute_first(model, comms, m, local, value, target)
  gathered = _gather_dims(model, comms, m, have, local, value, target, permuted, shape, steps)
  _all_to_alls(model, comms, a2a_mask, have, want, gathered, value, target, shape, steps)
  for (i, *_), relaid in zip(steps, relayout_bytes([s[1:] for s in steps], *fused)):
    comms[i] = comms[i][:6] + (relaid,)
  return after


class _Moves(NamedTuple):
  """How a reshard moves the mesh axes: masks of axes, dims as keys."""

  moved: int  # the axes whose dim changes
  a2a: int  # the axes moving from one dim to another
  permute: int  # the axes of dims whose tiles must be reordered first
  gathers: dict[int, int]  # dim -> the axes leaving it
  arrivals: dict[int, int]  # dim -> the axes arriving on it
  # Tiles per dim: before, after, and of the axes tiling the array both.
  have_tiles: dict[int, int]
  want_tiles: dict[int, int]
  kept_tiles: dict[int, int]
  after: float  # bytes per device after


def _moves(have: list[int], want: list[int], sizes, local: float) -> _Moves:
  """How a reshard from `have` to `want` moves each axis, and the bytes
  per device after, the array `local` bytes per device before. Tiles of
  one dim nest major to minor in mesh order: keeping a minor axis while
  dropping a major one, or adding a major axis under a kept minor one,
  reorders them (`permute`)."""
  a2a_mask = permute_mask = moved = 0
  gathers: dict[int, int] = {}
  arrivals: dict[int, int] = {}
  have_tiles: dict[int, int] = {}
  want_tiles: dict[int, int] = {}
  kept_tiles: dict[int, int] = {}
  after = local
  for a in range(len(sizes)):
    h, w = have[a], want[a]
    if h >= 0:
      have_tiles[h] = have_tiles.get(h, 1) * sizes[a]
    if w >= 0:
      want_tiles[w] = want_tiles.get(w, 1) * sizes[a]
    if h >= 0 and w >= 0:
      kept_tiles[h] = kept_tiles.get(h, 1) * sizes[a]
    if h == w:
      continue
    moved |= 1 << a
    if h >= 0 and w < 0:
      gathers[h] = gathers.get(h, 0) | 1 << a
      after *= sizes[a]
    elif h >= 0:
      a2a_mask |= 1 << a
    else:
      arrivals[w] = arrivals.get(w, 0) | 1 << a
      after /= sizes[a]
  for d in have_tiles:
    on_h = [a for a in range(len(sizes)) if have[a] == d]
    kept = [a for a in on_h if want[a] == d]
    on_w = [a for a in range(len(sizes)) if want[a] == d]
    if kept != on_h[:len(kept)] or on_w[:len(kept)] != kept:
      for a in on_h + on_w:
        permute_mask |= 1 << a
  return _Moves(moved, a2a_mask, permute_mask, gathers, arrivals, have_tiles, want_tiles,
                kept_tiles, after)


def _permute_first(model, comms: list, m: _Moves, local: float, value: int,
                   target: int) -> tuple[bool, int]:
  """The collective-permute that comes first, if any: where the target's
  tiles lie within those of the axes that stay, one permute moves them
  into place before gathering (no all-to-all after); else one reorders
  the tiles `_Moves.permute` names. Returns whether one is emitted, and
  the axes left to move all-to-all."""
  if (m.a2a or m.permute or any(d in m.arrivals for d in m.gathers)) and all(
      m.want_tiles.get(d, 1) % t == 0 for d, t in m.kept_tiles.items()):
    model.emit(comms, PERMUTE, m.moved | m.permute, local, value, target)
    return True, 0
  if m.permute:
    model.emit(comms, PERMUTE, m.permute, local, value, target)
    return True, m.a2a
  return False, m.a2a


def _gather_dims(model, comms: list, m: _Moves, have: list[int], local: float, value: int,
                 target: int, permuted: bool, shape: tuple[int, ...] | None,
                 steps: list) -> float:
  """The all-gathers of the axes leaving each dim, recorded in `steps`;
  returns the bytes per device after them. An all-gather concatenates
  along one dim: XLA gathers dims one at a time, the last first, each
  result the input of the next. Unpermuted, each step's result is a layout
  of its own, which every reader that passes through it shares (XLA caches
  reshards per value and layout)."""
  sizes = model.mesh.axis_sizes
  gathered = local
  step = list(have)
  for d in sorted(m.gathers, reverse=True):
    grow = model.group_size[m.gathers[d]]
    if d in m.arrivals:  # gathered only to the target's tiles
      grow /= model.group_size[m.arrivals[d]]
    if grow > 1:
      gathered *= grow
      for a in range(len(sizes)):
        if m.gathers[d] >> a & 1:
          step[a] = UNSHARDED
      key = target if permuted else layout_code(step)
      at = len(comms)
      model.emit(comms, ALL_GATHER, m.gathers[d], gathered, value, key)
      if len(comms) > at:  # relaid unless every dim before d is one element here
        copied = model.compiler.major_collective_dims and shape is not None and any(
            shape[e] > math.prod(sizes[a] for a in range(len(sizes)) if step[a] == e)
            for e in range(d))
        steps.append((at, copied, copied, gathered / grow, gathered))
  return gathered


def _all_to_alls(model, comms: list, a2a_mask: int, have: list[int], want: list[int],
                 gathered: float, value: int, target: int, shape: tuple[int, ...] | None,
                 steps: list) -> None:
  """One all-to-all per (source dim, target dim) of the axes in
  `a2a_mask`, recorded in `steps`."""
  pairs: dict[tuple[int, int], int] = {}
  for a in range(len(have)):
    if a2a_mask >> a & 1:
      pair = (have[a], want[a])
      pairs[pair] = pairs.get(pair, 0) | 1 << a
  for mask in pairs.values():
    at = len(comms)
    model.emit(comms, ALL_TO_ALL, mask, gathered, value, target)
    if len(comms) > at:
      split = model.compiler.tuple_all_to_all and shape is not None
      steps.append((at, split, split, gathered, gathered))


def relayout_bytes(steps: list[tuple[bool, bool, float, float]], fused_before: bool,
                   fused_after: bool) -> list[float]:
  """HBM bytes per device of the fusions a compiler adds around each of one
  reshard's collectives (per collective: whether its operand is relaid,
  whether its result is, their bytes) to lay their buffers out as the
  collectives need (`Compiler.major_collective_dims`,
  `Compiler.tuple_all_to_all`). Each fusion reads the array and writes it
  anew: before the first collective unless the array's producer is a loop
  fusion that takes it in, between two collectives once (charged to the
  first), after the last unless its readers are loop fusions that take it
  in."""
  out = []
  for i, (before, after, operand, result) in enumerate(steps):
    total = 0.0
    if before and not (fused_before if i == 0 else steps[i - 1][1]):
      total += 2 * operand
    if after and (i < len(steps) - 1 or not fused_after):
      total += 2 * result
    out.append(total)
  return out


def layout_code(row) -> int:
  """A layout (per-axis tiled dim, -1 for none) as one int: 4 bits an axis."""
  return sum((d + 1) << (4 * a) for a, d in enumerate(row))


__all__ = ["layout_code", "relayout_bytes", "transition"]
