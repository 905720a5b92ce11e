"""Layer costs of a JAX program, per tensor-parallel width, from the cost model.

The training step's forward ops are cut into layers where their name scope's
first component changes (`block_3`, `embed`, `ln_f`), in program order: a
layer is a run of consecutive ops, so edges only go forward and the layer graph
is a DAG even when a module is used twice (a tied embedding read at both ends
becomes two layers). Ops without a scope join the layer before them.

For each width t, the sharding search partitions the whole step over a
one-axis mesh of t devices; a layer's forward and backward seconds are its
ops' costs under that plan (tensor-parallel collectives included), its
parameters the bytes per device of the arguments its forward ops read, its
activations the bytes per device its forward ops produce that backward ops
read (what 1F1B stashes), and an edge the bytes one layer's forward hands to
another's. Its FLOPs are its ops' under that plan; what selective recompute
drops are the stashed values between two contractions of activations
(attention's scores and softmax, `attention_scores`); what the "dots" policy
keeps and reruns follows from the weight matmuls (`policies.weight_matmuls`)
by walking back from what the backward reads (`policies.policy_rerun`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import defaultdict
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import PartitionSpec

from automap._src.cluster.errors import PlacementError
from automap._src.cluster.profile import context as context_lib
from automap._src.cluster.profile.layer_graph import Layer, LayerCost, LayerGraph, Shared
from automap._src.cluster.profile.policies import offloaded, policy_rerun, weight_matmuls
from automap._src.cluster.profile.twin import Twin
from automap._src.cost.hardware import Hardware
from automap._src.cost.program import Program
from automap._src.ir import graph as graph_lib
from automap._src.ir.naming import UNSCOPED, containers, is_backward, layer_of, layer_runs
from automap._src.ir.stacks import Untwinnable
from automap._src.plan import planner, report
from automap._src.search.request import MemoryLimitError


@dataclasses.dataclass(frozen=True)
class Profile:
  """A program's layers per batch size and width.

  graphs: batch size -> width -> the layer graph (the same layers and edges
    at every width).
  specs: width -> argument path (parameters "0/...", batch "1/..." on) ->
    its PartitionSpec in the searched plan.
  programs: (batch size, width) -> (program, state) the costs were read from
    (a shallow twin's, `twin.Twin`, where the stack was profiled through one).
  params_count: how many leading arguments of those programs are parameters.
  weights: per parameter argument, the parameters of the whole step it
    stands for (a twin's deep layer stands for many); None: one each.
  """

  graphs: dict[int, dict[int, LayerGraph]]
  specs: dict[int, dict[str, PartitionSpec]]
  programs: dict[tuple[int, int], tuple[Program, np.ndarray]] = dataclasses.field(
      repr=False, compare=False)
  params_count: int = dataclasses.field(default=0, compare=False)
  weights: np.ndarray | None = dataclasses.field(default=None, repr=False, compare=False)

  def replicated_share(self, size: int, width: int) -> float:
    """`replicated_share` of the whole step, from the program profiled at
    (size, width)."""
    return replicated_share(*self.programs[(size, width)], self.params_count, self.weights)

  def at(self, batch: int) -> LayerGraph:
    """The layer graph with every width's costs for microbatches of `batch`
    samples: as measured, or scaled linearly (times, activations, edges; not
    parameters) from the nearest measured size."""
    near = min(self.graphs, key=lambda b: (abs(b - batch), b))
    s = batch / near
    per_width = self.graphs[near]
    some = next(iter(per_width.values()))
    layers = []
    for i, layer in enumerate(some.layers):
      widths = {}
      for t, graph in per_width.items():
        c = graph.layers[i].widths[t]
        widths[t] = dataclasses.replace(
            c, forward=c.forward * s, backward=c.backward * s, activations=c.activations * s,
            collectives=c.collectives * s, flops=c.flops * s, selective=c.selective * s,
            comm_bytes=c.comm_bytes * s,
            selective_forward=c.selective_forward * s,
            dots=None if c.dots is None else c.dots * s, dots_forward=c.dots_forward * s,
            offloaded=None if c.offloaded is None else c.offloaded * s,
            offloaded_forward=c.offloaded_forward * s)
      layers.append(dataclasses.replace(layer, widths=widths))
    shared = tuple(Shared(group.layers, {t: graph.shared[k].params[t]
                                         for t, graph in per_width.items()})
                   for k, group in enumerate(some.shared))
    return LayerGraph(tuple(layers), tuple((a, b, n * s) for a, b, n in some.edges), shared)


def _labels(graph, forward: np.ndarray) -> list[str | None]:
  """Per op, its layer label (first scope component, or the one below the
  scopes that hold repeated layers: `naming.containers`), forward-filled
  over unscoped ops within the forward and within the backward pass."""
  labels: list[str | None] = [None] * graph.num_ops
  last = {True: None, False: None}
  held = containers(graph.scopes)
  for o, scope in enumerate(graph.scopes):
    label = layer_of(scope, containers=held)
    if label == UNSCOPED:
      label = last[bool(forward[o])]
    labels[o] = label
    last[bool(forward[o])] = label
  # Unscoped ops before any scoped one join the first layer of their pass.
  for is_fw in (True, False):
    first = next((labels[o] for o in range(graph.num_ops)
                  if bool(forward[o]) == is_fw and labels[o] is not None), UNSCOPED)
    for o in range(graph.num_ops):
      if bool(forward[o]) == is_fw and labels[o] is None:
        labels[o] = first
  return labels


@dataclasses.dataclass(frozen=True)
class LayerCut:
  """A gradient program's ops cut into layers.

  forward: [O] bool, the op belongs to the forward pass.
  labels: [O] each op's layer label (first scope component, filled).
  segment: [O] the layer (index into names) of each forward op, -1 for backward.
  names: the layers in program order ("embed", "block_0", ..., a repeated
    label gets "#2", "#3").
  runs: label -> the layers carrying it (a label's backward ops split over them).
  """

  forward: np.ndarray
  labels: list[str]
  segment: np.ndarray
  names: list[str]
  runs: dict[str, list[int]]

  @classmethod
  def of(cls, g) -> LayerCut:
    forward = np.array([not is_backward(s) for s in g.scopes])
    labels = _labels(g, forward)
    segment = np.full(g.num_ops, -1)
    ops = np.flatnonzero(forward)
    names, index = layer_runs([labels[o] for o in ops])
    segment[ops] = index
    if not names:
      raise PlacementError("the loss function has no forward ops to place.")
    runs: dict[str, list[int]] = defaultdict(list)
    for i, name in enumerate(names):
      runs[name.split("#")[0]].append(i)
    return cls(forward, labels, segment, names, dict(runs))

  def split(self, per_op: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) per layer of a per-op quantity: a label's
    backward split over its layers as their forward is."""
    n = len(self.names)
    fw = np.bincount(self.segment[self.forward], per_op[self.forward], n)
    by_label: dict[str, float] = defaultdict(float)
    for o in np.flatnonzero(~self.forward):
      by_label[self.labels[o]] += per_op[o]
    bw = np.zeros(n)
    for label, layers in self.runs.items():
      bw[layers] += backward_share(fw, layers) * by_label.pop(label, 0.0)
    bw[-1] += sum(by_label.values())  # labels with no forward run (rare): the last layer's
    return fw, bw


def backward_share(fw: np.ndarray, layers: list[int]) -> np.ndarray:
  """How a label's backward splits over its `layers`: as their forward
  seconds `fw` do (evenly when those are all zero)."""
  total = fw[layers].sum()
  return fw[layers] / total if total > 0 else np.full(len(layers), 1 / len(layers))


def attention_scores(g, forward: np.ndarray, params_count: int) -> np.ndarray:
  """[V] bool: the forward values downstream of a contraction of two
  activations (attention's q.k) up to the next such contraction (the
  product with v), the first's result included and no other contraction
  passed: the scores, their mask and softmax, and what the softmax's
  backward keeps. What Megatron-LM's selective recompute drops.
  Activations are the values derived from the batch (the arguments after
  the parameters)."""
  derived = np.zeros(g.num_values, bool)
  derived[list(g.inputs[params_count:])] = True
  after = np.zeros(g.num_values, bool)
  for o in range(g.num_ops):
    ins = [v for v in g.operands[o] if v >= 0]
    if not any(derived[v] for v in ins):
      continue
    results = list(g.results[o])
    derived[results] = True
    if not forward[o]:
      continue
    if g.prims[o] in ("dot_general", "conv_general_dilated"):
      # Of two activations, and not itself fed by scores: a start (q.k).
      starts = len(ins) == 2 and derived[ins].all() and not after[ins].any()
      after[results] = starts
    elif after[ins].any():
      after[results] = True
  return after


def replicated_share(program: Program, state: np.ndarray, params_count: int,
                     weights: np.ndarray | None = None) -> float:
  """Share of the parameters' bytes a plan leaves whole on every device;
  each parameter's bytes times its `weights` entry where given."""
  g = program.graph
  params = np.asarray(g.inputs[:params_count], np.int64)
  nbytes = np.asarray(g.nbytes, float)[params] * (1.0 if weights is None else weights)
  total = float(nbytes.sum())
  whole = float(nbytes[(state[params] < 0).all(axis=1)].sum()) if len(params) else 0.0
  return whole / total if total else 0.0


def sequence_layouts(g, params_count: int, width: int) -> list[tuple[int, PartitionSpec]]:
  """Megatron-LM's sequence parallelism (Korthikanti et al. 2022) on a
  one-axis ("model") mesh of `width`: every forward activation shaped like
  those handed between layers ([batch, sequence, features ...]) split along
  its sequence, so that norms, dropout and residual adds run on a slice of
  it, gathered before a column-parallel matmul and reduce-scattered after a
  row-parallel one (the search lays out the rest). Attention heads merged
  into that shape by a reshape are left to the search: they are split by
  heads."""
  cut = LayerCut.of(g)
  params = set(g.inputs[:params_count])
  handed = set()
  for v in range(g.num_values):
    p = g.producer[v]
    if v in params or p < 0 or not cut.forward[p] or len(g.shapes[v]) < 3:
      continue
    if any(cut.forward[o] and cut.segment[o] != cut.segment[p] for o, _ in g.uses[v]):
      handed.add(tuple(g.shapes[v]))
  layouts = []
  for v in range(g.num_values):
    p = g.producer[v]
    shape = tuple(g.shapes[v])
    if p < 0 or not cut.forward[p] or shape not in handed or shape[1] % width:
      continue
    source = g.operands[p][0] if g.operands[p] else -1
    if g.prims[p] == "reshape" and source >= 0 and tuple(g.shapes[source]) not in handed:
      continue
    layouts.append((v, PartitionSpec(None, "model")))
  return layouts


def _searched(traced, t: int, hardware: Hardware, search, example: np.ndarray | None,
              params_count: int = 0, sequence_parallel: bool = False, graph=None,
              context: int = 1):
  """(program, state) of `traced` (its `graph`) on a width-t mesh
  (`planner.state_on`): with `sequence_parallel`, the activations
  `sequence_layouts` names pinned. With `context` > 1 the mesh is ("context",
  "model") of (context, t / context), the tensor group minor (within a
  node), the batch's sequence pinned over "context", the rest searched."""
  model = t // context
  pins = []
  if sequence_parallel and model > 1:
    pins += sequence_layouts(graph, params_count, model)
  if context > 1:
    pins = [(v, PartitionSpec(None, (context_lib.CONTEXT, "model") if graph.shapes[v][1] % t == 0
                              else "model")) for v, _ in pins]
    pins += [(v, PartitionSpec(None, context_lib.CONTEXT)) for v in graph.inputs[params_count:]
             if graph.rank(v) >= 2 and graph.shapes[v][1] % context == 0]
  return planner.state_on(
      traced, context_lib.stage_mesh(t, context), hardware, search, graph=graph, pins=pins,
      pinned_by="context parallelism" if context > 1 else "sequence parallelism",
      reuse=example, key=(sequence_parallel and model > 1,))


def fused_attention_ops(g, cut: LayerCut, scores: np.ndarray) -> np.ndarray:
  """[O] bool: the ops one fused attention kernel (flash attention) runs: the
  forward ops making the scores or anything shaped like them in their layer
  (the broadcast causal mask) and the contraction reading them, and the
  backward ops of the same layer label that read or make a value shaped
  like that label's scores (their gradients, the product with v's)."""
  fused = np.zeros(g.num_ops, bool)
  shapes: dict[str, set] = defaultdict(set)
  for v in np.flatnonzero(scores):
    p = g.producer[v]
    fused[p] = True
    shapes[cut.labels[p]].add(tuple(g.shapes[v]))
  for o in range(g.num_ops):
    values = [v for v in (*g.operands[o], *g.results[o]) if v >= 0]
    if cut.forward[o]:
      fused[o] |= g.prims[o] == "dot_general" and any(scores[v] for v in g.operands[o] if v >= 0)
      fused[o] |= any(tuple(g.shapes[v]) in shapes.get(cut.labels[o], ())
                      for v in g.results[o] if v >= 0)
    else:
      fused[o] |= any(tuple(g.shapes[v]) in shapes.get(cut.labels[o], ()) for v in values)
  return fused


def layer_graphs(width_states: dict[int, tuple[Program, np.ndarray]],
                 params_count: int, fused_attention: bool = False,
                 offload_names: tuple[str, ...] = ()) -> dict[int, LayerGraph]:
  """Per width, the layer graph of one traced gradient program (built for a
  mesh of that width) under that width's state.

  params_count: how many leading flat arguments are parameters.
  fused_attention: attention runs as one kernel (flash attention): its
    ops (`fused_attention_ops`) take their FLOPs' time alone, matmuls at
    the matrix units' rate, the rest at the vector units'; the scores never
    reach memory, so nothing of them is stashed, and the backward rebuilds
    them (the forward kernel's score-making time again).
  offload_names: the `checkpoint_name`s the "offload" recompute mode sends
    to host memory (`offloaded`); none: that mode is not priced.
  """
  g = next(iter(width_states.values()))[0].graph
  cut = LayerCut.of(g)
  forward, segment, names = cut.forward, cut.segment, cut.names
  params = set(g.inputs[:params_count])
  scores = attention_scores(g, forward, params_count)
  fused = fused_attention_ops(g, cut, scores) if fused_attention else np.zeros(g.num_ops, bool)
  rebuilt = sorted({g.producer[v] for v in np.flatnonzero(scores)})  # ops making the scores
  # What stays inside the flash kernel: every value its forward makes but
  # the product with v (the scores, their mask and softmax never reach memory).
  in_kernel = np.zeros(g.num_values, bool)
  for o in np.flatnonzero(fused & forward):
    kept_out = g.prims[o] == "dot_general" and not any(scores[v] for v in g.results[o] if v >= 0)
    if not kept_out:
      in_kernel[[v for v in g.results[o] if v >= 0]] = True
  # The "dots" policy: what each layer's own backward reads, kept or rebuilt.
  own = np.zeros(g.num_values, bool)
  for v in range(g.num_values):
    p = g.producer[v]
    if p >= 0 and forward[p] and not in_kernel[v]:
      own[v] = any(not forward[o] and cut.labels[o] == cut.labels[p] for o, _ in g.uses[v])
  saved, rerun = policy_rerun(g, cut, own, weight_matmuls(g, forward))
  offloaded_values, offload_rerun = (offloaded(g, cut, own, offload_names) if offload_names
                                     else (None, np.zeros(g.num_ops, bool)))
  edges = layer_edges(g, cut)
  kinds = structures(g, cut)
  graphs = {}
  for t, (program, state) in width_states.items():
    model = program.model
    compute, comm = report.op_seconds(model, state)
    comm = np.maximum(comm - context_lib.deferred_seconds(program, state, params, forward), 0)
    op_costs = [model.op_cost(state, o) for o in range(g.num_ops)]
    # The model's FLOPs, each device's share: an op left whole on every
    # device counts once, not t times.
    model_flops = np.asarray(g.flops, float) * np.asarray(g.trips, float) / t
    seconds = compute + comm
    if fused.any():
      seconds = np.where(fused, _kernel_seconds(model, g, op_costs), seconds)
    fw, bw = cut.split(seconds)
    coll = sum(cut.split(comm))
    comm_bytes = sum(cut.split(np.array([sum(x[2] for x in c.comms) for c in op_costs])))
    flops = sum(cut.split(model_flops))
    dropped = np.zeros(len(names))
    rebuild = np.bincount(segment[rebuilt], seconds[rebuilt], len(names))
    if fused.any():  # flash attention's backward rebuilds the scores
      bw, rebuild = bw + rebuild, np.zeros(len(names))
    param_bytes = np.zeros(len(names))
    largest = np.zeros(len(names))  # each layer's largest parameter array
    acts = np.zeros(len(names))
    dots = np.zeros(len(names))
    dots_forward = np.bincount(segment[rerun], seconds[rerun], len(names))
    host = np.zeros(len(names))
    host_forward = np.bincount(segment[offload_rerun], seconds[offload_rerun], len(names))
    shared: dict[tuple[int, ...], float] = defaultdict(float)
    for v in range(g.num_values):
      if v in params:
        readers = {segment[o] for o, _ in g.uses[v] if forward[o]}
        for r in readers:
          param_bytes[r] += model.local_bytes(state, v)
          largest[r] = max(largest[r], model.local_bytes(state, v))
        if len(readers) > 1:
          shared[tuple(sorted(readers))] += model.local_bytes(state, v)
        continue
      p = g.producer[v]
      if p < 0 or not forward[p]:
        continue
      src = segment[p]
      if saved[v]:
        dots[src] += model.local_bytes(state, v)
      if offloaded_values is not None and offloaded_values[v]:
        host[src] += model.local_bytes(state, v)
      if any(not forward[o] for o, _ in g.uses[v]) and not in_kernel[v]:
        acts[src] += model.local_bytes(state, v)
        if scores[v]:
          dropped[src] += model.local_bytes(state, v)
    layers = tuple(Layer(n, {t: LayerCost(*(float(x) for x in (
        fw[i], bw[i], param_bytes[i], acts[i], coll[i], flops[i], dropped[i],
        min(rebuild[i], fw[i]), dots[i], min(dots_forward[i], fw[i]), largest[i],
        comm_bytes[i])), offloaded=None if offloaded_values is None else float(host[i]),
        offloaded_forward=float(min(host_forward[i], fw[i])))}, kinds[i])
                   for i, n in enumerate(names))
    graphs[t] = LayerGraph(layers, edges,
                           tuple(Shared(tuple(names[i] for i in group), {t: float(nbytes)})
                                 for group, nbytes in sorted(shared.items())))
  return graphs


def _kernel_seconds(model, g, op_costs) -> np.ndarray:
  """[O] seconds of each op inside one fused kernel: its FLOPs alone,
  matmuls at the matrix units' rate for their operands' dtype, the rest at
  the vector units'."""
  hw = model.hw
  rate = np.array([
      hw.matmul_rate(int(model.itemsize[g.operands[o][0]]), 0, 0)
      if g.prims[o] in ("dot_general", "conv_general_dilated") and g.operands[o][0] >= 0
      else hw.fp32_flops / 16 for o in range(g.num_ops)])
  return np.array([c.flops for c in op_costs]) / rate


def layer_edges(g, cut: LayerCut) -> tuple[tuple[str, str, float], ...]:
  """(src, dst, bytes) per pair of layers: what one layer's forward hands
  another's (the values it makes that the other's forward reads)."""
  edges: dict[tuple[int, int], float] = defaultdict(float)
  forward, segment = cut.forward, cut.segment
  for v in range(g.num_values):
    p = g.producer[v]
    if p < 0 or not forward[p]:
      continue
    for r in {segment[o] for o, _ in g.uses[v] if forward[o]} - {segment[p]}:
      edges[(segment[p], r)] += float(g.nbytes[v])
  return tuple((cut.names[a], cut.names[b], nbytes) for (a, b), nbytes in sorted(edges.items()))


# Rounds of colour refinement within a layer (`structures`), as deep as
# `groups.colours`' over the whole program.
_STRUCTURE_ROUNDS = 4


def structures(g, cut: LayerCut) -> list[str]:
  """Per layer, a digest of its forward ops: Weisfeiler-Lehman colours
  (op kind, operand and result shapes and dtypes) refined over the edges
  inside the layer only, so that the copies of a block match wherever they
  sit (the first reads the embedding, the last feeds the final norm) and
  whatever plan lays them out. Digests compare within one trace."""
  index: dict = {}

  def intern(key) -> int:
    return index.setdefault(key, len(index))

  segment = cut.segment
  colour = [intern((g.prims[o], g.operand_shapes[o],
                    tuple((g.shapes[v], str(g.dtypes[v])) for v in g.results[o] if v >= 0)))
            for o in range(g.num_ops)]
  ops = np.flatnonzero(segment >= 0)
  for _ in range(_STRUCTURE_ROUNDS):
    new = list(colour)
    for o in ops:
      s = segment[o]
      inputs = tuple(colour[g.producer[v]] if v >= 0 and g.producer[v] >= 0
                     and segment[g.producer[v]] == s else -1 for v in g.operands[o])
      users = tuple(sorted((colour[u], k) for v in g.results[o] if v >= 0
                           for u, k in g.uses[v] if segment[u] == s))
      new[o] = intern((colour[o], inputs, users))
    colour = new
  members: list[list[int]] = [[] for _ in cut.names]
  for o in ops:
    members[segment[o]].append(colour[o])
  return [hashlib.blake2b(repr(sorted(m)).encode(), digest_size=8).hexdigest() for m in members]


def outline(g, params_count: int, widths: Sequence[int]) -> LayerGraph:
  """The layer graph of a traced gradient program before anything is
  priced: its layers (named, with their structure), the edges between them,
  and each layer's parameters whole at every width; times zero."""
  cut = LayerCut.of(g)
  params = np.zeros(len(cut.names))
  for v in g.inputs[:params_count]:
    for r in {cut.segment[o] for o, _ in g.uses[v] if cut.forward[o]}:
      params[r] += float(g.nbytes[v])
  return LayerGraph(tuple(Layer(n, {t: LayerCost(0.0, 0.0, float(params[i]), 0.0)
                                    for t in widths}, kind)
                          for i, (n, kind) in enumerate(zip(cut.names, structures(g, cut)))),
                    layer_edges(g, cut))


def batch_size(batch: Sequence) -> int:
  """The leading (batch) dimension the batch arguments share."""
  found = {leaf.shape[0] for leaf in jax.tree.leaves(batch) if np.ndim(leaf)}
  if len(found) != 1:
    raise PlacementError(
        "batch arguments must share one leading (batch) dimension, got sizes "
        f"{sorted(found)}; pass the batch as the arguments after params.")
  return found.pop()


def measure(loss_fn: Callable, params, batch: Sequence, *, widths: Sequence[int],
            hardware: Hardware, search: Callable[[Program], np.ndarray],
            sizes: Sequence[int] = (), fused_attention: bool = False,
            check: Callable[[LayerGraph], None] | None = None,
            sequence_parallel: bool = False, context: int = 1,
            offload_names: tuple[str, ...] = (), twin: Twin | None = None) -> Profile:
  """Profiles `jax.value_and_grad(loss_fn)(params, *batch)` at each width, for
  the example batch and for each of `sizes` (the batch's leading dimension
  changed).

  search(program) -> state: the intra-stage sharding for a program on a
  one-axis mesh ("model") of some width; searched at the example's size and
  reused at the others where it divides their shapes.
  fused_attention: as in `layer_graphs`.
  check(graph): called with the step's layers (`outline`) before any
    search, to refuse a split they cannot carry before the search's time.
  sequence_parallel: activations split along the sequence at every width
    above 1 (`sequence_layouts`), the search choosing the rest.
  context: of each width's devices, how many split the batch's sequence
    (a ("context", "model") mesh; `_searched`).
  offload_names: as in `layer_graphs`.
  twin: the loss's scanned stack profiled through its shallow twin
    (`twin.Twin`: `loss_fn` and `params` are then only the fallback, for a
    loss the twin cannot run); the profile's graphs and specs are the whole
    step's, its programs the twin's. `search` is scaled to the twin's share
    of the parameters' bytes where it can be (`planner.searcher`'s).
  """
  options = dict(widths=widths, hardware=hardware, sizes=sizes, fused_attention=fused_attention,
                 check=check, sequence_parallel=sequence_parallel, context=context,
                 offload_names=offload_names)
  if twin is not None:
    scaled = getattr(search, "scaled", None)
    try:
      return _measure(twin.stacks.loss_fn, twin.params, batch, twin=twin,
                      search=search if scaled is None else scaled(twin.share(), hardware),
                      **options)
    except (Untwinnable, _Unwritten, MemoryLimitError):
      # Profiled in full (a limit scaled by the weights' share can be out of
      # the twin's reach where its batch or logits dominate).
      pass
  return _measure(loss_fn, params, batch, search=search, **options)


class _Unwritten(Exception):
  """A twin's layer graph that `Twin.graph` does not write out."""


def _measure(loss_fn, params, batch, *, widths, hardware, search, sizes, fused_attention,
             check, sequence_parallel, context, offload_names, twin=None) -> Profile:
  """`measure`, of `twin`'s loss where given (its graphs and specs written
  out to the whole stack)."""

  def whole(graph: LayerGraph) -> LayerGraph:
    if twin is None:
      return graph
    written = twin.graph(graph)
    if written is None:
      raise _Unwritten
    return written

  example = batch_size(batch)
  params_count = len(jax.tree.leaves(params))
  grad = jax.value_and_grad(loss_fn)
  traced = planner.trace(grad, (params, *batch))
  g = graph_lib.build(traced)  # one graph per trace, for every width
  named = set(g.checkpoint_names.values())
  if set(offload_names) - named:
    raise PlacementError(
        f"offload_activations: {sorted(set(offload_names) - named)} name no value of the "
        f"traced loss_fn; its checkpoint_names are {sorted(named) or 'none'}. Name the "
        "activations to offload with jax.ad_checkpoint.checkpoint_name(x, name).")
  if check is not None:
    check(whole(outline(g, params_count, widths)))
  searched: dict[int, np.ndarray] = {}
  specs = {}
  graphs: dict[int, dict[int, LayerGraph]] = {}
  programs = {}
  for size in [example, *sorted(set(sizes) - {example})]:
    if size != example:
      resized = jax.tree.map(
          lambda x, n=size: jax.ShapeDtypeStruct((n, *x.shape[1:]), x.dtype) if np.ndim(x) else x,
          batch)
      traced = planner.trace(grad, (params, *resized))
      g = graph_lib.build(traced)
    for t in widths:
      program, state = _searched(traced, t, hardware, search, searched.get(t), params_count,
                                 sequence_parallel, g, context)
      if size == example:
        searched[t] = state
        plan = planner.plan_of_state(program, state)
        specs[t] = dict(zip(plan.in_paths, plan.in_specs))
        if twin is not None:
          specs[t] = twin.specs(specs[t])
      programs[(size, t)] = (program, state)
    graphs[size] = {t: whole(graph) for t, graph in layer_graphs(
        {t: programs[(size, t)] for t in widths}, params_count, fused_attention,
        offload_names).items()}
  return Profile(graphs, specs, programs, params_count,
                 None if twin is None else twin.multiplicity())
