"""Buffers XLA's alias analysis shares across control flow.

A while loop runs in one buffer per carry: its initial value, the body's
parameter, the body's new value and the loop's result alias
(`HloAliasAnalysis`), and a conditional's result aliases each branch's
value; copy insertion (`CopyInsertion`) adds a copy only where two of them
are live at once: the initial value read after the loop starts, the old
carry read after the new one is made (a swap). The graph joins these
values by ties ("while_enter", "while_carry", "cond_result"), which
compute nothing; `share_loop_buffers` merges each
group that needs no copy into one buffer.
"""

from __future__ import annotations

import numpy as np

from automap._src.ir.graph import Graph

# Scans are priced as before: their carries' buffers are checked against
# compiled programs as they are (`tests/test_control_flow.py`).
_TIES = frozenset({"while_enter", "while_carry", "cond_result"})
_CARRIES = frozenset({"while_carry"})


def _real_ends(graph: Graph, dead: np.ndarray, at: np.ndarray) -> np.ndarray:
  """[V] each value's last reader that computes (ties aside), -1 for none,
  as its place in the schedule (`at`).
  A carry tie reading a value as another carry's next one holds it (a
  swap: XLA copies)."""
  real = np.full(graph.num_values, -1, np.int64)
  for v in range(graph.num_values):
    for o, pos in graph.uses[v]:
      swap = graph.prims[o] in _CARRIES and pos == 1 and graph.operands[o][0] != v
      if not dead[o] and (graph.prims[o] not in _TIES or swap):
        real[v] = max(real[v], at[o])
  return real


def share_loop_buffers(graph: Graph, start: np.ndarray, end: np.ndarray,
                       temporary: np.ndarray, hostable: np.ndarray,
                       dead: np.ndarray, at: np.ndarray) -> None:
  """Merges each group of tied temporaries XLA keeps in one buffer: its
  first member holds it from the group's first start to its last end
  (where no result's buffer can host it), the others hold none. Times are
  places in the schedule, `at`."""
  real = _real_ends(graph, dead, at)
  parent = np.arange(graph.num_values)
  members: dict[int, list[int]] = {}

  def find(x: int) -> int:
    while parent[x] != x:
      parent[x] = parent[parent[x]]
      x = int(parent[x])
    return x

  def join(x: int, y: int) -> None:
    """One buffer for both groups unless a member of one is read after a
    member of the other is made (XLA would copy)."""
    rx, ry = find(x), find(y)
    if rx == ry:
      return
    mx, my = members.get(rx, [rx]), members.get(ry, [ry])
    for a in mx:
      for b in my:
        if start[a] == start[b]:
          return
        first, then = (a, b) if start[a] < start[b] else (b, a)
        if real[first] > start[then]:
          return
    parent[ry] = rx
    members[rx] = mx + my
    members.pop(ry, None)

  def ok(v: int) -> bool:
    return v >= 0 and bool(temporary[v])

  for o in range(graph.num_ops):
    prim = graph.prims[o]
    if prim not in _TIES or dead[o] or not graph.results[o] or not ok(graph.results[o][0]):
      continue
    made, operands = graph.results[o][0], graph.operands[o]
    if prim == "while_enter":
      if ok(operands[0]):
        join(operands[0], made)
    elif prim in _CARRIES:
      carry, new = operands[0], operands[1]
      if ok(carry):
        join(carry, made)
      if ok(new):
        join(carry if ok(carry) else made, new)
    else:  # cond_result: each branch's value
      for branch in operands[1:]:
        if ok(branch):
          join(made, branch)
  for group in members.values():
    root = min(group, key=lambda v: (start[v], v))
    first, last = min(start[group]), max(end[group])
    temporary[group] = False
    hostable[group] = False
    temporary[root] = True
    start[root], end[root] = first, last


def is_outer_product(graph: Graph, o: int) -> bool:
  """A dot_general with no contracting dim, which XLA's algebraic
  simplifier rewrites into a multiply of broadcasts (then loop-fused)."""
  return graph.prims[o] == "dot_general" and not any(graph.rules[o].reduction)
