"""Breakdown: a state's cost per layer, and the expert yardsticks beside it.

A layer is the first component of an op's name scope once transformations
are stripped (`transpose(jvp(GPT))/block_1/mlp` -> `block_1`), so its
forward and backward ops count together. Memory is the peak's make-up:
resident arguments and results, and the temporaries alive at the peak, each
charged to the layer that reads (or makes) it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from automap._src import graph as graph_lib
from automap._src.cost import Tracker
from automap._src.explain import layer_of
from automap._src.search.tactics import Tactics


@dataclasses.dataclass(frozen=True)
class LayerRow:
  """One layer's share of a step, per device.

  compute / comm: seconds of its ops and their collectives (a resharded
    copy counts once, at its first reader).
  resident: bytes of arguments (parameters, optimizer state) and results
    it owns.
  temporary: bytes of its temporaries alive at the step's memory peak.
  """

  name: str
  compute: float
  comm: float
  resident: float
  temporary: float

  def to_json(self) -> list:
    return [self.name, self.compute, self.comm, self.resident, self.temporary]

  @classmethod
  def from_json(cls, row: list) -> LayerRow:
    return cls(*row)


def layers(program, tracker: Tracker) -> tuple[LayerRow, ...]:
  """Per layer, in program order, its compute, communication and memory."""
  g, model = program.graph, program.model
  of_op = [layer_of(s) for s in g.scopes]
  names = list(dict.fromkeys(n for o, n in enumerate(of_op) if not model.dead[o]))
  known = set(names)
  compute = dict.fromkeys(names, 0.0)
  comm = dict.fromkeys(names, 0.0)
  resident = dict.fromkeys(names, 0.0)
  temporary = dict.fromkeys(names, 0.0)
  copies = set()
  for o, c in enumerate(tracker.ops):
    if model.dead[o]:
      continue
    compute[of_op[o]] += c.time
    for kind, mask, nbytes, seconds, position, target in c.comms:
      if position >= 0:
        key = model.copy_key(o, position, kind, mask, target, nbytes)
        if key in copies:
          continue
        copies.add(key)
      elif model.late[o]:
        # Combined with the others of its kind and axes: latency paid once,
        # by the combined collective (a row of its own).
        seconds -= model.latency[kind, mask]
      comm[of_op[o]] += seconds

  out_paths = {v: p for v, p in zip(g.outputs, program.traced.out_paths) if v >= 0}

  def owner(v: int) -> str:
    # An argument's or result's path names its layer (`1/0/mu/block_3/...`,
    # an updated moment), else its first live reader or its maker does.
    path = g.names[v] if g.kind[v] != graph_lib.INTERMEDIATE else out_paths.get(v, "")
    for part in path.split("/"):
      if part in known:
        return part
    if g.kind[v] != graph_lib.INTERMEDIATE:
      readers = [o for o, _ in g.uses[v] if not model.dead[o]]
      return of_op[readers[0]] if readers else names[0]
    return of_op[g.producer[v]]

  if names:
    for v in np.flatnonzero(tracker.held):
      resident[owner(int(v))] += float(tracker.held[v])
    # What is alive at the peak: temporaries, resharded copies (their first
    # reader's), and gradients held for a combined reduction (their maker's).
    peak = int(np.argmax(tracker.live)) if len(tracker.live) else 0
    alive = np.flatnonzero((model.start <= peak) & (model.end >= peak) & (tracker.foot > 0))
    for v in alive:
      temporary[owner(int(v))] += float(tracker.foot[v])
    for key, readers in tracker.reshards.items():
      if min(readers) <= peak <= max(readers):
        temporary[of_op[min(readers)]] += key[4]
    for group in tracker.pending.values():
      last = max(group, default=-1)
      for o, (first, nbytes, end, early) in group.items():
        if first <= peak <= last:
          temporary[of_op[o]] += nbytes
        if peak == last and end < last:
          temporary[of_op[o]] += early
  rows = [LayerRow(n, float(compute[n]), float(comm[n]), resident[n], temporary[n])
          for n in names]
  combined = float(model.latency[tracker.combined > 0].sum())
  if combined:
    rows.append(LayerRow("(combined reductions)", 0.0, combined, 0.0, 0.0))
  return tuple(rows)


# The expert strategies a plan is measured against.
YARDSTICKS = ("data parallel", "Megatron + data parallel")


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
