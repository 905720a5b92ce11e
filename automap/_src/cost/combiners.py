"""XLA's collective combiners: which collectives become one.

XLA merges collectives of one kind, axes and element type
(`CombineInstructionsByKey` in `collective_combiner_utils.h`, run by
`CpuAllReduceCombiner` on XLA:CPU and by the all-reduce, all-gather and
reduce-scatter combiners on XLA:GPU): it walks the program in order and
closes a group where the next collective would depend on one in it, or take
it past the compiler's limits on result bytes and count
(`Compiler.combine_bytes`, `Compiler.combine_count`).
"""

from __future__ import annotations

import numpy as np

from automap._src.cost.collectives import ALL_REDUCE
from automap._src.cost.compiler import Compiler
from automap._src.cost.model import CostModel


def windows(ready: dict[int, int], size: dict[int, float], compiler: Compiler
            ) -> dict[int, int]:
  """{op: time of the combined collective that reduces it} for independent
  late reductions, each ready (its input made) at `ready[op]` and moving
  `size[op]` bytes of result: groups in order of readiness, each closed at
  the compiler's byte or count limit and run once its last input is made;
  one over the byte limit runs alone."""
  out: dict[int, int] = {}
  members: list[int] = []  # the open group, its result bytes in `total`
  total = 0.0
  for o in sorted(ready, key=lambda o: (ready[o], o)) + [-1]:  # -1 closes the last
    nbytes = size[o] if o >= 0 else 0.0
    if members and (o < 0 or total + nbytes > compiler.combine_bytes
                    or len(members) >= compiler.combine_count):
      out.update(dict.fromkeys(members, ready[members[-1]]))
      members, total = [], 0.0
    if o >= 0:
      members.append(o)
      total += nbytes
  return out


def merged_away(model: CostModel, op_ids: np.ndarray, reassociated: frozenset[int] = frozenset()
                ) -> dict[tuple[int, int], int]:
  """{(kind, axes mask): how many collectives XLA's combiners merge away}.

  XLA's combiners (`CombineInstructionsByKey`) merge collectives of one
  kind, axes and element type in program order while none depends on
  another in the group, up to the compiler's byte and count limits: the
  independent collectives at each depth of dependency, counted in
  collectives of the same key upstream, become one (dq, dk and dv's
  all-reduces; a step's gradient reductions). Collectives inside loops
  and branches are left apart (each computation combines its own).
  `op_ids` are each op's memo entries in the layout priced; the ops in
  `reassociated` have their all-reduce folded into a later one's
  (`reassociate.saved`) and are left out."""
  g = model.graph
  compiler = model.compiler
  emitted: dict[tuple[int, int], dict[int, float]] = {}  # key -> {op: bytes}
  for o in np.flatnonzero(model.memo.has_comms[op_ids]).tolist():
    if g.trips[o] > 1 or g.regions[o]:
      continue
    for kind, mask, nbytes, _, position, *_ in model.memo.entries[op_ids[o]].comms:
      if position < 0 and kind in compiler.combines and not (
          kind == ALL_REDUCE and o in reassociated):
        made = [v for v in g.results[o] if v >= 0]
        dtype = str(g.dtypes[made[0]]) if made else ""
        ops = emitted.setdefault((kind, mask, dtype), {})
        ops[o] = ops.get(o, 0.0) + nbytes
  away: dict[tuple[int, int], int] = {}
  for (kind, mask, _), ops in emitted.items():
    depth = np.zeros(g.num_values, np.int64)  # same-key collectives upstream
    groups: dict[int, list[float]] = {}  # depth -> [bytes, count] of the open group
    merged = 0
    for o in range(min(ops), g.num_ops):
      up = max((int(depth[v]) for v in g.operands[o] if v >= 0), default=0)
      if o in ops:
        up += 1
        nbytes, group = ops[o], groups.get(up)
        if nbytes > compiler.combine_bytes:
          pass  # never combined
        elif (group is None or group[1] >= compiler.combine_count
              or group[0] + nbytes > compiler.combine_bytes):
          groups[up] = [nbytes, 1]
        else:
          group[0] += nbytes
          group[1] += 1
          merged += 1
      for v in g.results[o]:
        if v >= 0:
          depth[v] = up
    if merged:
      away[(kind, mask)] = away.get((kind, mask), 0) + merged
  return away
