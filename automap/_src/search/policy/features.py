"""Graph features of a program under a sharding state, for the learned filter.

The program is read at the grain the search acts on: one node per
Weisfeiler-Lehman class of values (`groups.colours`: the same role in every
repeated layer), so a 24-layer model is hardly bigger than a 2-layer one.
Edges are the ops' dataflow between classes (each operand to each result,
and back, so messages run both ways), merged when alike. A node carries
what its members are (bytes, rank, dtype, role, dims, the op that makes
them), how the state lays them out (the share tiled per mesh axis and dim),
and where time goes: the share of the step its members' producing ops
spend computing and communicating, from the cost model's tracker. The
decisions the network scores (`decisions.py`) sit beside the graph, each
pointing at the group it tiles.

Any change to what is computed here or there must bump SCHEMA: weights
trained on one schema are meaningless on another.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from automap._src.cost.tracker import Tracker
from automap._src.ir import graph as graph_lib
from automap._src.ir import rules
from automap._src.search.actions import ActionSpace
from automap._src.sharding.state import State

SCHEMA = "automap-policy-filter/3"

MAX_AXES = 3  # mesh axes described; more are folded into the last slot
MAX_DIMS = 4  # dims described per value; more are folded into the last

# Op categories, one-hot on edges and on each value's producer.
_CATEGORIES = ("argument", "contraction", "elementwise", "reduction", "layout",
               "indexing", "control", "other")
_REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
               "reduce_or", "argmax", "argmin", "cumsum", "cummax", "cumlogsumexp"}
_LAYOUT = {"reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims",
           "convert_element_type", "copy", "concatenate", "pad", "rev"}
_INDEXING = {"gather", "scatter", "scatter-add", "scatter_add", "dynamic_slice",
             "dynamic_update_slice", "slice", "select_n", "iota", "sort"}
_CONTROL = {"scan", "cond", "while", "scan_slice", "scan_carry", "pjit", "closed_call",
            "custom_jvp_call", "custom_vjp_call", "remat", "checkpoint"}

# Node columns: static (bytes, members, rank, dtype, role, dims, producer,
# grouped), then per state (local bytes, layout, compute and comm shares).
_STATIC = 2 + (MAX_DIMS + 1) + 4 + 4 + MAX_DIMS + len(_CATEGORIES) + 1
_LAYOUT_COLS = MAX_AXES * (MAX_DIMS + 1)
NODE_FEATURES = _STATIC + 1 + _LAYOUT_COLS + 2
EDGE_FEATURES = 4 + len(_CATEGORIES) + 3
GLOBAL_FEATURES = MAX_AXES + 12


def category(prim: str) -> int:
  if prim == "dot_general" or prim.startswith("conv"):
    return 1
  if prim in rules.ELEMENTWISE:
    return 2
  if prim in _REDUCTIONS:
    return 3
  if prim in _LAYOUT:
    return 4
  if prim in _INDEXING:
    return 5
  if prim in _CONTROL:
    return 6
  return 7


def _dtype_class(dtype) -> int:
  d = np.dtype(dtype) if not str(dtype).startswith("key") else np.dtype(np.uint32)
  if d == np.bool_:
    return 3
  if np.issubdtype(d, np.floating) or "bfloat16" in str(dtype) or "float" in str(dtype):
    return 0 if d.itemsize >= 4 else 1
  return 2


class Features(NamedTuple):
  """One state as arrays (unpadded). Shapes: nodes [N, NODE_FEATURES] (one
  per class of values), edges [E, EDGE_FEATURES], senders/receivers [E],
  globals [GLOBAL_FEATURES], members [M, 3] (node, group, weight: the
  share of the group's members in that class), actions [K, F] (the
  decisions scored, `decisions.FEATURES` columns) with action_group [K]
  (the group a decision tiles, -1: none)."""

  nodes: np.ndarray
  edges: np.ndarray
  senders: np.ndarray
  receivers: np.ndarray
  globals: np.ndarray
  members: np.ndarray
  num_groups: int
  actions: np.ndarray
  action_group: np.ndarray


def _class_mean(cls: np.ndarray, count: np.ndarray, x: np.ndarray) -> np.ndarray:
  out = np.zeros((len(count),) + x.shape[1:])
  np.add.at(out, cls, x)
  return out / count.reshape((-1,) + (1,) * (x.ndim - 1))


class Featurizer:
  """The state-independent features of one program and its action space,
  and a tracker that follows the states asked about (one incremental
  update each)."""

  def __init__(self, space: ActionSpace):
    self.space = space
    program = space.program
    g = program.graph
    self.graph = g
    n = g.num_values
    _, self.cls, self.count = np.unique(space.colour, return_inverse=True, return_counts=True)
    self.cls = self.cls.astype(np.int64)
    per_value = np.zeros((n, _STATIC))
    col = 0
    per_value[:, col] = np.log2(g.nbytes.astype(np.float64) + 1) / 32
    col += 2  # the second: the class's member count
    ranks = np.array([min(len(s), MAX_DIMS) for s in g.shapes], np.int64)
    per_value[np.arange(n), col + ranks] = 1
    col += MAX_DIMS + 1
    per_value[np.arange(n), col + np.array([_dtype_class(d) for d in g.dtypes], np.int64)] = 1
    col += 4
    carried = set(space.experts.carried)
    outputs = {v for v in g.outputs if v >= 0}
    for v in range(n):
      if g.kind[v] == graph_lib.INTERMEDIATE:
        role = 2
      else:
        role = 1 if v in carried else (0 if g.kind[v] == graph_lib.ARG else 2)
      per_value[v, col + role] = 1
      if v in outputs:
        per_value[v, col + 3] = 1
    col += 4
    for v, s in enumerate(g.shapes):
      for d, size in enumerate(s[:MAX_DIMS]):
        per_value[v, col + d] = math.log2(size + 1) / 16
    col += MAX_DIMS
    producer_cat = np.array([0 if p < 0 else category(g.prims[p]) for p in g.producer],
                            np.int64)
    per_value[np.arange(n), col + producer_cat] = 1
    col += len(_CATEGORIES)
    grouped = [v for grp in space.groups for v in grp.members]
    per_value[grouped, col] = 1
    col += 1
    assert col == _STATIC
    static = _class_mean(self.cls, self.count, per_value)
    static[:, 1] = np.log2(self.count) / 16
    self.static = static.astype(np.float32)
    self._edges(g)
    # (class, group, share of the group's members in the class)
    rows = []
    for i, grp in enumerate(space.groups):
      c, k = np.unique(self.cls[list(grp.members)], return_counts=True)
      rows += [(int(a), i, b / len(grp.members)) for a, b in zip(c, k)]
    self.members = np.array(rows, np.float32).reshape(-1, 3)
    mesh, hw = program.mesh, program.hardware
    glob = np.zeros(GLOBAL_FEATURES, np.float32)
    for a, size in enumerate(mesh.axis_sizes):
      glob[min(a, MAX_AXES - 1)] += math.log2(size) / 4
    glob[MAX_AXES] = math.log2(mesh.num_devices) / 8
    glob[MAX_AXES + 1] = math.log10(hw.flops / hw.link_bandwidth) / 6
    glob[MAX_AXES + 2] = math.log10(hw.link_bandwidth / hw.network_bandwidth)
    # The program's balance: state, data and temporaries, and work.
    data = set(space.data)
    state_bytes = sum(float(g.nbytes[v]) for v in carried)
    data_bytes = sum(float(g.nbytes[v]) for v in data)
    temp_bytes = float(g.nbytes[g.kind == graph_lib.INTERMEDIATE].sum())
    for i, x in enumerate((state_bytes, data_bytes, temp_bytes)):
      glob[MAX_AXES + 3 + i] = math.log2(x + 1) / 40
    glob[MAX_AXES + 6] = math.log2(float((g.flops * g.trips).sum()) + 1) / 50
    self.glob = glob
    self.capacity = hw.hbm_capacity
    # The value each op's seconds are charged to: its first result.
    self.charged_to = np.array([next((r for r in res if r >= 0), -1) for res in g.results],
                               np.int64)
    self.state = program.initial_state()
    self.tracker = Tracker(program.model, self.state)
    self.root_time = max(self.tracker.step_time, 1e-30)

  def _edges(self, g) -> None:
    """Operand -> result and back, between classes, alike ones merged
    (count and FLOPs summed)."""
    merged: dict[tuple, list[float]] = {}
    for o, prim in enumerate(g.prims):
      cat = category(prim)
      for p, v in enumerate(g.operands[o]):
        if v < 0:
          continue
        for r in g.results[o]:
          if r < 0:
            continue
          for forward in (1, 0):
            s, t = (self.cls[v], self.cls[r]) if forward else (self.cls[r], self.cls[v])
            acc = merged.setdefault((int(s), int(t), min(p, 3), cat, forward), [0.0, 0.0])
            acc[0] += 1
            acc[1] += float(g.flops[o] * g.trips[o])
    feats = np.zeros((len(merged), EDGE_FEATURES), np.float32)
    send = np.zeros(len(merged), np.int32)
    recv = np.zeros(len(merged), np.int32)
    for i, ((s, t, p, cat, forward), (count, flops)) in enumerate(merged.items()):
      send[i], recv[i] = s, t
      feats[i, p] = 1
      feats[i, 4 + cat] = 1
      feats[i, 4 + len(_CATEGORIES)] = math.log2(flops + 1) / 48
      feats[i, 5 + len(_CATEGORIES)] = forward
      feats[i, 6 + len(_CATEGORIES)] = math.log2(count) / 16
    self.edges, self.senders, self.receivers = feats, send, recv

  def shares(self, state: State) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Per value, the share of the serial step its producing op spends
    computing and communicating ([V] each), and the step's compute and
    communication shares, under `state`."""
    self.tracker.move_to(state)
    compute, before, after = self.tracker.op_seconds_split()
    total = max(float(compute.sum() + before.sum() + after.sum()), 1e-30)
    n = self.graph.num_values
    on = self.charged_to >= 0
    c = np.bincount(self.charged_to[on], compute[on], minlength=n) / total
    m = np.bincount(self.charged_to[on], (before + after)[on], minlength=n) / total
    return c, m, float(compute.sum()) / total, float((before + after).sum()) / total

  def __call__(self, state: State) -> Features:
    """The graph under `state`; its actions are left empty ([0, 0]) for
    the decisions to fill."""
    g = self.graph
    compute, comm, compute_share, comm_share = self.shares(state)
    per_value = np.zeros((g.num_values, NODE_FEATURES - _STATIC))
    tiles = np.where(state >= 0, np.asarray(self.space.program.mesh.axis_sizes)[None], 1)
    per_value[:, 0] = np.log2(g.nbytes / tiles.prod(axis=1) + 1) / 32
    for a in range(state.shape[1]):
      slot = 1 + min(a, MAX_AXES - 1) * (MAX_DIMS + 1)
      d = state[:, a].astype(np.int64)
      on = d >= 0
      per_value[np.flatnonzero(on), slot + 1 + np.minimum(d[on], MAX_DIMS - 1)] = 1
      if a < MAX_AXES:  # folded axes mark only what they tile
        per_value[np.flatnonzero(~on), slot] = 1
    per_value[:, -2] = compute
    per_value[:, -1] = comm
    mean = _class_mean(self.cls, self.count, per_value)
    # The classes' shares of the step are sums, not means.
    mean[:, -2:] = _class_mean(self.cls, np.ones_like(self.count), per_value[:, -2:])
    nodes = np.concatenate([self.static, mean.astype(np.float32)], axis=1)
    glob = self.glob.copy()
    t = self.tracker
    glob[MAX_AXES + 7] = min(t.peak_memory / self.capacity, 4.0)
    glob[MAX_AXES + 8] = compute_share
    glob[MAX_AXES + 9] = comm_share
    glob[MAX_AXES + 10] = math.log(max(t.step_time, 1e-30) / self.root_time)
    glob[MAX_AXES + 11] = float((state >= 0).any(axis=1).mean())
    return Features(nodes, self.edges, self.senders, self.receivers, glob, self.members,
                    len(self.space.groups), np.zeros((0, 0), np.float32),
                    np.zeros(0, np.int32))
