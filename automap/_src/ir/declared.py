"""Rules users declare for primitives automap has none for (`automap.declare_rule`).

A rule is "elementwise" (every operand and result dim of one shape shares
one factor, as `add` does), "identity" (one operand, the result is it), or
an einsum-style spec: one letter per dim, operands before "->" and results
after it, comma-separated ("bij,bjk->bik"); a letter no result has is a
reduction factor, whose partial sums XLA combines with a collective, and a
"." marks a dim that must stay whole. Declared rules win over the built-in
ones and hold for the rest of the process, as JAX's own primitive
registrations do.
"""

from __future__ import annotations

import re
from typing import Any

from automap._src.ir.factor_rule import UNSHARDABLE, Builder, Rule, Shape

ELEMENTWISE, IDENTITY = "elementwise", "identity"
_SPEC = re.compile(r"^[a-z.]*(,[a-z.]*)*->[a-z.]*(,[a-z.]*)*$")

# primitive name -> its declared rule (ELEMENTWISE, IDENTITY or a spec).
_DECLARED: dict[str, str] = {}


class RuleError(ValueError):
  """A declared rule that is malformed or does not fit an equation."""


def declare(primitive: Any, rule: str) -> None:
  """Declares how `primitive`'s results are laid out from its operands'.

  Args:
    primitive: a `jax.extend.core.Primitive`, or its name.
    rule: "elementwise", "identity", or an einsum-style spec such as
      "bij,bjk->bik" (a letter per dimension, "." for one kept whole); the
      module docstring gives the forms.

  Returns:
    None; the rule holds for every later trace in this process.

  Raises:
    automap.RuleError: `primitive` is neither a primitive nor a name, or
      `rule` is none of the forms above.
  """
  name = getattr(primitive, "name", primitive)
  if not isinstance(name, str) or not name:
    raise RuleError(
        f"declare_rule: primitive must be a jax.extend.core.Primitive or its name, got "
        f"{primitive!r}.")
  spec = rule.replace(" ", "") if isinstance(rule, str) else rule
  if spec not in (ELEMENTWISE, IDENTITY) and not (isinstance(spec, str) and _SPEC.match(spec)):
    raise RuleError(
        f"declare_rule({name!r}, ...): rule must be 'elementwise', 'identity' or an "
        f"einsum-style spec such as 'bij,bjk->bik' (a letter per dim, '.' for a dim kept "
        f"whole), got {rule!r}.")
  _DECLARED[name] = spec


def declared(primitive: str) -> bool:
  return primitive in _DECLARED


def rule_of(primitive: str, in_shapes: list[Shape | None], out_shapes: list[Shape]) -> Rule:
  """The declared rule of `primitive` on an equation of these shapes."""
  spec = _DECLARED[primitive]
  b = Builder()
  if spec in (ELEMENTWISE, IDENTITY):
    if spec == IDENTITY and (len(in_shapes) != 1 or len(out_shapes) != 1
                             or in_shapes[0] != out_shapes[0]):
      raise RuleError(
          f"the rule declared for {primitive!r} is 'identity', but the equation takes "
          f"{in_shapes} to {out_shapes}: one operand of the result's shape was expected.")
    shape = max(out_shapes, key=len)
    factors = [b.new(n) for n in shape]

    def member(s: Shape | None):
      if s is None:
        return None
      if tuple(s) == tuple(shape):
        return factors
      if not s:
        return []
      raise RuleError(
          f"the rule declared for {primitive!r} is {spec!r}, but its operands and results "
          f"have shapes {in_shapes} and {out_shapes}: elementwise ones share one shape "
          "(scalars aside).")

    return b.rule([member(s) for s in in_shapes], [member(s) for s in out_shapes])
  left, right = spec.split("->")
  operands, results = left.split(","), right.split(",")
  if len(operands) != len(in_shapes) or len(results) != len(out_shapes) or any(
      len(d) != len(s or ()) for d, s in zip(operands + results, in_shapes + out_shapes)):
    raise RuleError(
        f"the rule declared for {primitive!r}, {spec!r}, does not fit its equation: "
        f"operand shapes {in_shapes}, result shapes {out_shapes}; give a letter per dim.")
  factor: dict[str, int] = {}
  size: dict[str, int] = {}
  for dims, shape in zip(operands + results, in_shapes + out_shapes):
    for letter, n in zip(dims, shape or ()):
      if letter != "." and size.setdefault(letter, n) != n:
        raise RuleError(
            f"the rule declared for {primitive!r}, {spec!r}, gives {letter!r} two sizes "
            f"({size[letter]} and {n}) on operand shapes {in_shapes}, results {out_shapes}.")
  for letter in size:
    factor[letter] = b.new(size[letter])
  as_factors = lambda dims: [UNSHARDABLE if c == "." else factor[c] for c in dims]  # noqa: E731
  return b.rule([as_factors(d) for d in operands], [as_factors(d) for d in results])


__all__ = ["ELEMENTWISE", "IDENTITY", "RuleError", "declare", "declared", "rule_of"]
