"""Pricing: what one op costs per device under a layout, priced afresh.

In the layout the op computes in (`layouts.derive`), its operands are
gathered or exchanged where they do not match (`reshard.transition`), the
halos its windows read are exchanged (`halo`), its partial sums combined
(all-reduce, or reduce-scatter where the result is tiled on that axis;
`partial_sums` where the compiler has no reduce-scatter), and each result
resharded to its own layout. Compute is a roofline of its FLOPs and the
HBM bytes XLA's fusions move for it. Functions of a `CostModel` (its
graph, mesh, hardware, `analysis`, `layout`, `transition`, `emit`,
`exchange_halos`); `CostModel.price` calls `price`, `Memo` keeps what it
returns.
"""

from __future__ import annotations

import math

import numpy as np

from automap._src.cost import partial_sums
from automap._src.cost.analysis import canonical_copies
from automap._src.cost.collectives import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from automap._src.cost.memo import OpCost
from automap._src.ir import rules
from automap._src.sharding.state import UNSHARDED, State

# Contractions: XLA's dot partitioner handles their partial sums.
_CONTRACTIONS = frozenset({"dot_general", "conv_general_dilated"})
# Ops whose fusions read only the part of their first operand they return.
_SLICING = frozenset({"slice", "dynamic_slice", "gather", "scan_slice"})


def price(model, state: State, o: int) -> OpCost:
  """Cost of op o under `state`, priced afresh (not memoised)."""
  g = model.graph
  results = g.results[o]
  if model.dead[o]:
    return OpCost(0.0, 0.0, [], {}, (0.0,) * len(results),
                  tuple(None if v < 0 else tuple(int(d) for d in state[v]) for v in results),
                  0.0)
  op = _Op(model, state, o)
  reshards, reads = op.read_operands()
  op.copy_dot_operands(reads)
  op.exchange_halos()
  # Results: combine partial sums, then match the result's own layout.
  footprint, naturals = [], []
  for r, v in enumerate(results):
    if v < 0:
      footprint.append(0.0)
      naturals.append(None)
      continue
    natural, foot = op.finish_result(r, v)
    naturals.append(natural)
    footprint.append(foot)
  time, flops = op.roofline(naturals)
  comms = op.comms
  trips = int(g.trips[o])
  if trips > 1:  # A scan body's op: every step pays; the program holds one copy.
    time, flops = time * trips, flops * trips
    comms = [(k, m, b, sec * trips, p, t, r) for k, m, b, sec, p, t, r in comms]
  return OpCost(time, flops, comms, reshards, tuple(footprint), tuple(naturals),
                op.traffic + op.relaid)


class _Op:
  """One op priced under one state, step by step (`price`): the
  collectives it emits (`CostModel.emit`'s tuples), and the HBM bytes its
  fusions move and those of the copies laying its results' collectives'
  buffers out, each summed in the order the steps run."""

  def __init__(self, model, state: State, o: int):
    self.model, self.state, self.o = model, state, o
    self.comms: list[tuple[int, int, float, float, int, int, float]] = []
    self.factor_of_axis, self.scatters, self.wants = model.layout(state, o)
    # HBM bytes as XLA's fusions move them: stored operands read once per
    # fusion the op runs in, stored results written; fused values never.
    self.traffic = 0.0
    # HBM bytes of the copies laying its results' collectives' buffers out
    # (`relayout_bytes`), fusions of their own beside the op's.
    self.relaid = 0.0

  def read_operands(self) -> tuple[dict[int, tuple], list[float]]:
    """Gathers or exchanges what the factor layout does not match, and
    counts the stored operands' reads. Returns {operand position: the
    layout it is resharded to}, and per operand the bytes it is read in."""
    model, state, o = self.model, self.state, self.o
    g = model.graph
    operands, results = g.operands[o], g.results[o]
    stored, copies = model.analysis.stored, int(model.analysis.copies[o])
    reshards = {}
    reads = [0.0] * len(operands)
    once = 0.0  # stored operands' bytes, read once
    for p, (v, want_row) in enumerate(zip(operands, self.wants)):
      if want_row is None:
        continue
      have = state[v]
      if g.prims[o] == "scan_slice" and any(int(d) == 0 for d in have):
        once += self._read_scanned(p, v, want_row)
      else:
        # Its collectives carry their relaid buffers' bytes: XLA lays out
        # one resharded copy for all its readers (the tracker counts it so).
        fused = (bool(model.analysis.loop_made[v]), bool(model.analysis.loop_read[v]))
        sink = [] if model.free[v] else self.comms
        emitted = len(sink)
        # Converted to bfloat16 before its reshard (`Compiler.
        # narrows_dot_operands`): the collectives move, and the copy holds,
        # half the bytes; a slice with no collective reads the f32 tile.
        narrowed = self._narrowed(p)
        read = model.transition(sink, have, want_row,
                                model.local_bytes(state, v) / (2 if narrowed else 1), p,
                                g.shapes[v], fused)
        if narrowed and len(sink) == emitted:
          read *= 2
        reads[p] = read
        if p == 0 and g.prims[o] in _SLICING:  # a fusion reads only the slice
          read = min(read, model.local_bytes(state, results[0]))
        if stored[v]:
          # In the layout the op wants (a reshard's collectives' own bytes
          # are the tracker's, once per copy). A fused-away operand read
          # resharded is taken to stay fused (XLA writes it for the
          # collective): so an op's price is that of its operands' layouts,
          # as the exact solver prices strategies.
          once += read
      if any(int(state[v, a]) != w for a, w in enumerate(want_row)):
        reshards[p] = tuple(want_row)
    if copies > 1:
      # A fused producer is duplicated into each fusion that reads it,
      # reading its operands in each, unless storing its result once
      # moves fewer bytes (what XLA's fusion cost model weighs).
      made = sum(model.local_bytes(state, v) for v in results if v >= 0)
      self.traffic += min(once * copies, made * (1 + copies))
    else:
      self.traffic += once
    return reshards, reads

  def _narrowed(self, p: int) -> bool:
    """Whether operand p of the op is a float32 dot operand the compiler
    computes in bfloat16 (`Compiler.narrows_dot_operands`)."""
    return self.model.compiler.narrows_dot_operands and self.model.graph.narrowable(self.o, p)

  def _read_scanned(self, p: int, v: int, want_row) -> float:
    """The reshard of a scanned operand p (value v) stored tiled on its
    step dim: XLA makes only the step dim whole before the loop (its axes
    moved to the dims they are wanted on where those are free, else
    gathered); the rest of the reshard happens to each step's slice.
    Returns the bytes each step reads (a loop body is counted once)."""
    model, have = self.model, self.state[v]
    held = {int(d) for d in have if int(d) > 0}
    whole = [int(d) if int(d) != 0 else
             int(w) if int(w) > 0 and int(w) not in held else UNSHARDED
             for d, w in zip(have, want_row)]
    local = model.transition(self.comms, have, whole, model.local_bytes(self.state, v), p)
    inner: list = []
    steps = model.graph.shapes[v][0]
    read = model.transition(inner, whole, want_row, local / steps, p)
    self.comms += [(k, m, b, sec * steps, q, t, r) for k, m, b, sec, q, t, r in inner]
    return read

  def copy_dot_operands(self, reads: list[float]) -> None:
    """Counts the copies into the decomposed dot's layout that a dot's
    operands need (`canonical_copies`): each reads the operand and writes
    the copy, once for the dots that read the value."""
    model, o = self.model, self.o
    g, sizes = model.graph, model.mesh.axis_sizes
    if g.prims[o] != "dot_general":
      return
    num_axes = len(sizes)
    tiles = [tuple(n // math.prod(sizes[a] for a in range(num_axes) if w[a] == d)
                   for d, n in enumerate(shape)) if w is not None else shape
             for shape, w in zip(g.operand_shapes[o][:2], self.wants[:2])]
    for p, copied in enumerate(canonical_copies(g.rules[o], tiles)):
      if copied:
        self.traffic += 2 * reads[p] / max(int(model.analysis.dot_readers[g.operands[o][p]]), 1)

  def exchange_halos(self) -> None:
    """Exchanges the halos the op's windows read across the axes tiling
    them (`CostModel.exchange_halos`)."""
    model, o = self.model, self.o
    g = model.graph
    operands, results = g.operands[o], g.results[o]
    for window in g.rules[o].windows:
      axes = [a for a in range(len(model.mesh.axis_sizes))
              if self.factor_of_axis[a] == window.factor]
      made = results[window.result]
      # XLA drops a slice nothing reads.
      if axes and operands[window.operand] >= 0 and made >= 0 and not model.analysis.unread[made]:
        # The halos arrive in buffers of their own, read by the op.
        self.traffic += model.exchange_halos(self.comms, o, window, axes,
                                             self.wants[window.operand])

  def finish_result(self, r: int, v: int) -> tuple[tuple[int, ...], float]:
    """Combines result r's (value v's) partial sums and reshards it to its
    own layout. Returns the layout the op makes it in and its footprint."""
    model, state = self.model, self.state
    g, stored, comms = model.graph, model.analysis.stored, self.comms
    before_results = len(comms)
    natural, natural_bytes, made = self._combine_partial_sums(r, v)
    made_here = len(comms) == before_results  # else by this result's reductions
    moved = len(comms)
    model.transition(comms, natural, state[v], natural_bytes, -1, g.shapes[v],
                     (made_here and bool(model.analysis.loop_fused[self.o]),
                      bool(model.analysis.loop_read[v])))
    self.relaid += sum(c[6] for c in comms[moved:])
    if len(comms) > before_results:
      self.traffic += made  # the partial result, for its collectives to finish
    elif stored[v]:
      self.traffic += model.local_bytes(state, v)
    foot = max(made, model.local_bytes(state, v))
    if stored[v] and made > model.local_bytes(state, v):
      # Made whole and sliced by each reader: every fusion reading it
      # reads the whole buffer (XLA's bytes accessed).
      self.traffic += (made - model.local_bytes(state, v)) * int(model.analysis.readers[v])
    w = model.analysis.wide[v]
    if w >= 0:  # and its broadcast, in the reader's layout and its own dtype
      foot += model.local_bytes(state, w) * model.itemsize[v] / model.itemsize[w]
    return tuple(int(d) for d in natural), foot

  def _combine_partial_sums(self, r: int, v: int) -> tuple[list[int], float, float]:
    """Emits the collectives that combine result r's (value v's) partial
    sums. Returns its layout after them, its bytes per device then, and
    the bytes of the partial result the op makes."""
    model, state, o = self.model, self.state, self.o
    g, sizes = model.graph, model.mesh.axis_sizes
    rule, factor_of_axis, num_axes = g.rules[o], self.factor_of_axis, len(sizes)
    reducing = g.prims[o] in rules.REDUCTIONS
    reduce_mask = scatter_mask = 0
    natural = [UNSHARDED] * num_axes
    for a in range(num_axes):
      f = factor_of_axis[a]
      if f >= 0 and rule.reduction[f]:
        if state[v, a] >= 0 and (self.scatters[a] or not reducing):
          scatter_mask |= 1 << a
        else:
          reduce_mask |= 1 << a
      elif f >= 0:
        natural[a] = rule.dim_of(len(rule.operands) + r, f)
    natural_bytes = float(g.nbytes[v]) / math.prod(
        sizes[a] for a in range(num_axes) if natural[a] >= 0)
    made = natural_bytes  # the partial result the op makes
    widen = model.reduced_itemsize[v] / model.itemsize[v]
    grouped = False  # the dot partitioner grouped devices on the contraction
    compiler = model.compiler
    # Whether the compiler forms a reduce-scatter over these axes
    # (`Compiler.scatters_every_device`).
    scatters = compiler.reduce_scatter and (
        compiler.scatters_every_device
        or scatter_mask & model.nontrivial != model.nontrivial)
    if scatters and scatter_mask and g.prims[o] in _CONTRACTIONS and self._operands_disagree(
        r, v, scatter_mask | reduce_mask):
      # XLA's dot partitioner slices the partial sum it all-reduces (a
      # reduce-scatter once fused) only where the dot computes in its
      # result's layout on every other axis (`PartitionBaseCase`,
      # `GetDotGroupPartitionContractingOutputShardings` in
      # spmd/dot_handler.cc). Where an operand comes tiled otherwise on
      # another axis (a weight's gradient whose rows come tiled over
      # `tensor` from the activations, wanted over `fsdp`), XLA:TPU
      # all-reduces the whole partial result and reshards it after: no
      # reduce-scatter matcher looks through that reshard
      # (`MatchReduceScatter`: the slice must read the all-reduce).
      # `test_a_gradient_whose_rows_come_tiled_over_tensor_is_all_reduced_whole`.
      reduce_mask |= scatter_mask
      scatter_mask = 0
    if scatter_mask and not scatters and g.prims[o] in _CONTRACTIONS:
      # No reduce-scatter: XLA's dot partitioner all-reduces and slices
      # (`partial_sums.finish`: as XLA:CPU compiles it, `P('data',
      # 'model')` from a contraction over both is two whole all-reduces).
      natural_bytes, made = partial_sums.finish(
          model, self.comms, natural, state[v], scatter_mask, reduce_mask, natural_bytes,
          float(g.nbytes[v]), widen, self._batched())
      scatter_mask, grouped = 0, True
    elif scatter_mask and not scatters:
      # Other reductions all-reduce the whole partial result over every
      # axis at once, then keep this device's tile.
      reduce_mask |= scatter_mask
      scatter_mask = 0
    # One all-reduce per reduced factor (XLA reduces dim by dim), over
    # every axis that tiles it; after a contraction grouped on the axes
    # its result is scattered over, what the others hold partial is one
    # all-reduce over all of them (as XLA:CPU compiles it).
    by_factor: dict[int, int] = {}
    scattered: list[int] = []  # masks all-reduced after the reduce-scatter
    for a in range(num_axes):
      if reduce_mask >> a & 1:
        f = -1 if grouped else factor_of_axis[a]
        by_factor[f] = by_factor.get(f, 0) | 1 << a
    for mask in by_factor.values():
      if g.prims[o] in rules.ARG_REDUCTIONS:
        # No all-reduce combines (value, index) pairs: XLA all-gathers
        # both partial results over the axes and reduces them again.
        gathered = natural_bytes * model.group_size[mask]
        values = gathered * model.reduced_itemsize[g.operands[o][0]] / model.itemsize[v]
        model.emit(self.comms, ALL_GATHER, mask, gathered)
        model.emit(self.comms, ALL_GATHER, mask, values)
        made = max(made, gathered + values)
      elif scatter_mask and compiler.scatters_first:
        # Reduced over the rest once scattered: the tile's bytes, after.
        scattered.append(mask)
      else:
        model.emit(self.comms, ALL_REDUCE, mask, natural_bytes * widen)
    if scatter_mask:
      for a in range(num_axes):
        if scatter_mask >> a & 1:
          natural[a] = state[v, a]
      natural_bytes /= model.group_size[scatter_mask]
      model.emit(self.comms, REDUCE_SCATTER, scatter_mask, natural_bytes)
    for mask in scattered:
      model.emit(self.comms, ALL_REDUCE, mask, natural_bytes * widen)
    return natural, natural_bytes, made

  def _operands_disagree(self, r: int, v: int, partial: int) -> bool:
    """Whether, on some mesh axis outside the `partial` mask, the op's
    operands do not come tiled as its result r (value v) is: an operand
    tiles the axis on another factor, or none tiles the factor the result
    tiles it on (XLA would slice it from a replicated result)."""
    model, state, o = self.model, self.state, self.o
    g = model.graph
    rule = g.rules[o]
    for a in range(len(model.mesh.axis_sizes)):
      if partial >> a & 1:
        continue
      d = state[v, a]
      want = rule.results[r][d] if d >= 0 else UNSHARDED
      come = set()
      for p, u in enumerate(g.operands[o]):
        if u >= 0 and rule.operands[p] is not None and state[u, a] >= 0:
          come.add(rule.operands[p][state[u, a]])
      if not come <= {want} or (want >= 0 and want not in come):
        return True
    return False

  def _batched(self) -> int:
    """The axes that tile a batch factor of the op (one of every operand)
    in every operand's own layout, as a bitmask."""
    model, state, o = self.model, self.state, self.o
    g, rule = model.graph, model.graph.rules[o]
    mask = 0
    for a, f in enumerate(self.factor_of_axis):
      if f < 0 or rule.reduction[f]:
        continue
      dims = [(v, rule.dim_of(p, f)) for p, v in enumerate(g.operands[o]) if v >= 0]
      if dims and all(d >= 0 and int(state[v, a]) == d for v, d in dims):
        mask |= 1 << a
    return mask

  def roofline(self, naturals: list) -> tuple[float, float]:
    """(seconds, FLOPs) of the op per device, once: a roofline of its
    FLOPs (on the matrix units for a dot or a convolution, at the rate its
    shape in the layout it computes in reaches) and its traffic, plus the
    copies laying its results' collectives out."""
    model, o, factor_of_axis = self.model, self.o, self.factor_of_axis
    g, sizes, hw = model.graph, model.mesh.axis_sizes, model.hw
    num_axes = len(sizes)
    operands, results = g.operands[o], g.results[o]
    tiles = 1
    for a in range(num_axes):
      if factor_of_axis[a] >= 0:
        tiles *= sizes[a]
    flops = float(g.flops[o]) / tiles
    if g.prims[o] in ("dot_general", "conv_general_dilated"):
      itemsize = int(model.itemsize[operands[0]]) if operands[0] >= 0 else 4
      contracted = minor = 0.0
      if g.prims[o] == "dot_general" and flops > 0:
        # In the layout the op computes in: its output's elements and minor
        # dim per device, the contracted size from its FLOPs (2 per MAC).
        shape, natural = g.shapes[results[0]], naturals[0]
        elements, minor = float(np.prod(shape)), float(shape[-1]) if len(shape) else 1.0
        for a in range(num_axes):
          if natural[a] >= 0:
            elements /= sizes[a]
            if natural[a] == len(shape) - 1:
              minor /= sizes[a]
        contracted = flops / (2 * elements)
      peak = hw.matmul_rate(itemsize, contracted, minor)
    else:  # vector units: an order of magnitude below the matrix units
      peak = hw.fp32_flops / 16
    # A roofline per op, its traffic the fusions' (`read_operands` and on).
    return (max(flops / peak, self.traffic / hw.hbm_bandwidth)
            + model.relayout_time(self.relaid), flops)


__all__ = ["price"]
