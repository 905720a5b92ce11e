"""Report: a state's cost per layer.

Layers are named as `ir/naming.layer_of` names them, forward and backward
together. Memory is the peak's make-up:
resident arguments and results, and the temporaries alive at the peak, each
charged to the layer that reads (or makes) it (less, in proportion, what
results' buffers hold before the results are made).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from automap._src.cost.tracker import Tracker
from automap._src.ir import graph as graph_lib
from automap._src.ir.naming import layer_of


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


def op_seconds(model, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Per op, (compute, communication) seconds as the Tracker counts them: a
  resharded copy paid by its first reader, combined reductions' latency once
  (on the last op of the combination)."""
  return _summed(Tracker(model, state))


def _summed(tracker: Tracker) -> tuple[np.ndarray, np.ndarray]:
  compute, before, after = tracker.op_seconds_split()
  return compute, before + after


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
  seconds = _summed(tracker)
  for o in np.flatnonzero(~model.dead):
    compute[of_op[o]] += float(seconds[0][o])
    comm[of_op[o]] += float(seconds[1][o])

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
    at_peak, peak = tracker.peak()
    alive = np.flatnonzero((model.start <= peak) & (model.end >= peak) & (tracker.footprint > 0))
    for v in alive:
      temporary[owner(int(v))] += float(tracker.footprint[v])
    for key, readers in tracker.reshards.items():
      span = tracker.copy_span(key, readers)
      if min(span) <= peak <= max(span):
        temporary[of_op[min(readers)]] += key[4]
    for key in tracker.pending:
      for o, first, nbytes, end, early, last in tracker.held_inputs(key):
        if first <= peak <= last:
          temporary[of_op[o]] += nbytes
        if peak == last and end < last:
          temporary[of_op[o]] += early
    # What results' buffers hold comes off every layer in proportion.
    alive_bytes = sum(temporary.values())
    kept = at_peak / alive_bytes if alive_bytes else 0.0
    temporary = {n: b * kept for n, b in temporary.items()}
  return tuple(LayerRow(n, compute[n], comm[n], resident[n], temporary[n]) for n in names)
