"""How XLA finishes a contraction's partial sums where the compiler has no
reduce-scatter (XLA:CPU): all-reduces, then each device keeps its tile.

XLA's dot partitioner (`dot_handler.cc`, `PartitionDotGroupOnContracting`,
`GetDotGroupPartitionContractingOutputShardings`) groups devices by the
contracted dim and decides, before reducing, the layout of the reduced
result. Where the scattered axes land on a result dim other axes tile too (the
batch tiled over `data`, the result wanted over `(data, expert)`), no
grouping matches the target:
- if the target leaves axes unused whose size the contracted axes divide,
  the operands are sliced to the target's tile, it is all-reduced, and
  collective-permuted to its devices unless those axes are the contracted
  ones;
- else, if each device's partial tile holds its target tile (on every
  result dim the op's own axes are the major ones of the target's, the
  contracted axes minor to them) and the dims the contracted axes land on
  are not batch dims both operands arrive tiled on (a Switch layer's
  combine: tokens over `data` in one operand, over `(data, expert)` out),
  it is all-reduced over the contracted axes and sliced in place;
- else the reduced result is made whole within each group (an all-gather
  over the op's own axes) and sliced.
Elsewhere the whole partial result is all-reduced once per result dim the
contracted axes land on, and sliced. Functions of a `CostModel`.
"""

from __future__ import annotations

import math

from automap._src.cost.collectives import ALL_GATHER, ALL_REDUCE, PERMUTE


def _major(natural, target, d: int, sizes) -> bool:
  """Whether the axes tiling dim d in `natural` are the major ones of
  those tiling it in `target` (per axis, the dim it tiles; axes of size 1
  aside): a tile of the first then holds a tile of the second."""
  own = [a for a, n in enumerate(natural) if n == d and sizes[a] > 1]
  wanted = [a for a, t in enumerate(target) if t == d and sizes[a] > 1]
  return wanted[:len(own)] == own


def finish(model, comms: list, natural: list[int], target, scatter_mask: int,
           reduce_mask: int, natural_bytes: float, total_bytes: float,
           widen: float, batched: int = 0) -> tuple[float, float]:
  """Emits the collectives that reduce a contraction's partial result,
  tiled per axis as `natural` (its own layout, updated in place to the
  layout it ends in), into `target` (per axis the dim it tiles), where the
  axes of `scatter_mask` land on result dims (those of `reduce_mask`, on
  none, are the caller's to all-reduce). Returns (bytes per device after,
  bytes of the largest buffer made). `total_bytes` is the whole result's,
  `widen` the reduction's itemsize over the result's; `batched`, the axes
  tiling a batch dim of the op in every operand as it arrives."""
  sizes = model.mesh.axis_sizes
  num_axes = len(sizes)
  own = [a for a in range(num_axes) if natural[a] >= 0 and sizes[a] > 1]
  by_dim: dict[int, int] = {}
  for a in range(num_axes):
    if scatter_mask >> a & 1:
      by_dim[int(target[a])] = by_dim.get(int(target[a]), 0) | 1 << a
  # A result dim the contracted axes share with others: no device group
  # of the contraction holds the target's tiles.
  mixed = any(int(target[a]) == d and not scatter_mask >> a & 1
              for a in range(num_axes) for d in by_dim if sizes[a] > 1)
  made = natural_bytes
  if not mixed:
    for a in range(num_axes):
      if scatter_mask >> a & 1:
        natural[a] = int(target[a])
    for mask in by_dim.values():
      model.emit(comms, ALL_REDUCE, mask, natural_bytes * widen)
    return natural_bytes / model.group_size[scatter_mask], made
  tile = total_bytes / math.prod(sizes[a] for a in range(num_axes) if target[a] >= 0)
  unused = sum(1 << a for a in range(num_axes) if target[a] < 0 and sizes[a] > 1)
  holds = [int(d) for d in natural]
  natural[:] = [int(t) for t in target]
  if model.group_size[unused] % model.group_size[scatter_mask | reduce_mask] == 0:
    model.emit(comms, ALL_REDUCE, scatter_mask, tile * widen)
    if unused != scatter_mask | reduce_mask:
      model.emit(comms, PERMUTE, scatter_mask | unused, tile)
    return tile, made
  for mask in by_dim.values():
    model.emit(comms, ALL_REDUCE, mask, natural_bytes * widen)
  shared = any(batched >> a & 1 and holds[a] in by_dim for a in range(num_axes))
  if not shared and all(_major(holds, natural, d, sizes)
                        for d in set(holds) | set(natural) if d >= 0):
    return tile, made
  whole = natural_bytes * math.prod(sizes[a] for a in own)
  model.emit(comms, ALL_GATHER, sum(1 << a for a in own), whole)
  return tile, max(made, whole)
