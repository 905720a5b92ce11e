"""Halo exchange: how XLA slices or pads a tiled dimension in place.

A slice (or a split, or an edge pad) of a dimension tiled over n devices
keeps the dimension tiled: XLA's SPMD partitioner treats it as a window of
size one (`ReshardDataForSlicing` / `ReshardDataForPad`), and
`PartitionedHlo::ReshardAsWindowedInput` brings each device the elements
its output tile needs from its neighbours by collective-permutes
(`ExchangeHalo`), or, where one device's tile needs data from several far
shards, by a compact exchange (`ExchangeHaloCompact`); where neither
applies, it gathers the dimension whole. Both live in XLA's
`spmd/spmd_partitioner_util.cc`. This module computes the collective-permutes
those functions emit, from the window alone, as their index arithmetic does.

Only windows whose output divides evenly over the devices are handled (the
shard-trimming branches of `ReshardAsWindowedInput` fire only for outputs of
fewer elements than devices, which a tiled value never has).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple


class Permute(NamedTuple):
  """One collective-permute: `size` elements along the dimension (each
  device's buffer), sent from shard `source` to shard `target` per pair."""

  size: int
  pairs: tuple[tuple[int, int], ...]


def _ceil(a: int, b: int) -> int:
  return -(-a // b)


def windowed_exchange(size: int, shards: int, low: int, high: int,
                      stride: int = 1) -> list[Permute] | None:
  """The collective-permutes that make a dimension of `size` elements, tiled
  evenly in `shards`, into the input of a size-one window with edge padding
  `low`, `high` (negative: cropped) and `stride` whose output is tiled alike.
  None where XLA gathers the dimension instead.

  A slice [start, limit) is the window with low = -start, high = limit - size.
  """
  if shards <= 1:
    return []
  local = _ceil(size, shards)  # each device's tile
  full = size + low + high
  if full < 1:
    return None
  per = _ceil((full - 1) // stride + 1, shards)  # windows per device
  span = stride * (per - 1) + 1  # input elements one device's windows read

  # Shard i's first and last-plus-one input element, in padded coordinates,
  # against where its own tile lies (`left`: elements it needs from below).
  def left(i: int) -> int:
    return local * i + low - stride * per * i

  def right(i: int) -> int:
    return stride * per * i + span - (local * (i + 1) + low)

  every = range(shards)
  # `ExchangeHaloAndGetValidData`: halos over twice the window span go compact.
  if max(max(left(i) for i in every), max(right(i) for i in every)) > 2 * span:
    if span * 2 >= shards * local:
      return None  # "easier to fall back to replication"
    return _compact(size, local, shards, left, right)
  return _neighbours(local, shards, left, right)


def _neighbours(local: int, shards: int, left, right) -> list[Permute] | None:
  """`ExchangeHalo`: one permute per neighbour distance on each side."""
  max_left = max((left(i) for i in range(1, shards)), default=0)
  max_right = max((right(i) for i in range(shards - 1)), default=0)
  if (max_left + max_right + local >= local * shards
      and (max_left > local or max_right > local)):
    return None  # beyond the direct neighbour
  left_bound = -max(left(i) for i in range(shards))
  right_bound = local + max(right(i) for i in range(shards))
  if left_bound >= right_bound:
    return None
  out = []
  i = _ceil(max_left, local) - 1
  while i >= 0 and (-i - 1) * local < right_bound:
    n = min(max_left - local * i, local) - max(-i * local - right_bound, 0)
    if n > 0:
      out.append(Permute(n, tuple((j - i - 1, j) for j in range(i + 1, shards))))
    i -= 1
  skipped = min(max(left_bound - local, 0), max(max_right, 0)) // local
  for i in range(skipped, _ceil(max_right, local)):
    n = min(max_right - local * i, local) - max(left_bound - (i + 1) * local, 0)
    if n > 0:
      out.append(Permute(n, tuple((j, j - i - 1) for j in range(i + 1, shards))))
  return out


@dataclasses.dataclass
class _Halo:
  shard: int  # the shard that needs it
  offset: int  # where it starts in that shard's window
  start: int  # its range within the source's tile
  limit: int
  source: int  # the shard holding it; -1 for padding


def _compact(size: int, local: int, shards: int, left, right) -> list[Permute]:
  """`ExchangeHaloCompact`: each shard's window cut at tile boundaries, and
  pieces from distinct sources to distinct targets batched into permutes."""
  halos: list[list[_Halo]] = []
  for i in range(shards):
    start = i * local - left(i)
    limit = (i + 1) * local + right(i)
    pieces, at = [], start
    while at < limit:
      n = limit - at
      if at < 0 or at >= size:  # padding: no data moves
        if at < 0:
          n = min(n, -at)
        pieces.append(_Halo(i, at - start, at % local, at % local + n, -1))
      else:
        n = min(local - at % local, n)
        pieces.append(_Halo(i, at - start, at % local, at % local + n, at // local))
      at += n
    halos.append(pieces)
  # Padding pieces longer than a tile are cut to tiles unless every shard is
  # at padding; the order pieces reach their sources follows these rounds.
  sent: list[list[_Halo]] = [[] for _ in range(shards)]
  rounds: list[list[_Halo]] = [[] for _ in range(shards)]
  nxt = [0] * shards
  while any(nxt[i] < len(halos[i]) for i in range(shards)):
    all_padding = all(halos[i][nxt[i]].source < 0 for i in range(shards)
                      if nxt[i] < len(halos[i]))
    for i in range(shards):
      if nxt[i] >= len(halos[i]):
        continue
      h = halos[i][nxt[i]]
      piece = dataclasses.replace(h)
      rounds[i].append(piece)
      if not all_padding and h.source < 0 and h.limit > local:
        piece.limit = local
        h.start, h.limit = 0, h.limit - local
      else:
        nxt[i] += 1
      if h.source >= 0 and h.source != i:
        sent[h.source].append(piece)
  for pieces in sent:
    pieces.sort(key=lambda h: h.offset)  # stable, as XLA's
  out = []
  nxt = [0] * shards
  while True:
    pairs, seen, start, limit = [], set(), local, 0
    for i in range(shards):
      if nxt[i] >= len(sent[i]):
        continue
      h = sent[i][nxt[i]]
      # Delay a target already served this round, or a small piece from the
      # other end of the tile than the range so far.
      if pairs and (h.shard in seen
                    or (start > h.limit and limit == local and h.start == 0)
                    or (limit < h.start and start == 0 and h.limit == local)):
        continue
      seen.add(h.shard)
      pairs.append((i, h.shard))
      start, limit = min(start, h.start), max(limit, h.limit)
      nxt[i] += 1
    if not pairs:
      return out
    out.append(Permute(limit - start, tuple(pairs)))
