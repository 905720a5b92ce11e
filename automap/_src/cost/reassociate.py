"""XLA's all-reduce reassociation: a sum of two all-reduced values is one
all-reduce of their sum.

`AllReduceReassociate` (`all_reduce_reassociate.cc`) rewrites
`add(all-reduce(x), all-reduce(y))` into `all-reduce(add(x, y))` where the
two all-reduces reduce over the same groups and element type and each has
the add as its only reader (looked through reshapes and converts); applied
in post order, a chain of such adds ends in one all-reduce. XLA:GPU runs it
in its collective optimizations (`gpu_compiler.cc`); XLA:TPU's compiled HLO
shows it (a weight read twice, its two data-parallel gradient contributions
all-reduced once: `tests/cost/test_tpu_rules.py`); XLA:CPU's pipeline has no
such pass and all-reduces each (`Compiler.reassociates_all_reduces`).

In a program: a gradient summed from several partial contributions (a tied
embedding's lookup and head, a residual stream's branches under Megatron)
is all-reduced once, not once per contribution.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from automap._src.cost.collectives import ALL_REDUCE, KINDS
from automap._src.ir.graph import Graph

# Sums, and the ops an all-reduce's value is read through on the way to
# one: reshapes and converts, as the pass looks through them (a transpose
# it does not, though XLA:TPU's compile reassociates some: left out).
_SUMS = frozenset({"add", "add_any"})
_THROUGH = frozenset({"reshape", "squeeze", "expand_dims", "convert_element_type"})


@dataclasses.dataclass(frozen=True)
class Sums:
  """The sums a program's all-reduces may be reassociated across.

  Attributes:
    found: (sum op, its result, source value 0, source value 1) each.
    makers: [N, 2] the op making each source value where it makes it alone
      (-1: a value with no maker, or one of several results).
    chained: [N, 2] whether each source value is an earlier sum's result
      (reduced once that sum is reassociated).
  """

  found: tuple[tuple[int, int, int, int], ...]
  makers: np.ndarray
  chained: np.ndarray

  def __len__(self) -> int:
    return len(self.found)


def candidates(graph: Graph) -> Sums:
  """Every binary sum whose two operands are each read by it alone, traced
  back through single-reader reshapes and converts to the value an op
  makes; in program order (a chain's inner sums first)."""
  g = graph
  outputs = frozenset(g.outputs)
  out = []
  for o, prim in enumerate(g.prims):
    if prim not in _SUMS or len(g.operands[o]) != 2 or len(g.results[o]) != 1:
      continue
    sources = [_source(g, v, outputs) for v in g.operands[o]]
    if all(s >= 0 for s in sources) and sources[0] != sources[1] and g.results[o][0] >= 0:
      out.append((o, g.results[o][0], sources[0], sources[1]))
  results = {r for _, r, _, _ in out}
  sources = np.array([(s0, s1) for *_, s0, s1 in out], np.int64).reshape(-1, 2)
  makers = np.array([[_maker(g, v) for v in pair] for pair in sources], np.int64).reshape(-1, 2)
  chained = np.isin(sources, list(results)).reshape(-1, 2)
  return Sums(tuple(out), makers, chained)


def _maker(g: Graph, v: int) -> int:
  p = int(g.producer[v])
  return p if p >= 0 and len(g.results[p]) == 1 else -1


def _source(g: Graph, v: int, outputs: frozenset[int]) -> int:
  """The value v is read from through single-reader views, or -1 where v
  is a literal or has other readers (a program output among them)."""
  while v >= 0 and len(g.uses[v]) == 1 and v not in outputs:
    p = int(g.producer[v])
    if p < 0 or g.prims[p] not in _THROUGH or len(g.operands[p]) != 1:
      return v
    v = g.operands[p][0]
  return -1


def saved(model, op_ids: np.ndarray, sums: Sums | tuple = ()
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, frozenset[int]]:
  """([kinds, masks] bytes, count, seconds) of the all-reduces XLA's
  reassociation removes, with `op_ids` each op's memo entry: at each sum of
  two values all-reduced over the same axes in the same bytes (made so by
  their ops, or by a sum reassociated before), one of the two; and the ops
  whose all-reduce is the one removed (for the combiners' count). Only the
  sums whose two sources may be reduced are walked (each made by an op
  with one all-reduce of its result, or by an earlier sum): a search
  re-prices this after every action."""
  shape = (len(KINDS), model.masks)
  nbytes, count, seconds = np.zeros(shape), np.zeros(shape, np.int64), np.zeros(shape)
  removed: set[int] = set()
  if not sums:
    return nbytes, count, seconds, frozenset()
  g, memo = model.graph, model.memo
  lone = memo.lone_all_reduce[op_ids[np.maximum(sums.makers, 0)]] & (sums.makers >= 0)
  may = (lone | sums.chained).all(axis=1)
  reduced: dict[int, tuple[int, float, float]] = {}  # value -> (mask, bytes, seconds)

  def made_reduced(v: int) -> tuple[int, float, float] | None:
    if v in reduced:
      return reduced[v]
    p = int(g.producer[v])
    if p < 0 or len(g.results[p]) != 1:
      return None
    ars = [(mask, b, s) for kind, mask, b, s, position, *_ in memo.entries[op_ids[p]].comms
           if kind == ALL_REDUCE and position < 0]
    if len(ars) != 1:
      return None
    mask, b, s = ars[0]
    if model.combined(p, ALL_REDUCE):  # its latency is its combined group's
      s -= model.latency[ALL_REDUCE, mask]
    return mask, b, s

  for i in np.flatnonzero(may):
    _, result, s0, s1 = sums.found[i]
    left, right = made_reduced(s0), made_reduced(s1)
    if left is None or right is None or left[0] != right[0] or left[1] != right[1]:
      continue
    mask, b, s = left
    nbytes[ALL_REDUCE, mask] += b
    count[ALL_REDUCE, mask] += 1
    seconds[ALL_REDUCE, mask] += min(s, right[2])
    reduced[result] = (mask, b, max(s, right[2]))
    removed.add(int(g.producer[s0 if s0 not in reduced else s1]))
  return nbytes, count, seconds, frozenset(removed)
