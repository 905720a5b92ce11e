"""Tactics: expert strategies as macro actions on the sharding state.

A tactic names a few decisions a human expert would make; propagation fills
in the rest. They are search actions, starting points and yardsticks. Each
returns the values it changed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from automap._src.ir.graph import Graph
from automap._src.ir.trace import Traced
from automap._src.sharding.mesh import MeshSpec
from automap._src.sharding.propagation import Propagator
from automap._src.sharding.state import State, concat


def carried_arguments(traced: Traced) -> np.ndarray:
  """[num args] bool: arguments returned under the same path and type.

  In a training step these are the parameters and optimizer state.
  """
  outs = {(p, tuple(a.shape), str(a.dtype))
          for p, a in zip(traced.out_paths, traced.out_avals)}
  return np.array([(p, tuple(a.shape), str(a.dtype)) in outs
                   for p, a in zip(traced.in_paths, traced.in_avals)], bool)


def _tail(path: str) -> str:
  """A flat path below its top-level position: "0/w/kernel" -> "w/kernel"."""
  return path.split("/", 1)[1] if "/" in path else ""


def _mirror(path: str, aval, outs: dict):
  """The entry of `outs` ((path, shape, dtype) -> result) an argument at
  `path` comes back as: the same path, or a prefix of it, where the
  argument sits inside a container the step unwraps before it returns the
  array (penzai's `Parameter` holds its `NamedArray` as `value/data_array`;
  the trainer returns the new array under the parameter's own path). None
  for none."""
  key = (tuple(aval.shape), str(aval.dtype))
  while path:
    found = outs.get((path, *key))
    if found is not None:
      return found
    path = path.rsplit("/", 1)[0] if "/" in path else ""
  return None


def state_arguments(traced: Traced) -> np.ndarray:
  """[num args] bool: the model's state rather than its data.

  Carried arguments, and arguments mirrored by a result of the same type
  under the same path below its top-level position (`_mirror`, a
  container's fields below it allowed): the parameters of a (loss, grads)
  function, whose gradients come back as `1/<path>` for `0/<path>`, or
  those of a step returning its new parameters alone as `<path>`. The rest
  (the batch) is data.
  """
  outs = {(_tail(p), tuple(a.shape), str(a.dtype)): True
          for p, a in zip(traced.out_paths, traced.out_avals) if _tail(p)}
  # A step returning its new params alone (not in a tuple) gives `<path>`.
  outs |= {(p, tuple(a.shape), str(a.dtype)): True
           for p, a in zip(traced.out_paths, traced.out_avals) if p}
  mirrored = np.array([_mirror(_tail(p), a, outs) is not None
                       for p, a in zip(traced.in_paths, traced.in_avals)], bool)
  return carried_arguments(traced) | mirrored


# Ops that read a weight whole, each of its dims one of theirs.
_VIEWS = frozenset({"convert_element_type", "copy", "name", "scan_slice", "transpose"})


def _weight(graph: Graph, v: int, carried: set[int]) -> tuple[int, list[int]]:
  """(w, dims): the carried argument w that `v` is, or is a dtype
  conversion, a transpose (HuggingFace's `Conv1D` reads `kernel.T`, a tied
  head `embedding.T`) or (in a scan body) one layer's slice of, and per dim
  of `v` the dim of w it is (-1 for none); (-1, []) for none."""
  if v < 0:
    return -1, []
  dims = list(range(graph.rank(v)))
  while v >= 0 and v not in carried:
    o = graph.producer[v]
    if o < 0 or graph.prims[o] not in _VIEWS:
      return -1, []
    rule = graph.rules[o]
    made, read = rule.results[0], rule.operands[0]
    dims = [read.index(made[d]) if d >= 0 and made[d] >= 0 else -1 for d in dims]
    v = graph.operands[o][0]
  return v, dims


# Ops that take one dim of an array apart into static pieces (a fused
# weight's gates, q|k|v stacked along a dim of its own); a lookup by data
# (a label's logit) is not one.
_PIECES = frozenset({"slice", "split", "squeeze"})
# Ops a value passes through on its way to what takes it apart.
_THROUGH = _VIEWS | frozenset({"reshape", "add", "mul", "sub", "tanh", "logistic"})


def _taken_apart(graph: Graph, v: int, dim: int, depth: int = 8) -> bool:
  """Whether the program takes dim `dim` of value v apart: slices, splits
  or indexes it into pieces (a stack of distinct tensors, such as a fused
  weight's gates), following it through views and elementwise ops."""
  if depth == 0:
    return False
  for o, pos in graph.uses[v]:
    prim, rule = graph.prims[o], graph.rules[o]
    factors = rule.operands[pos] if pos < len(rule.operands) else None
    if factors is None or dim >= len(factors):
      continue
    f = factors[dim]
    if prim in _PIECES:
      made = graph.results[o][0] if graph.results[o] else -1
      kept = f >= 0 and made >= 0 and f in rule.results[0]
      if not kept or graph.shapes[made][list(rule.results[0]).index(f)] < graph.shapes[v][dim]:
        return True
    elif prim in _THROUGH and f >= 0:
      for made, dims in zip(graph.results[o], rule.results):
        if made >= 0 and f in dims and _taken_apart(graph, made, list(dims).index(f), depth - 1):
          return True
  return False


class Tactics:
  """The tactics of one program, with what they act on found once."""

  def __init__(self, traced: Traced, graph: Graph, mesh: MeshSpec, prop: Propagator):
    self.graph, self.mesh, self.prop, self.traced = graph, mesh, prop, traced
    carried = state_arguments(traced)
    self.carried = [v for i, v in enumerate(graph.inputs) if carried[i] and graph.rank(v)]
    self.data = [v for i, v in enumerate(graph.inputs) if not carried[i] and graph.rank(v)]
    # Weights read by contractions, in program order, each with its output
    # (column) dims: factors the result keeps and the other operand lacks;
    # embedding tables by their rows (Megatron's vocabulary-parallel lookup).
    self.weights: list[tuple[int, list[int]]] = []
    # Expert weights, each with its expert dim: a dim of a weight that a
    # contraction batches over (a mixture of experts' stack of expert MLPs,
    # each applied to its own tokens).
    self.expert_weights: list[tuple[int, int]] = []
    seen = set(self.carried)
    for o, prim in enumerate(graph.prims):
      if prim == "gather":  # an embedding table, looked up: split by rows (vocabulary)
        w, dims = _weight(graph, graph.operands[o][0], seen)
        if w >= 0 and graph.rank(w) == 2 and dims and dims[0] >= 0:
          self.weights.append((w, [dims[0]]))
        continue
      if prim != "dot_general":
        continue
      rule = graph.rules[o]
      for i in range(2):
        w, dims = _weight(graph, graph.operands[o][i], seen)
        if w < 0:
          continue
        other, out = list(rule.operands[1 - i] or ()), list(rule.results[0])
        batched = [dims[d] for d, f in enumerate(rule.operands[i])
                   if f >= 0 and f in out and f in other and dims[d] >= 0]
        if batched and all(v != w for v, _ in self.expert_weights):
          self.expert_weights.append((w, batched[0]))
        made = graph.results[o][0]
        # Output dims, not those the program takes apart (Megatron splits a
        # fused weight's hidden units, never its stack of gates).
        columns = [dims[d] for d, f in enumerate(rule.operands[i])
                   if f >= 0 and f in out and f not in other and dims[d] >= 0
                   and not _taken_apart(graph, made, out.index(f))]
        if columns:
          self.weights.append((w, columns))

  def data_parallel(self, state: State, axes: Sequence[int] | None = None) -> np.ndarray:
    """Splits the leading dim of every data argument over the given mesh
    axes (default all), major first, as far as they divide it."""
    mesh, prop = self.mesh, self.prop
    axes = range(mesh.num_axes) if axes is None else axes
    seeds = [(v, a) for v in self.data for a in axes
             if mesh.axis_sizes[a] > 1 and len(prop.tile(state, v, 0, a, propagate=False))]
    return concat([[v for v, _ in seeds], prop.propagate(state, seeds)])

  def megatron(self, state: State, axis: int) -> np.ndarray:
    """Megatron tensor parallelism over one axis: in program order, every
    weight a contraction reads and the axis does not yet tile is split
    along its first output dimension the axis divides (columns: heads,
    hidden units). Propagation carries the split through the chain to the
    next contraction, whose weight it splits by rows, so the pair needs one
    reduction."""
    changed = []
    for w, columns in self.weights:
      if state[w, axis] >= 0:
        continue
      for d in columns:
        if self.prop.can_tile(state, w, d, axis):
          changed.append(self.prop.tile(state, w, d, axis))
          break
    return concat(changed)

  def gradients(self, state: State, axis: int) -> np.ndarray:
    """Each parameter's gradient (a result mirroring a carried argument:
    `state_arguments`) tiled over `axis` as its parameter is, where the
    axis leaves it free: as Megatron-LM and ZeRO keep them, and as an
    optimizer's update, reading both elementwise, lays them out in a
    training step."""
    g, traced = self.graph, self.traced
    results = {(_tail(p), tuple(a.shape), str(a.dtype)): v
               for p, a, v in zip(traced.out_paths, traced.out_avals, g.outputs)
               if v >= 0 and _tail(p)}
    changed = []
    for p, a, w in zip(traced.in_paths, traced.in_avals, g.inputs):
      u = _mirror(_tail(p), a, results)
      if u is None or u == w or state[w, axis] < 0 or state[u, axis] >= 0:
        continue
      if self.prop.can_tile(state, u, int(state[w, axis]), axis):
        changed.append(self.prop.tile(state, u, int(state[w, axis]), axis))
    return concat(changed)

  def expert(self, state: State, axis: int) -> np.ndarray:
    """Expert parallelism over one axis: every expert weight split along
    its expert dim, the tokens dispatched to them following (propagation),
    so an all-to-all carries them from the batch's layout to their
    experts' devices and back (GShard, Switch)."""
    return concat(self.prop.tile(state, w, d, axis) for w, d in self.expert_weights
                  if state[w, axis] < 0 and self.prop.can_tile(state, w, d, axis))

  def expert_axis(self, state: State, axes: Sequence[int]) -> int | None:
    """The last of `axes` every expert weight's expert dim divides over,
    None if there are no expert weights or no such axis."""
    if not self.expert_weights:
      return None
    for a in reversed(list(axes)):
      if all(self.prop.can_tile(state, w, d, a) for w, d in self.expert_weights):
        return a
    return None

  def fsdp(self, state: State, axis: int, beside: bool = False) -> np.ndarray:
    """ZeRO-3 / FSDP over one axis: data parallelism on it, and every
    carried argument (parameters, optimizer state) split along its largest
    dimension the axis divides, to be gathered where it is used (over
    several axes, the same dimension over each, as flat ZeRO-3 shards).
    `beside` another tactic's split: a dimension no other axis splits
    first (beside Megatron's heads or hidden units, FSDP takes the
    embedding, as MaxText's rules)."""
    changed = [self.data_parallel(state, [axis])]
    g = self.graph
    for v in self.carried:
      if state[v, axis] >= 0:
        continue
      taken = set(state[v][state[v] >= 0].tolist()) if beside else set()
      for d in sorted(range(g.rank(v)), key=lambda d: (d in taken, -g.shapes[v][d])):
        if self.prop.can_tile(state, v, d, axis):
          changed.append(self.prop.tile(state, v, d, axis))
          break
    return concat(changed)

  def sequence(self, state: State, axis: int) -> np.ndarray:
    """Sequence (context) parallelism over one axis: the second dimension of
    every data argument split."""
    return concat(self.prop.tile(state, v, 1, axis) for v in self.data
                  if self.graph.rank(v) >= 2 and self.prop.can_tile(state, v, 1, axis))


# The expert strategies a plan is measured against.
YARDSTICKS = ("data parallel", "Megatron + data parallel")


# The hand-written strategies the benchmarks and yardsticks compare with.
EXPERTS = ("data parallel", "Megatron", "Megatron+DP", "FSDP", "FSDP+TP", "EP+DP")


def expert_states(program, space) -> dict:
  """The expert strategies by name (`EXPERTS`) on `program`, from the
  tactics of its action space `space`: data parallelism over every axis,
  Megatron on the last, Megatron with data parallelism over the others,
  FSDP (every argument split over every axis), and on two or more axes
  FSDP+TP (MaxText's layout: the batch over all but the last axis,
  Megatron on the last, FSDP on the middle ones, the first data parallel
  where there are three or more: HSDP where it crosses slices), and for a
  mixture of experts EP+DP (GShard's layout: the experts over the last
  axis that divides them, the batch over every axis, the rest
  replicated)."""
  tactics, real = space.experts, space.real_axes
  out = {}
  for name in EXPERTS:
    state = program.initial_state()
    if name == "data parallel":
      tactics.data_parallel(state, real)
    elif name == "Megatron":
      tactics.megatron(state, real[-1])
    elif name == "Megatron+DP":
      tactics.data_parallel(state, real[:-1])
      tactics.megatron(state, real[-1])
    elif name == "FSDP":
      for a in real:
        tactics.fsdp(state, a)
    elif name == "EP+DP":
      axis = tactics.expert_axis(state, real)
      if axis is None:
        continue
      tactics.expert(state, axis)
      tactics.data_parallel(state, real)
    elif len(real) > 1:
      # FSDP+TP, MaxText's layout: the batch over every axis but the last,
      # Megatron on the last, the weights' FSDP on the middle axes (on 3 or
      # more: the first stays data parallel, HSDP where it crosses slices).
      tactics.data_parallel(state, real[:-1])
      tactics.megatron(state, real[-1])
      for a in real[1:-1] if len(real) > 2 else real[:-1]:
        tactics.fsdp(state, a, beside=True)
    else:
      continue
    out[name] = state
  return out


def megatron_layout(program, axis: int | None = None) -> State:
  """Megatron-LM's tensor parallelism over `axis` (default: the mesh's last
  axis of size > 1) as a run states it, on a program whose pins state its
  activations (sequence or context parallelism): every weight a
  contraction reads split by columns, then by rows (`Tactics.megatron`),
  before the pins spread, so that the pinned activations meet the split
  weights through collectives at the pins (sequence parallelism's
  all-gather before a column-parallel matmul, reduce-scatter after a
  row-parallel one) rather than the pins' split reaching the weights
  first and leaving them whole; each gradient in its parameter's layout;
  the rest propagated. Without pins, the "Megatron" expert's layout with
  gradients laid out so."""
  mesh = program.mesh
  if axis is None:
    real = [a for a in range(mesh.num_axes) if mesh.axis_sizes[a] > 1]
    if not real:
      return program.initial_state()
    axis = real[-1]
  prop = program.propagator()
  tactics = Tactics(program.traced, program.graph, mesh, prop)
  state = program.pinned.copy()
  tactics.megatron(state, axis)
  tactics.gradients(state, axis)
  prop.seed_all(state)
  return program.as_compiled(state)


def yardsticks(program) -> dict:
  """The states of the expert strategies on this program and mesh: data
  parallelism over every axis, and Megatron tensor parallelism over the
  last axis with data parallelism over the others. None for a program
  without model state (parameters coming back updated, or gradients): which
  arguments are the batch is then unknown."""
  mesh = program.mesh
  axes = [a for a in range(mesh.num_axes) if mesh.axis_sizes[a] > 1]
  tactics = Tactics(program.traced, program.graph, mesh, program.propagator())
  out = {}
  if not tactics.carried:
    return out
  dp = program.initial_state()
  if axes:
    tactics.data_parallel(dp, axes)
  out["data parallel"] = dp
  mt = program.initial_state()
  if axes:
    if len(axes) > 1:
      tactics.data_parallel(mt, axes[:-1])
    tactics.megatron(mt, axes[-1])
  out["Megatron + data parallel"] = mt
  return out
