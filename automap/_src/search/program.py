"""Program: one traced signature with its graph, mesh, cost model and pins.

Built once per (function, argument signature, mesh, hardware) and shared by
search, evaluation and plan making.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping

import numpy as np
from jax.sharding import PartitionSpec

from automap._src.cost.compiler import Compiler
from automap._src.cost.hardware import Hardware
from automap._src.cost.model import KINDS, CostModel
from automap._src.cost.tracker import Tracker
from automap._src.ir import graph as graph_lib
from automap._src.ir.graph import Graph
from automap._src.ir.naming import layer_of
from automap._src.ir.trace import Traced
from automap._src.plan import report
from automap._src.plan.plan import Plan, Yardstick
from automap._src.search import tactics
from automap._src.sharding.mesh import MeshError, MeshSpec
from automap._src.sharding.propagation import Propagator
from automap._src.sharding.state import State, empty_state, set_spec, spec_from_row, spec_of


@dataclasses.dataclass
class Program:
  traced: Traced
  graph: Graph
  mesh: MeshSpec
  hardware: Hardware
  model: CostModel
  pinned: State  # [V, A] user-fixed layouts (rows of unfixed values unused)
  fixed: np.ndarray  # [V] bool

  @classmethod
  def build(cls, traced: Traced, mesh: MeshSpec, hardware: Hardware,
            fixed_specs: Mapping[str, PartitionSpec] | None = None,
            compiler: Compiler | None = None) -> Program:
    graph = graph_lib.build(traced)
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
        before = pinned[v].copy()
        set_spec(pinned, mesh, v, graph.shapes[v], spec,
                 f"Hints.fixed[{pattern!r}] for argument {graph.names[v]!r}")
        if fixed[v] and (before != pinned[v]).any():
          raise MeshError(
              f"Hints.fixed gives argument {graph.names[v]!r} two different "
              f"specs ({spec_of(before[None], mesh, 0, graph.rank(v))} and "
              f"{spec}); make the patterns disjoint.")
        fixed[v] = True
    return cls(traced, graph, mesh, hardware,
               CostModel(graph, mesh, hardware, compiler), pinned, fixed)

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
    """The pinned layouts, propagated."""
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
      set_spec(state, mesh, v, g.shapes[v], spec, f"{what} for {g.names[v]!r}")
      fixed[v] = True
    prop = self.propagator()
    prop.fixed = fixed
    prop.seed_all(state)
    return state

  def state_from_specs(self, flat_specs) -> State:
    """The state of a hand-written strategy given per flat argument."""
    return self.pinned_state(zip(self.graph.inputs, flat_specs), "in_shardings")

  def state_from_plan(self, plan: Plan) -> State:
    """The state a plan pins: its argument, result and intermediate layouts."""
    g = self.graph
    layouts = list(zip(g.inputs, plan.in_specs)) + list(plan.constraints.items())
    layouts += list(plan.inferred.items())
    layouts += [(v, s) for v, s in zip(g.outputs, plan.out_specs) if v >= 0]
    return self.pinned_state(layouts, "plan layout")

  def memory_lower_bound(self) -> float:
    """No plan needs fewer bytes per device: arguments and results must be
    resident, spread at best evenly over every device."""
    g = self.graph
    outs = [v for v in g.outputs if v >= 0 and g.kind[v] == graph_lib.INTERMEDIATE]
    total = float(g.nbytes[list(g.inputs)].sum() + g.nbytes[outs].sum())
    return total / self.mesh.num_devices

  def make_plan(self, state: State, stats: dict,
                memory_limit: float | None = None) -> Plan:
    g, mesh = self.graph, self.mesh
    tracker = Tracker(self.model, state)
    op_costs = tracker.ops
    spec = lambda v: spec_of(state, mesh, v, g.rank(v)) if v >= 0 else PartitionSpec()  # noqa: E731
    # Every intermediate the rewritten program can name is pinned, so XLA
    # partitions exactly the state the cost model priced.
    # Values XLA makes anew in whatever layout their readers want (a
    # broadcast constant, an iota) are left to it: pinned, XLA may gather
    # the constant instead.
    free = self.model.free
    # A sealed call (custom derivatives, remat) is bound whole: its results
    # are pinned where it returns them, what it makes inside is left to XLA.
    named = ~g.sealed | g.bound
    constraints = {v: spec(v) for v in range(g.num_values)
                   if g.kind[v] == graph_lib.INTERMEDIATE and named[v]
                   and g.rank(v) > 0 and not free[v]}
    # Those it cannot name are recorded, so the plan re-prices as searched.
    inferred = {v: spec(v) for v in range(g.num_values)
                if g.kind[v] == graph_lib.INTERMEDIATE and not named[v]
                and g.rank(v) > 0 and not free[v]}
    # Operands entering an op in another layout are resharded explicitly, and
    # a result the op computes in another layout than its own is pinned to
    # that layout first: XLA then moves data the way the cost model priced,
    # not by a strategy of its own.
    reshards, natural = {}, {}
    for o in range(g.num_ops):
      results = g.results[o]
      if not results or g.sealed[results[0]]:
        continue
      for p, row in op_costs[o].reshards.items():
        v = g.operands[o][p]
        if not free[v]:
          reshards[(results[0], p)] = spec_from_row(row, mesh, g.rank(v))
      for v, row in zip(results, op_costs[o].natural):
        if row is not None and v in constraints and tuple(state[v]) != row:
          natural[v] = spec_from_row(row, mesh, g.rank(v))
    collectives: dict[tuple, list] = {}
    copies = set()  # a resharded copy is made once, for its first reader
    for o, c in enumerate(op_costs):
      for kind, mask, nbytes, _, position, target in c.comms:
        if position >= 0:
          copy = self.model.copy_key(o, position, kind, mask, target, nbytes)
          if copy in copies:
            continue
          copies.add(copy)
        axes = tuple(n for a, n in enumerate(mesh.axis_names) if mask >> a & 1)
        key = (layer_of(g.scopes[o], depth=8), kind, axes)
        acc = collectives.setdefault(key, [0.0, 0])
        acc[0] += nbytes
        acc[1] += 1
    return Plan(
        mesh=mesh, hardware=self.hardware, fingerprint=g.fingerprint,
        in_paths=self.traced.in_paths, out_paths=self.traced.out_paths,
        in_shapes=tuple(tuple(a.shape) for a in self.traced.in_avals),
        in_specs=tuple(spec(v) for v in g.inputs),
        out_specs=tuple(spec(v) for v in g.outputs),
        constraints=constraints, reshards=reshards, natural=natural,
        inferred=inferred, cost=tracker.cost(),
        collectives=tuple((s, KINDS[k], a, b, n)
                          for (s, k, a), (b, n) in collectives.items()),
        stats=stats, memory_limit=memory_limit,
        layers=report.layers(self, tracker), yardsticks=self.yardsticks(state),
        in_tree=self.traced.in_tree, out_tree=self.traced.out_tree)

  def yardsticks(self, state: State) -> dict[str, Yardstick]:
    """The expert strategies' costs, and where their argument layouts
    differ from `state`'s."""
    g, mesh = self.graph, self.mesh
    out = {}
    for name, other in tactics.yardsticks(self).items():
      differs = {}
      for v, path in zip(g.inputs, self.traced.in_paths):
        if (state[v] != other[v]).any():
          differs[path] = spec_of(other, mesh, v, g.rank(v))
      out[name] = Yardstick(Tracker(self.model, other).cost(), differs)
    return out
