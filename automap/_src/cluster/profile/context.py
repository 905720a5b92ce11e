"""Context parallelism within a stage: its mesh, and its weight-gradient
reductions deferred to the sync.

A stage of tensor x context devices is a ("context", "model") mesh, the
tensor group minor (within a node). Each device of a context group
computes its parameters' gradients from its share of the sequence: partial
sums, which XLA all-reduces over the group where each microbatch makes
them. Megatron-LM and Llama 3's trainer accumulate them and reduce once
per batch over the data x context group, with the data-parallel sync
(`stage_costs`: `Problem.context`); a layer graph priced for a stated
split takes those reductions out of its microbatch's time.
"""

from __future__ import annotations

import numpy as np

from automap._src.cost.collectives import ALL_REDUCE
from automap._src.sharding.mesh import MeshSpec

CONTEXT = "context"  # the mesh axis a stage's context group runs over


def stage_mesh(devices: int, context: int = 1) -> MeshSpec:
  """The mesh of a stage of `devices`, `context` of them splitting the
  sequence: ("model",) alone without context parallelism."""
  if context == 1:
    return MeshSpec(("model",), (devices,))
  return MeshSpec((CONTEXT, "model"), (context, devices // context))


def deferred_seconds(program, state: np.ndarray, params: set[int],
                     forward: np.ndarray) -> np.ndarray:
  """[O] seconds of each backward op's all-reduces over the context axis
  alone that finish a parameter-shaped result (a weight's or a bias's
  gradient); zeros where the mesh has no context axis."""
  g, model = program.graph, program.model
  out = np.zeros(g.num_ops)
  if CONTEXT not in program.mesh.axis_names:
    return out
  bit = 1 << program.mesh.axis_names.index(CONTEXT)
  shapes = {tuple(g.shapes[v]) for v in params}
  for o in np.flatnonzero(~np.asarray(forward, bool)):
    if not any(v >= 0 and tuple(g.shapes[v]) in shapes for v in g.results[o]):
      continue
    for kind, mask, _, seconds, position, *_ in model.op_cost(state, int(o)).comms:
      if kind == ALL_REDUCE and mask == bit and position < 0:
        out[o] += seconds
  return out


__all__ = ["CONTEXT", "deferred_seconds", "stage_mesh"]
