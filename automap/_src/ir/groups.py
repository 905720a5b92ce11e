"""Layer groups: arguments that play the same role in repeated layers.

A search decision taken for one member of a group is taken for every member
at once, so a 24-block transformer costs the search what one block costs.
Groups come from two sources:

- hints: name patterns (fnmatch, e.g. "block_*") matched against argument
  paths ("params/block_3/attn/query/kernel") or, for arguments whose path
  says nothing, against the name scope of the ops that read them (e.g. a
  `jax.named_scope("attention")` used by every layer). Members share the
  path or scope with the matched part replaced by the pattern.
- structure: without a hint, arguments are grouped when their neighbourhoods
  in the graph are identical (Weisfeiler-Lehman colour refinement over op
  types, operand positions, shapes and dtypes): the weights of identical
  blocks, wherever the model code puts them.

Members of a group always have the same shape and dtype.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Sequence

import numpy as np

from automap._src.ir.graph import Graph
from automap._src.ir.trace import Traced

# Rounds of colour refinement: how far (in ops) a neighbourhood must agree.
# Deep enough to tell apart the weights of one block (query from key, the
# first MLP layer from the second, a moment from its parameter), shallow
# enough that the ends of the program do not make every block unique.
_ROUNDS = 4


@dataclasses.dataclass(frozen=True)
class Group:
  """Arguments sharing one decision.

  name: a readable role ("params/block_*/mlp/wi/kernel", or the first
    member's path and the member count for structural groups).
  members: value ids of the arguments, in argument order.
  """

  name: str
  members: tuple[int, ...]


def _match(parts: Sequence[str], patterns: Sequence[str]) -> tuple[str, int, int] | None:
  """(pattern, start, stop) such that parts[start:stop], joined by "/",
  matches the pattern; patterns in the order given. Of a pattern's matches,
  one ending in an index component ("layers/3") comes first, as the index
  is what tells the layers apart; then the shortest, then the earliest."""
  for pattern in patterns:
    spans = [(not parts[stop - 1].isdigit(), stop - start, start, stop)
             for start in range(len(parts)) for stop in range(start + 1, len(parts) + 1)
             if fnmatch.fnmatchcase("/".join(parts[start:stop]), pattern)]
    if spans:
      *_, start, stop = min(spans)
      return pattern, start, stop
  return None


def _hint_role(graph: Graph, traced: Traced, i: int,
               patterns: Sequence[str]) -> tuple[str, str] | None:
  """(role, pattern) of argument i: its path or first matching reader's
  scope with the matched part replaced by the pattern."""
  v = graph.inputs[i]
  parts = traced.in_paths[i].split("/")
  hit = _match(parts, patterns)
  if hit is not None:
    pattern, start, stop = hit
    return "/".join([*parts[:start], pattern, *parts[stop:]]), pattern
  # The path does not say; the first reader's name scope may.
  for o, position in graph.uses[v]:
    scope = graph.scopes[o].split("/")
    hit = _match(scope, patterns)
    if hit is not None:
      pattern, start, stop = hit
      role = "/".join([*scope[:start], pattern, *scope[stop:]])
      return f"{role}:{graph.prims[o]}[{position}]", pattern
  return None


class GroupError(ValueError):
  """A layer-group hint that matches nothing."""


def hint_groups(graph: Graph, traced: Traced, patterns: Sequence[str]) -> list[Group]:
  """Groups of arguments matching `patterns` by path or reader scope."""
  roles: dict[tuple, list[int]] = {}
  names: dict[tuple, str] = {}
  used: set[str] = set()
  for i, v in enumerate(graph.inputs):
    if graph.rank(v) == 0:
      continue
    hit = _hint_role(graph, traced, i, patterns)
    if hit is None:
      continue
    role, pattern = hit
    key = (role, graph.shapes[v], str(graph.dtypes[v]))
    roles.setdefault(key, []).append(v)
    names[key] = role
    used.add(pattern)
  unused = [p for p in patterns if p not in used]
  if unused:
    scopes = sorted({s.split("/")[-1] for s in graph.scopes if s})[:5]
    raise GroupError(
        f"Hints.groups patterns {unused} match no argument path (e.g. "
        f"{list(traced.in_paths[:2])}) and no name scope of an op reading an "
        f"argument (e.g. {scopes}). Patterns match one or more whole path "
        "components, fnmatch-style: 'block_*', 'layers/*'.")
  return [Group(names[k], tuple(vs)) for k, vs in roles.items()]


def colours(graph: Graph, rounds: int = _ROUNDS) -> np.ndarray:
  """[V] int: Weisfeiler-Lehman colours of the values after `rounds` of
  refinement. Values with equal colours have identical neighbourhoods."""
  index: dict = {}

  def intern(key) -> int:
    return index.setdefault(key, len(index))

  value = [intern(("v", s, str(d), int(k)))
           for s, d, k in zip(graph.shapes, graph.dtypes, graph.kind)]
  op = [intern(("o", p, shapes)) for p, shapes in zip(graph.prims, graph.operand_shapes)]
  for _ in range(rounds):
    index = {}
    op = [intern((op[o], tuple(value[v] if v >= 0 else -1 for v in graph.operands[o]),
                  tuple(value[v] for v in graph.results[o])))
          for o in range(graph.num_ops)]
    index = {}
    value = [intern((value[v], op[graph.producer[v]] if graph.producer[v] >= 0 else -1,
                     tuple(sorted((op[o], p) for o, p in graph.uses[v]))))
             for v in range(graph.num_values)]
  return np.asarray(value, np.int64)


def structural_groups(graph: Graph, among: Sequence[int],
                      colour: np.ndarray | None = None) -> list[Group]:
  """Groups of the values `among` with equal colours (`colour`: the
  graph's `colours`, if already computed)."""
  c = colours(graph) if colour is None else colour
  by: dict[int, list[int]] = {}
  for v in among:
    by.setdefault(int(c[v]), []).append(v)
  return [Group(graph.names[vs[0]] if len(vs) == 1 else
                f"{graph.names[vs[0]]} (+{len(vs) - 1} alike)", tuple(vs))
          for vs in by.values()]


def find_groups(graph: Graph, traced: Traced, patterns: Sequence[str] = (),
                fixed: np.ndarray | None = None,
                colour: np.ndarray | None = None) -> list[Group]:
  """Every decision-bearing argument in exactly one group: hint groups
  first, structural groups for the rest. Scalars and fixed arguments are
  left out (there is nothing to decide for them)."""
  free = [v for v in graph.inputs
          if graph.rank(v) > 0 and (fixed is None or not fixed[v])]
  groups = []
  if patterns:
    keep = set(free)
    for g in hint_groups(graph, traced, patterns):
      members = tuple(v for v in g.members if v in keep)
      if members:
        groups.append(Group(g.name, members))
  taken = {v for g in groups for v in g.members}
  groups += structural_groups(graph, [v for v in free if v not in taken], colour)
  return groups
