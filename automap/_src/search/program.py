"""Program: one traced signature with its graph, mesh, cost model and pins.

Built once per (function, argument signature, mesh, hardware) and shared by
search, evaluation and plan making (`plan/build.py`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping

import numpy as np
from jax.sharding import PartitionSpec

from automap._src.cost.compiler import Compiler
from automap._src.cost.hardware import Hardware
from automap._src.cost.model import CostModel
from automap._src.ir import graph as graph_lib
from automap._src.ir.graph import Graph
from automap._src.ir.trace import Traced
from automap._src.sharding.mesh import MeshError, MeshSpec
from automap._src.sharding.propagation import Propagator
from automap._src.sharding.state import State, empty_state, set_spec, spec_of


@dataclasses.dataclass
class Program:
  """A traced signature on a mesh and hardware: its graph, cost model, and
  the layouts the user pinned (`Hints.fixed`), which no action changes."""

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

  def memory_lower_bound(self) -> float:
    """No plan needs fewer bytes per device: arguments and results must be
    resident, spread at best evenly over every device."""
    g = self.graph
    outs = [v for v in g.outputs if v >= 0 and g.kind[v] == graph_lib.INTERMEDIATE]
    total = float(g.nbytes[list(g.inputs)].sum() + g.nbytes[outs].sum())
    return total / self.mesh.num_devices
