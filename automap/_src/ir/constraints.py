"""The program's own sharding constraints: read, checked, or stripped.

`with_sharding_constraint` (and flax's logical constraints, which resolve to
it when the step is traced) gives a value a layout at one point of the
program, which XLA honours: its SPMD partitioner reshards the operand into
the constraint's sharding and sharding propagation spreads it to the
neighbours. The graph therefore does not keep a constraint as an op: its
result *is* its operand's value (`graph.Walk` aliases them, so value ids
stay those of the same program without the constraint) and the constraint
is recorded beside the graph as a layout that value takes. What a search
does with that layout is the search's choice (`MODES`); `strip` removes the
constraints from a jaxpr for the modes that must not compile them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jax.extend import core as jex
from jax.sharding import PartitionSpec

# Primitives that state a layout and compute nothing: the constraint, and
# reshards and mesh casts. On the Auto view a program is traced on, a user's
# `reshard` cannot be traced (`trace.py` refuses it): those there are JAX's
# own (AD inserts some), name no axis and lower to nothing, so `graph.Walk`
# passes them through as identities.
CONSTRAINT = "sharding_constraint"
PRIMITIVES = frozenset({CONSTRAINT, "reshard", "mesh_cast"})

# What a search does with the program's constraints.
KEEP, HINTS, IGNORE = "keep", "hints", "ignore"
MODES = (KEEP, HINTS, IGNORE)


class Constraint(NamedTuple):
  """One constraint of the traced program.

  value: the id of the value it lays out (its operand's; -1 for a literal).
  spec: its PartitionSpec, as written (UNCONSTRAINED entries included).
  axes: the mesh it names, as (axis name, size) pairs.
  scope: the name scope it was written in.
  """

  value: int
  spec: PartitionSpec
  axes: tuple[tuple[str, int], ...]
  scope: str

  def where(self) -> str:
    return f"the sharding_constraint at {self.scope or 'the top level'!r}"


def spec_of(eqn) -> tuple[PartitionSpec, tuple[tuple[str, int], ...]]:
  """A constraint equation's PartitionSpec and the (name, size) axes of its mesh."""
  sharding = eqn.params.get("sharding")
  spec = getattr(sharding, "spec", None)
  mesh = getattr(sharding, "mesh", None)
  if not isinstance(spec, PartitionSpec) or mesh is None:
    raise ValueError(
        f"automap reads layouts from NamedShardings, but a {CONSTRAINT} "
        f"at {str(eqn.source_info.name_stack) or 'the top level'!r} gives "
        f"{sharding!r}. Use a jax.sharding.NamedSharding or a PartitionSpec.")
  spec = PartitionSpec(*spec)  # Drops any reduced/unreduced annotations.
  return spec, tuple((str(n), int(mesh.shape[n])) for n in mesh.axis_names)


def strip(closed: jex.ClosedJaxpr) -> jex.ClosedJaxpr:
  """`closed` without its layout constraints, in every nested body."""
  return closed.replace(jaxpr=_strip(closed.jaxpr))


def _strip(jaxpr: jex.Jaxpr) -> jex.Jaxpr:
  subst: dict[Any, Any] = {}

  def read(atom):
    return atom if isinstance(atom, jex.Literal) else subst.get(atom, atom)

  eqns = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in PRIMITIVES:
      subst[eqn.outvars[0]] = read(eqn.invars[0])
      continue
    params = {k: _strip_param(v) for k, v in eqn.params.items()}
    eqns.append(eqn.replace(invars=[read(a) for a in eqn.invars], params=params))
  return jaxpr.replace(eqns=eqns, outvars=[read(a) for a in jaxpr.outvars])


def _strip_param(value):
  if isinstance(value, jex.ClosedJaxpr):
    return strip(value)
  if isinstance(value, jex.Jaxpr):
    return _strip(value)
  if isinstance(value, tuple) and value and all(
      isinstance(v, (jex.ClosedJaxpr, jex.Jaxpr)) for v in value):
    return tuple(_strip_param(v) for v in value)  # cond's branches
  return value


def check_mode(mode, where: str) -> str:
  if mode not in MODES:
    raise ValueError(
        f"{where}: constraints must be one of {MODES}, got {mode!r}: 'keep' "
        "(the program's with_sharding_constraint layouts are fixed decisions), "
        "'hints' (the search starts from them and may undo them) or 'ignore' "
        "(plan as if the program had none).")
  return mode
