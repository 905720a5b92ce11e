"""Tactics: expert strategies as seeds of the sharding state.

A tactic names a few decisions a human expert would make; propagation fills
in the rest. They are search starting points and yardsticks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from automap._src.graph import Graph
from automap._src.sharding import MeshSpec, Propagator, State
from automap._src.trace import Traced


def carried_arguments(traced: Traced) -> np.ndarray:
  """[num args] bool: arguments returned under the same path and type.

  In a training step these are the parameters and optimizer state; the rest
  (the batch) is data.
  """
  outs = {(p, tuple(a.shape), str(a.dtype))
          for p, a in zip(traced.out_paths, traced.out_avals)}
  return np.array([(p, tuple(a.shape), str(a.dtype)) in outs
                   for p, a in zip(traced.in_paths, traced.in_avals)], bool)


def data_parallel(traced: Traced, graph: Graph, mesh: MeshSpec,
                  prop: Propagator, state: State,
                  axes: Sequence[int] | None = None) -> list[int]:
  """Splits the leading dim of every data argument over the given mesh axes
  (default all), major first, as far as they divide it; everything else
  follows by propagation. Returns the values changed."""
  carried = carried_arguments(traced)
  axes = range(mesh.num_axes) if axes is None else axes
  seeds = []
  for i, v in enumerate(graph.inputs):
    if carried[i] or graph.rank(v) == 0 or prop.fixed[v]:
      continue
    n = graph.shapes[v][0]
    for a in axes:
      size = mesh.axis_sizes[a]
      tiles = math.prod(mesh.axis_sizes[b] for b in range(mesh.num_axes)
                        if state[v, b] == 0)
      if size > 1 and n % (tiles * size) == 0 and state[v, a] < 0:
        state[v, a] = 0
        seeds.append((v, a))
  return [v for v, _ in seeds] + prop.propagate(state, seeds)
