"""A workload's layer passes: the ops an accelerator runs for each layer.

For each workload (a loss function, its arguments and a global batch) the
gradient program is profiled once per tensor-parallel width and microbatch
size (`layers.measure`): per layer, the ops of its forward pass with their
per-device shapes under that width's sharding, and per label (a name
scope's first component) the ops of its backward pass, split over the
label's layers as their forward is; plus the tensor-parallel collectives,
parameters, activations and edges the cost model reads, which the
accelerator does not change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from automap._src.cluster.accelerator import chip as acc_lib
from automap._src.cluster.profile import layers as layers_lib
from automap._src.cluster.profile.layer_graph import LayerGraph
from automap._src.cost.hardware import Hardware
from automap._src.plan import report


@dataclasses.dataclass(frozen=True)
class Workload:
  """A model to train, for `search_accelerator`.

  Attributes:
    loss_fn: `loss_fn(params, *batch) -> scalar`, the loss of one microbatch.
    params: its parameters (arrays or `jax.ShapeDtypeStruct`s).
    batch: its example batch leaves, as a tuple (arrays or
      `jax.ShapeDtypeStruct`s).
    global_batch: samples per optimizer step.
    name: how results name it.
    repeat: layer name -> copies, to let a few profiled blocks stand for a deep
      model (see `LayerGraph.repeat`), e.g. {"block_1": 47} for 48 blocks.
  """

  loss_fn: Callable
  params: object
  batch: tuple
  global_batch: int
  name: str = "model"
  repeat: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class LayerPass:
  """The ops of one layer's forward pass (or one label's backward pass) that
  the accelerator runs, and their precedence edges (i, j) by op index."""

  ops: tuple[acc_lib.Op, ...]
  edges: tuple[tuple[int, int], ...]

  def __post_init__(self):
    # Passes key every memo: hash their hundreds of ops once, not per lookup.
    object.__setattr__(self, "_hash", hash((self.ops, self.edges)))

  def __hash__(self) -> int:
    return self._hash


@dataclasses.dataclass(frozen=True)
class ProfiledWorkload:
  """A workload's layers per (microbatch size, width): ops per pass, and the
  cost model's layer graph for everything the accelerator does not change."""

  workload: Workload
  graphs: dict[int, dict[int, LayerGraph]]
  # (size, width) -> per layer (forward pass, backward share), backward
  # passes per label with the layers they split over and their shares.
  forward: dict[tuple[int, int], list[LayerPass]]
  backward: dict[tuple[int, int], list[tuple[LayerPass, list[int]]]]
  # (size, width) -> per layer, seconds of tensor-parallel collectives in
  # its (forward, backward) pass.
  comm: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]

  def passes(self, size: int, width: int) -> list[LayerPass]:
    """The passes whose times make the layer costs at (size, width)."""
    return self.forward[(size, width)] + [p for p, _ in self.backward[(size, width)]]


def _tile_count(state: np.ndarray, sizes: Sequence[int], v: int, dim: int) -> int:
  """How many pieces `state` cuts value v's dimension `dim` into."""
  return int(np.prod([sizes[a] for a in np.flatnonzero(state[v] == dim)] or [1]))


def _accelerator_op(program, state, o: int) -> acc_lib.Op | None:
  """The accelerator's view of op o under `state` (per device), or None when
  the cost model charges it nothing (fused, free, or a relabel)."""
  g, model = program.graph, program.model
  if model.op_cost(state, o).time <= 0:
    return None
  sizes = program.mesh.axis_sizes
  values = [v for v in g.operands[o] if v >= 0] + list(g.results[o])
  nbytes = sum(model.local_bytes(state, v) for v in values) * g.trips[o]
  prim, rule = g.prims[o], g.rules[o]
  if prim == "dot_general" and not rule.replicated and len(rule.operands) >= 2:
    local: dict[int, int] = {}
    for position in (0, 1):
      v, factors = g.operands[o][position], rule.operands[position]
      for dim, f in enumerate(factors or ()):
        if f >= 0:
          local[f] = max(1, rule.sizes[f] // (_tile_count(state, sizes, v, dim) if v >= 0 else 1))
    lhs = {f for f in rule.operands[0] or () if f >= 0}
    rhs = {f for f in rule.operands[1] or () if f >= 0}
    prod = lambda fs: int(np.prod([local[f] for f in fs] or [1]))  # noqa: E731
    return acc_lib.Op(
        prim, "tensor", m=prod(lhs - rhs), n=prod(rhs - lhs),
        k=prod({f for f in lhs & rhs if rule.reduction[f]}),
        batch=prod({f for f in lhs & rhs if not rule.reduction[f]}) * int(g.trips[o]),
        bytes=nbytes)
  if prim.startswith("conv"):
    # A convolution as a square matmul of its FLOPs.
    side = max(1, round((model.op_cost(state, o).flops / 2) ** (1 / 3)))
    return acc_lib.Op(prim, "tensor", m=side, n=side, k=side,
                      batch=int(g.trips[o]), bytes=nbytes)
  elements = max(model.local_bytes(state, v) / g.dtypes[v].itemsize
                 if hasattr(g.dtypes[v], "itemsize") else 0.0 for v in values)
  return acc_lib.Op(prim, "vector", elements=elements * g.trips[o], bytes=nbytes)


def _layer_pass(program, state, group: list[int]) -> LayerPass:
  """The ops of `group` (op indices in program order) the accelerator runs,
  with precedence from their data flow (through ops it skips)."""
  g = program.graph
  members = set(group)
  kept: dict[int, int] = {}
  ops = []
  for o in group:
    op = _accelerator_op(program, state, o)
    if op is not None:
      kept[o] = len(ops)
      ops.append(op)
  # Nearest kept ancestors of each op's operands, within the group.
  near: dict[int, frozenset] = {}
  edges = set()
  for o in group:
    deps: set[int] = set()
    for v in g.operands[o]:
      p = g.producer[v] if v >= 0 else -1
      if p in members:
        deps |= {kept[p]} if p in kept else near.get(p, frozenset())
    near[o] = frozenset(deps)
    if o in kept:
      edges |= {(d, kept[o]) for d in deps}
  return LayerPass(tuple(ops), tuple(sorted(edges)))


def profile_workload(workload: Workload, hardware: Hardware, widths: Sequence[int],
                     sizes: Sequence[int], search: Callable) -> ProfiledWorkload:
  """The workload's layer passes at each (microbatch size, width); `search`
  as for `layers.measure`."""
  profile = layers_lib.measure(workload.loss_fn, workload.params, workload.batch, widths=widths,
                               hardware=hardware, search=search, sizes=sizes)
  forward, backward, comm = {}, {}, {}
  for (size, t), (program, state) in profile.programs.items():
    cut = layers_lib.LayerCut.of(program.graph)
    fw_ops = [[] for _ in cut.names]
    bw_ops: dict[str, list[int]] = {}
    for o in range(program.graph.num_ops):
      if cut.forward[o]:
        fw_ops[cut.segment[o]].append(o)
      else:
        bw_ops.setdefault(cut.labels[o], []).append(o)
    forward[(size, t)] = [_layer_pass(program, state, ops) for ops in fw_ops]
    backward[(size, t)] = [
        (_layer_pass(program, state, ops), cut.runs.get(label, [len(cut.names) - 1]))
        for label, ops in bw_ops.items()]
    comm[(size, t)] = cut.split(report.op_seconds(program.model, state)[1])
  return ProfiledWorkload(workload, profile.graphs, forward, backward, comm)


def all_passes(profiled: ProfiledWorkload) -> list[LayerPass]:
  """Every distinct pass of the workload, in profiling order."""
  return list(dict.fromkeys([p for ps in profiled.forward.values() for p in ps]
                            + [p for ps in profiled.backward.values() for p, _ in ps]))


__all__ = ["LayerPass", "ProfiledWorkload", "Workload", "all_passes", "profile_workload"]
