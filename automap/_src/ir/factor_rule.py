"""The factor rule of an operation: its data types and how one is built.

A rule names the independent loop dimensions ("factors") of an operation
and, for every dimension of every operand and result, the factor it
indexes (`UNSHARDABLE`: must be whole on every device); `rules.py` holds
each primitive's rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

UNSHARDABLE = -1

Shape = tuple[int, ...]


class Window(NamedTuple):
  """A result dim read from an operand dim through a window of one element
  (a slice, a split's piece, an edge pad): the two dims share `factor`, and
  tiled, XLA brings each device the elements its result tile needs from
  its neighbours (`cost/halo.py`). `low`/`high`: edge padding of the
  operand dim (negative: cropped); a slice [start, limit) has low = -start,
  high = limit - size."""

  factor: int
  operand: int  # operand position
  dim: int  # operand dim
  result: int  # result index
  low: int
  high: int
  stride: int = 1


class Rule(NamedTuple):
  """Factor rule of one operation.

  operands: per operand (literals included), per dimension, a factor id or
    `UNSHARDABLE`; None where an operand has no dims to speak of.
  results: the same for every result.
  sizes: per factor, the largest tile count it admits (its extent).
  reduction: per factor, whether it indexes no result (partial results).
  replicated: the operation has no rule; everything it touches is whole.
  windows: factors a result dim reads through a window (`Window`).
  moved: factors of dims that must be whole while the op computes: tiled,
    XLA moves their tiles to another dim of the result instead of gathering
    them (`HandleElementwiseWithDimsToReplicate`: a concatenate's dim).
    Propagation passes through them as through any factor.
  minor: the second factor of a compound dim, as (member, dim, factor):
    member counts operands first, then results; the dim's entry in
    `operands`/`results` is its major factor.
  """

  operands: tuple[tuple[int, ...] | None, ...]
  results: tuple[tuple[int, ...], ...]
  sizes: tuple[int, ...]
  reduction: tuple[bool, ...]
  replicated: bool = False
  windows: tuple[Window, ...] = ()
  moved: tuple[int, ...] = ()
  minor: tuple[tuple[int, int, int], ...] = ()

  def member_dims(self, member: int) -> tuple[int, ...] | None:
    """Member `member`'s major factor per dim (operands first)."""
    n = len(self.operands)
    return self.operands[member] if member < n else self.results[member - n]

  def factor_on(self, member: int, d: int, before: Sequence[int], tiles: int) -> int:
    """The factor an axis of `tiles` devices tiles on dim d of `member`, the
    axes before it on that dim (mesh order) of `before` devices each: on a
    compound dim, the major factor while the axes divide it, then the
    minor one once it is whole (UNSHARDABLE for an axis straddling
    them, or any after one); on another dim its factor, whose extent the
    caller checks."""
    f = self.member_dims(member)[d]
    minor = [g for m, e, g in self.minor if m == member and e == d]
    if f < 0 or not minor:
      return f
    major = inner = 1
    for n in (*before, tiles):
      if inner == 1 and self.sizes[f] % (major * n) == 0:
        major *= n
        owner = f
      elif major == self.sizes[f]:
        inner *= n
        owner = minor[0]
      else:
        return UNSHARDABLE
    return owner if self.sizes[owner] % (inner if owner != f else major) == 0 else UNSHARDABLE

  def dim_of(self, member: int, f: int) -> int:
    """The dim of `member` that factor f indexes (major or minor), or -1."""
    dims = self.member_dims(member)
    if dims is not None and f in dims:
      return dims.index(f)
    for m, e, g in self.minor:
      if m == member and g == f:
        return e
    return -1


class Builder:
  """Accumulates factors; `new(size)` returns a fresh factor id."""

  def __init__(self):
    self.sizes: list[int] = []

  def new(self, size: int) -> int:
    if size <= 1:
      return UNSHARDABLE  # A unit dimension has nothing to tile.
    self.sizes.append(int(size))
    return len(self.sizes) - 1

  def rule(self, operands, results, windows=(), moved=(), minor=()) -> Rule:
    operands = tuple(None if o is None else tuple(o) for o in operands)
    results = tuple(tuple(r) for r in results)
    in_result = {f for r in results for f in r if f != UNSHARDABLE}
    in_result |= {f for m, _, f in minor if m >= len(operands)}
    reduction = tuple(f not in in_result for f in range(len(self.sizes)))
    return Rule(operands, results, tuple(self.sizes), reduction,
                windows=tuple(w for w in windows if w.factor >= 0), moved=tuple(moved),
                minor=tuple(minor))


def replicated_rule(in_shapes: Sequence[Shape | None],
                    out_shapes: Sequence[Shape]) -> Rule:
  """Every dimension whole: the safe rule for anything we cannot reason about."""
  return Rule(
      tuple(None if s is None else (UNSHARDABLE,) * len(s) for s in in_shapes),
      tuple((UNSHARDABLE,) * len(s) for s in out_shapes), (), (), True)


def scan_tie_rule(name: str, ins: Sequence[Shape], out: Shape) -> Rule:
  """How control flow's operands and results relate to its bodies':
  "scan_slice" takes one [T, ...] operand to its per-step slice,
  "scan_stack" one per-step result to the stacked [T, ...] one; any other
  tie ("scan_carry", "while_carry": initial and body carry to the final
  one; "cond_result": each branch's value to the cond's) gives all its
  members of the result's shape one layout (a cond's index, a loop's
  condition ride along whole). The step dim T stays whole: every device
  runs every step."""
  b = Builder()
  factors = [b.new(n) for n in (out[1:] if name == "scan_stack" else out)]
  if name == "scan_slice":
    return b.rule([[UNSHARDABLE, *factors]], [factors])
  if name == "scan_stack":
    return b.rule([factors], [[UNSHARDABLE, *factors]])
  # A cond's index or a loop's condition rides along whole.
  return b.rule([factors if len(s) == len(out) else [UNSHARDABLE] * len(s) for s in ins],
                [factors])


__all__ = ["UNSHARDABLE", "Builder", "Rule", "Shape", "Window", "replicated_rule",
           "scan_tie_rule"]
