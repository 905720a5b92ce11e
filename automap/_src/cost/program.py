"""Program: one traced signature with its graph, mesh, cost model and pins.

Built once per (function, argument signature, mesh, hardware) and shared by
search, evaluation and plan making (`plan/build.py`); immutable (a program
without its stated layout is `without_layout()`). Pins come from
`Hints.fixed` and, in mode "keep", from the program's own layout
constraints (`ir/constraints.py`): a constrained value has the constraint's
layout, as XLA gives it, with dimensions the constraint leaves
UNCONSTRAINED whole. The layout the arguments state (`sharding/annotations.py`:
`layout=`, flax metadata, their placement) is no pin: it is "your layout",
a yardstick and, on request, a start.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from collections.abc import Mapping

import numpy as np
from jax.sharding import PartitionSpec

from automap._src.cost.compiler import Compiler
from automap._src.cost.hardware import Hardware
from automap._src.cost.model import CostModel
from automap._src.ir import constraints as constraints_lib
from automap._src.ir import graph as graph_lib
from automap._src.ir.constraints import Constraint
from automap._src.ir.graph import Graph
from automap._src.ir.naming import is_backward
from automap._src.ir.trace import Traced
from automap._src.sharding.annotations import Layout
from automap._src.sharding.mesh import MeshError, MeshSpec
from automap._src.sharding.propagation import Propagator
from automap._src.sharding.state import State, empty_state, set_spec, spec_of


@dataclasses.dataclass(frozen=True)
class Program:
  """A traced signature on a mesh and hardware: its graph, cost model, and
  the layouts the user pinned (`Hints.fixed`, and the program's constraints
  when `constraints` is "keep"), which no action changes."""

  traced: Traced
  graph: Graph
  mesh: MeshSpec
  hardware: Hardware
  model: CostModel
  pinned: State  # [V, A] user-fixed layouts (rows of unfixed values unused)
  fixed: np.ndarray  # [V] bool
  constraints: str = constraints_lib.KEEP  # what the search does with the program's
  layout: Layout | None = None  # what the arguments state, per flat argument

  @classmethod
  def build(cls, traced: Traced, mesh: MeshSpec, hardware: Hardware,
            fixed_specs: Mapping[str, PartitionSpec] | None = None,
            compiler: Compiler | None = None,
            constraints: str = constraints_lib.KEEP,
            layout: Layout | None = None, graph: Graph | None = None) -> Program:
    """`graph`: `traced`'s, where already built (one trace on several meshes)."""
    constraints_lib.check_mode(constraints, "Program.build")
    graph = graph_lib.build(traced) if graph is None else graph
    pinned = empty_state(graph, mesh)
    fixed = np.zeros(graph.num_values, bool)
    for pattern, spec in (fixed_specs or {}).items():
      hits = [v for v, p in zip(graph.inputs, traced.in_paths)
              if fnmatch.fnmatchcase(p, pattern)]
      if not hits:
        raise MeshError(
            f"Hints.fixed pattern {pattern!r} matches no argument. Argument "
            f"paths look like {list(traced.in_paths[:3])}.")
      for v in hits:
        had = _pin(graph, mesh, pinned, v, spec, fixed[v],
                   f"Hints.fixed[{pattern!r}] for argument {graph.names[v]!r}")
        if had is not None:
          raise MeshError(
              f"Hints.fixed gives argument {graph.names[v]!r} two different "
              f"specs ({had} and {spec}); make the patterns disjoint.")
        fixed[v] = True
    if constraints == constraints_lib.KEEP:
      _pin_constraints(graph, mesh, pinned, fixed)
    elif constraints == constraints_lib.HINTS:
      for c in graph.constraints:  # The search's start: checked now.
        _on_mesh(c, mesh)
    return cls(traced, graph, mesh, hardware,
               CostModel(graph, mesh, hardware, compiler), pinned, fixed, constraints,
               layout if layout is not None and layout.stated else None)

  @property
  def has_constraints(self) -> bool:
    return any(c.value >= 0 for c in self.graph.constraints)

  @property
  def has_user_layout(self) -> bool:
    """Whether the program or its arguments state a layout of their own."""
    return self.has_constraints or self.layout is not None

  def check_layout(self) -> None:
    """A MeshError naming the first argument whose stated layout does not
    fit it on this mesh (an axis it lacks, a dim it does not divide)."""
    state = self.pinned.copy()
    g = self.graph
    for v, spec in zip(g.inputs, self.layout.specs if self.layout is not None else ()):
      if spec is not None:
        _pin(g, self.mesh, state, v, spec, False, f"your layout of argument {g.names[v]!r}")

  def without_layout(self) -> Program:
    """This program with no stated layout of its arguments."""
    return dataclasses.replace(self, layout=None)

  def user_layout(self) -> State:
    """The program as written: the pins, the program's constraints and the
    arguments' own layouts, everything else propagated from them, as XLA's
    propagation would. A pin wins over the layout an argument states. Where
    the arguments state one, those that state none are replicated, as
    `jax.jit` runs arguments it is given no sharding for."""
    g = self.graph
    state, fixed = self.pinned.copy(), self.fixed.copy()
    _pin_constraints(g, self.mesh, state, fixed)
    for v, spec in zip(g.inputs, self.layout.specs if self.layout is not None else ()):
      if not fixed[v]:
        _pin(g, self.mesh, state, v, PartitionSpec() if spec is None else spec, False,
             f"your layout of argument {g.names[v]!r}")
        fixed[v] = True
    return self._propagated(state, fixed)

  def carried_pairs(self) -> list[tuple[int, int]]:
    """(argument, result) value ids of the state a step carries: a result
    under an argument's path, shape and dtype, which the next step reads in
    the layout it comes back in."""
    t, g = self.traced, self.graph
    outs = {(p, tuple(a.shape), str(a.dtype)): v
            for p, a, v in zip(t.out_paths, t.out_avals, g.outputs) if v >= 0}
    pairs = []
    for p, a, v in zip(t.in_paths, t.in_avals, g.inputs):
      u = outs.get((p, tuple(a.shape), str(a.dtype)))
      if u is not None and g.producer[u] >= 0:
        pairs.append((v, u))
    return pairs

  def propagator(self) -> Propagator:
    return Propagator(self.graph, self.mesh, self.fixed)

  def initial_state(self) -> State:
    """The pinned layouts, propagated: a copy of the one state every
    search, tactic and featurizer of this program starts from."""
    return self._initial.copy()

  @functools.cached_property
  def _initial(self) -> State:
    # Propagated once per program (a whole sweep of the graph); a program
    # with other pins is another Program (`dataclasses.replace`).
    state = self.pinned.copy()
    self.propagator().seed_all(state)
    return state

  def pinned_state(self, layouts, what: str) -> State:
    """A state with the given (value, PartitionSpec) layouts fixed and
    everything else propagated from them, as XLA's propagation would."""
    g, mesh = self.graph, self.mesh
    state = self.pinned.copy()
    fixed = self.fixed.copy()
    for v, spec in layouts:
      had = _pin(g, mesh, state, v, spec, self.fixed[v], f"{what} for {g.names[v]!r}")
      if had is not None:
        raise MeshError(
            f"{what} gives {g.names[v]!r} the layout {spec}, but it is pinned to "
            f"{had}{_by_constraint(g, v)}. automap prices one layout per value: "
            "give that one, or trace the program without the pin "
            "(constraints='ignore').")
      fixed[v] = True
    return self._propagated(state, fixed)

  def with_pins(self, layouts, what: str) -> Program:
    """This program with the (value, PartitionSpec) `layouts` fixed too:
    no action of the search changes them."""
    g, mesh = self.graph, self.mesh
    pinned, fixed = self.pinned.copy(), self.fixed.copy()
    for v, spec in layouts:
      had = _pin(g, mesh, pinned, v, spec, fixed[v], f"{what} for {g.names[v]!r}")
      if had is not None:
        raise MeshError(
            f"{what} gives {g.names[v]!r} the layout {spec}, but it is pinned to "
            f"{had}{_by_constraint(g, v)}; trace the program without the pin "
            "(constraints='ignore') or drop the statement.")
      fixed[v] = True
    return dataclasses.replace(self, pinned=pinned, fixed=fixed)

  def _propagated(self, state: State, fixed: np.ndarray) -> State:
    """`state` with its layouts spread, the values of `fixed` left as they are."""
    prop = self.propagator()
    prop.fixed = fixed
    prop.seed_all(state)
    return state

  @property
  def sealed_inside(self) -> np.ndarray:
    """[V] bool: values made inside sealed calls, which a plan cannot pin."""
    return np.asarray(self.graph.sealed, bool) & ~np.asarray(self.graph.bound, bool)

  def as_compiled(self, state: State) -> State:
    """`state` with the values inside sealed calls (remat, custom
    derivatives), which a plan cannot pin, laid out as XLA's propagation
    lays them out from what it pins around them. The search spreads its
    tilings wave by wave, so where a dot's operands reach it split on one
    axis along different factors the first to arrive wins; Shardy's
    op-priority propagation has both there first and keeps the larger
    tensor's factor (`AggressiveFactorPropagation`), as `seed_all` does."""
    g, inner = self.graph, self.sealed_inside
    if not inner.any():
      return state
    named = ~inner
    pins = set(g.inputs) | {v for v in g.outputs if v >= 0}
    pins |= {v for v in np.flatnonzero(named & (g.kind == graph_lib.INTERMEDIATE)).tolist()
             if g.rank(v) > 0 and not self.model.free[v]}
    layouts = [(v, spec_of(state, self.mesh, v, g.rank(v))) for v in sorted(pins)]
    resealed = self.pinned_state(layouts, "plan layout")
    out = state.copy()
    out[inner] = resealed[inner]
    return out

  def state_from_specs(self, flat_specs) -> State:
    """The state of a hand-written strategy given per flat argument."""
    return self.pinned_state(zip(self.graph.inputs, flat_specs), "in_shardings")

  def memory_lower_bound(self) -> float:
    """No plan needs fewer bytes per device: arguments and results must be
    resident, spread at best evenly over every device."""
    g = self.graph
    outs = [v for v in g.outputs if v >= 0 and g.kind[v] == graph_lib.INTERMEDIATE]
    total = float(g.nbytes[list(g.inputs)].sum() + g.nbytes[outs].sum())
    return total / self.mesh.num_devices

  def saved_lower_bound(self) -> float:
    """No plan needs fewer bytes per device when the backward pass starts:
    the arguments still to be read and every value of the forward the
    backward reads (the activations the step saves) are all resident then,
    spread at best evenly over every device. 0 for a program with no
    backward pass."""
    g = self.graph
    first = next((o for o in range(g.num_ops) if is_backward(g.scopes[o])), None)
    if first is None:
      return 0.0
    live = [v for v in range(g.num_values)
            if g.producer[v] < first and any(o >= first for o, _ in g.uses[v])]
    narrows = self.model.compiler.narrows_dot_operands
    # A float32 value the backward reads only as a default-precision dot's
    # operand may be held as the bfloat16 copy its reshard makes
    # (`Compiler.narrows_dot_operands`): half its bytes.
    held = [g.nbytes[v] / 2 if narrows and all(
        g.narrowable(o, p) for o, p in g.uses[v] if o >= first)
        else g.nbytes[v] for v in live]
    return float(sum(held)) / self.mesh.num_devices


def _by_constraint(graph: Graph, v: int) -> str:
  found = [c for c in graph.constraints if c.value == v]
  return f" by {found[0].where()}" if found else ""


def _pin_constraints(graph: Graph, mesh: MeshSpec, pinned: State, fixed: np.ndarray) -> None:
  """Writes the program's constraints into `pinned`/`fixed`: errors name a
  constraint whose mesh axes the mesh lacks, or two that disagree."""
  first: dict[int, Constraint] = {}
  for c in graph.constraints:
    if c.value < 0:
      continue
    spec = _on_mesh(c, mesh)
    had = _pin(graph, mesh, pinned, c.value, spec, fixed[c.value], c.where())
    if had is not None:
      by = (f"{first[c.value].where()}" if c.value in first
            else f"Hints.fixed for argument {graph.names[c.value]!r}")
      raise MeshError(
          f"{c.where()} lays out a value as {spec}, but {by} lays the same value "
          f"out as {had}; automap gives a value one layout. Constrain the value "
          "once (or to one layout), or pass constraints='hints' to let the "
          "search choose.")
    fixed[c.value] = True
    first.setdefault(c.value, c)


def _pin(graph: Graph, mesh: MeshSpec, state: State, v: int, spec: PartitionSpec,
         was_fixed: bool, where: str) -> PartitionSpec | None:
  """Writes `spec` into `state` for value v; the spec it replaced, if v was
  fixed to another (the caller names the conflict), else None."""
  before = state[v].copy()
  set_spec(state, mesh, v, graph.shapes[v], spec, where)
  if was_fixed and (before != state[v]).any():
    return spec_of(before[None], mesh, 0, graph.rank(v))
  return None


def _on_mesh(c: Constraint, mesh: MeshSpec) -> PartitionSpec:
  """`c`'s spec on the search mesh, matched by axis name (UNCONSTRAINED
  dims whole): an error naming `c` if it names an axis the mesh lacks or
  one of another size."""
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  written = dict(c.axes)
  entries = []
  for entry in c.spec:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
      entries.append(None)
      continue
    for name in entry if isinstance(entry, tuple) else (entry,):
      if name not in sizes:
        raise MeshError(
            f"{c.where()} lays its value out as {c.spec}, naming mesh axis "
            f"{name!r}, but the mesh planned on has axes {mesh.axis_names}. Plan "
            "on a mesh with that axis, map the logical axis onto one of these in "
            "your rules, or pass constraints='ignore' to plan as if the program "
            "had no constraints.")
      if written.get(name, sizes[name]) != sizes[name]:
        raise MeshError(
            f"{c.where()} is written for a mesh whose axis {name!r} has "
            f"{written[name]} devices, but the mesh planned on has {sizes[name]} "
            f"({dict(sizes)}). Plan on the mesh the constraint names, or write it "
            "as a bare PartitionSpec, which resolves against the mesh planned on.")
    entries.append(entry)
  return PartitionSpec(*entries)
