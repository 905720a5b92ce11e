"""The search's action space: group tilings and tactics (macro actions).

An action rewrites the sharding state and propagation does the rest:

- `Tile(group, dim, axis)`: tile `dim` of every member of a layer group
  over a mesh axis (members that cannot take it are skipped);
- `Tactic(name, axes)`: an expert strategy applied on top of the state
  (data parallelism, Megatron, FSDP/ZeRO, sequence parallelism, and for a
  mixture of experts expert parallelism: every layer's stack of experts
  split along its expert dim over one axis, composing with the others on
  the rest).

Candidates are the values that matter: arguments (parameters, optimizer
state, the batch), grouped across repeated layers, and the few
intermediates larger than every argument (attention scores, logits).
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from automap._src.cost.program import Program
from automap._src.ir import graph as graph_lib
from automap._src.ir.groups import Group, colours, find_groups, structural_groups
from automap._src.search import tactics
from automap._src.sharding.state import State, concat

# At most this many groups of large intermediates become candidates.
_MAX_INTERMEDIATE_GROUPS = 8


@dataclasses.dataclass(frozen=True)
class Tile:
  group: int
  dim: int
  axis: int


@dataclasses.dataclass(frozen=True)
class Tactic:
  name: str  # "data-parallel" | "expert" | "megatron" | "fsdp" | "sequence"
  axes: tuple[int, ...]


Action = Tile | Tactic


class ActionSpace:
  """The actions of one program and the groups they act on."""

  def __init__(self, program: Program, patterns: tuple[str, ...] = (),
               with_tactics: bool = True):
    """`with_tactics=False`: tilings only, no expert strategies as actions."""
    self.program = program
    g = program.graph
    self.prop = program.propagator()
    self.colour = colour = colours(g)  # [V] Weisfeiler-Lehman colour of each value
    self.groups: list[Group] = find_groups(g, program.traced, patterns, program.fixed,
                                           colour)
    largest = max((int(g.nbytes[v]) for v in g.inputs), default=0)
    big = [v for v in range(g.num_values)
           if g.kind[v] == graph_lib.INTERMEDIATE and not g.sealed[v]
           and g.rank(v) > 0 and g.nbytes[v] > largest]
    inter = structural_groups(g, big, colour)
    inter.sort(key=lambda x: -self.group_bytes(x))
    self.groups += inter[:_MAX_INTERMEDIATE_GROUPS]
    # The expert strategies the tactics apply, and the data arguments (the
    # batch: arguments the step does not carry) they split.
    self.experts = tactics.Tactics(program.traced, g, program.mesh, self.prop)
    self.data = self.experts.data
    mesh = program.mesh
    self.real_axes = [a for a in range(mesh.num_axes) if mesh.axis_sizes[a] > 1]
    # Tactics first, then tilings of the biggest groups: the order in which
    # progressive widening admits actions of equal prior.
    self.tactics: list[Tactic] = []
    # Every non-empty set of axes, the widest first.
    combos = [axes for k in range(len(self.real_axes), 0, -1)
              for axes in itertools.combinations(self.real_axes, k)]
    if with_tactics:
      self.tactics += [Tactic("data-parallel", axes) for axes in combos]
      if self.experts.expert_weights:
        self.tactics += [Tactic("expert", (a,)) for a in self.real_axes]
      self.tactics += [Tactic("megatron", (a,)) for a in self.real_axes]
      self.tactics += [Tactic("fsdp", axes) for axes in combos]
      self.tactics += [Tactic("sequence", (a,)) for a in self.real_axes]
    order = sorted(range(len(self.groups)), key=lambda i: -self.group_bytes(self.groups[i]))
    self.tiles = [Tile(i, d, a) for i in order
                  for d in range(g.rank(self.groups[i].members[0]))
                  for a in self.real_axes]

  def group_bytes(self, group: Group) -> int:
    return int(self.program.graph.nbytes[list(group.members)].sum())

  def legal(self, state: State) -> list[Action]:
    """The actions that may change `state`, in widening order. Tactics are
    listed when one of their seeds is free; a tactic that still changes
    nothing is pruned when tried."""
    can = self.prop.can_tile
    out: list[Action] = []
    for t in self.tactics:
      if t.name in ("data-parallel", "sequence"):
        d = 0 if t.name == "data-parallel" else 1
        if not any(self.program.graph.rank(v) > d and can(state, v, d, a)
                   for v in self.data for a in t.axes):
          continue
      elif t.name == "expert":
        if not any(can(state, w, d, t.axes[0]) for w, d in self.experts.expert_weights):
          continue
      out.append(t)
    out += [t for t in self.tiles
            if any(can(state, v, t.dim, t.axis) for v in self.groups[t.group].members)]
    return out

  def apply(self, state: State, action: Action) -> np.ndarray:
    """Carries out `action` on `state` in place; returns the values changed."""
    if isinstance(action, Tactic):
      t = self.experts
      if action.name == "data-parallel":
        return t.data_parallel(state, action.axes)
      if action.name == "fsdp":  # axis by axis: later axes nest in earlier ones
        return concat(t.fsdp(state, a) for a in action.axes)
      return getattr(t, action.name)(state, action.axes[0])
    a = action.axis
    seeds = [(v, a) for v in self.groups[action.group].members
             if len(self.prop.tile(state, v, action.dim, a, propagate=False))]
    return concat([[v for v, _ in seeds], self.prop.propagate(state, seeds)])

  def describe(self, action: Action) -> str:
    names = self.program.mesh.axis_names
    if isinstance(action, Tactic):
      return f"{action.name}({','.join(names[a] for a in action.axes)})"
    group = self.groups[action.group]
    return f"tile {group.name} dim {action.dim} over {names[action.axis]!r}"

