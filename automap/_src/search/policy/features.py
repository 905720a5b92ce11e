"""Graph features of a sharding state, for the learned policy.

Nodes are the program's values (arrays), edges its ops' dataflow (each
operand to each result, and back, so messages run both ways); the actions
of the search are encoded beside the graph, each pointing at the group of
nodes it tiles. What does not depend on the sharding state is computed once
per program (`Featurizer`); a state adds its layouts and memory.

Any change to what is computed here must bump SCHEMA: weights trained on
one schema are meaningless on another.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from automap._src.ir import graph as graph_lib
from automap._src.ir import rules
from automap._src.search.actions import Action, ActionSpace, Tactic, Tile
from automap._src.sharding.state import State

SCHEMA = "automap-policy-features/1"

MAX_AXES = 3  # mesh axes described; more are folded into the last slot
MAX_DIMS = 4  # dims described per value; more are folded into the last
TACTICS = ("data-parallel", "megatron", "fsdp", "sequence")

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

NODE_FEATURES = 2 + (MAX_DIMS + 1) + 4 + 4 + MAX_AXES * (MAX_DIMS + 1) + MAX_DIMS + len(
    _CATEGORIES) + 1
EDGE_FEATURES = 4 + len(_CATEGORIES) + 2
GLOBAL_FEATURES = MAX_AXES + 9
ACTION_FEATURES = 3 + (MAX_DIMS + 1) + MAX_AXES + 1 + len(TACTICS) + 3


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
  """One state as arrays (unpadded). Shapes: nodes [N, NODE_FEATURES],
  edges [E, EDGE_FEATURES], senders/receivers [E], globals [GLOBAL_FEATURES],
  members (node, group) pairs [M, 2], actions [K, ACTION_FEATURES] in the
  action space's order (then "stop") with action_group [K] (-1: none)."""

  nodes: np.ndarray
  edges: np.ndarray
  senders: np.ndarray
  receivers: np.ndarray
  globals: np.ndarray
  members: np.ndarray
  num_groups: int
  actions: np.ndarray
  action_group: np.ndarray


class Featurizer:
  """The state-independent features of one program and its action space."""

  def __init__(self, space: ActionSpace):
    self.space = space
    program = space.program
    g = program.graph
    self.graph = g
    n = g.num_values
    static = np.zeros((n, NODE_FEATURES), np.float32)
    col = 0
    static[:, col] = np.log2(g.nbytes.astype(np.float64) + 1) / 32
    col += 2  # the second: local bytes, per state
    ranks = np.array([min(len(s), MAX_DIMS) for s in g.shapes])
    static[np.arange(n), col + ranks] = 1
    col += MAX_DIMS + 1
    static[np.arange(n), col + np.array([_dtype_class(d) for d in g.dtypes])] = 1
    col += 4
    carried = set(space.experts.carried)
    outputs = {v for v in g.outputs if v >= 0}
    for v in range(n):
      if g.kind[v] == graph_lib.INTERMEDIATE:
        role = 2
      else:
        role = 1 if v in carried else (0 if g.kind[v] == graph_lib.ARG else 2)
      static[v, col + role] = 1
      if v in outputs:
        static[v, col + 3] = 1
    col += 4
    self.layout_col = col
    col += MAX_AXES * (MAX_DIMS + 1)
    for v, s in enumerate(g.shapes):
      for d, size in enumerate(s[:MAX_DIMS]):
        static[v, col + d] = math.log2(size + 1) / 16
    col += MAX_DIMS
    producer_cat = np.array([0 if p < 0 else category(g.prims[p]) for p in g.producer])
    static[np.arange(n), col + producer_cat] = 1
    col += len(_CATEGORIES)
    grouped = [v for grp in space.groups for v in grp.members]
    static[grouped, col] = 1
    col += 1
    assert col == NODE_FEATURES
    self.static = static
    # Edges: operand -> result and back.
    send, recv, feats = [], [], []
    for o, prim in enumerate(g.prims):
      cat = category(prim)
      flops = math.log2(float(g.flops[o]) + 1) / 48
      for p, v in enumerate(g.operands[o]):
        if v < 0:
          continue
        for r in g.results[o]:
          if r < 0:
            continue
          for forward in (1.0, 0.0):
            f = np.zeros(EDGE_FEATURES, np.float32)
            f[min(p, 3)] = 1
            f[4 + cat] = 1
            f[4 + len(_CATEGORIES)] = flops
            f[5 + len(_CATEGORIES)] = forward
            feats.append(f)
            send.append(v if forward else r)
            recv.append(r if forward else v)
    self.edges = (np.stack(feats) if feats else np.zeros((0, EDGE_FEATURES), np.float32))
    self.senders = np.array(send, np.int32)
    self.receivers = np.array(recv, np.int32)
    self.members = np.array([(v, i) for i, grp in enumerate(space.groups)
                             for v in grp.members], np.int32).reshape(-1, 2)
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
      glob[MAX_AXES + 5 + i] = math.log2(x + 1) / 40
    glob[MAX_AXES + 8] = math.log2(float((g.flops * g.trips).sum()) + 1) / 50
    self.glob = glob
    self.group_feats = [(math.log2(space.group_bytes(grp) + 1) / 40,
                         math.log2(len(grp.members)) / 8) for grp in space.groups]
    self.capacity = hw.hbm_capacity
    self.resident = program.model.resident
    self.axis_size = [math.log2(s) / 4 for s in mesh.axis_sizes]

  def action_row(self, action: Action | None) -> tuple[np.ndarray, int]:
    f = np.zeros(ACTION_FEATURES, np.float32)
    base = 3 + MAX_DIMS + 1
    if action is None:  # stop
      f[2] = 1
      return f, -1
    if isinstance(action, Tile):
      f[0] = 1
      f[3 + min(action.dim, MAX_DIMS)] = 1
      f[base + min(action.axis, MAX_AXES - 1)] = 1
      f[base + MAX_AXES] = self.axis_size[action.axis]
      f[-2:] = self.group_feats[action.group]
      return f, action.group
    assert isinstance(action, Tactic)
    f[1] = 1
    for a in action.axes:
      f[base + min(a, MAX_AXES - 1)] = 1
      f[base + MAX_AXES] += self.axis_size[a]
    f[base + MAX_AXES + 1 + TACTICS.index(action.name)] = 1
    return f, -1

  def __call__(self, state: State, actions: list[Action]) -> Features:
    g = self.graph
    nodes = self.static.copy()
    tiles = np.where(state >= 0, np.asarray(self.space.program.mesh.axis_sizes)[None], 1)
    local = g.nbytes / tiles.prod(axis=1)
    nodes[:, 1] = np.log2(local + 1) / 32
    for a in range(state.shape[1]):
      slot = self.layout_col + min(a, MAX_AXES - 1) * (MAX_DIMS + 1)
      d = state[:, a].astype(np.int64)
      on = d >= 0
      nodes[np.flatnonzero(on), slot + 1 + np.minimum(d[on], MAX_DIMS - 1)] = 1
      if a < MAX_AXES:  # folded axes mark only what they tile
        nodes[np.flatnonzero(~on), slot] = 1
    glob = self.glob.copy()
    # Memory pressure: what arguments and results alone hold of a device.
    glob[MAX_AXES + 3] = min(float(local[self.resident].sum()) / self.capacity, 4.0)
    glob[MAX_AXES + 4] = float((state >= 0).any(axis=1)[self.resident].mean())
    rows = [self.action_row(a) for a in actions] + [self.action_row(None)]
    for i, (row, _) in enumerate(rows):  # the space's own order, the default
      row[-3] = i / len(rows)
    return Features(nodes, self.edges, self.senders, self.receivers, glob, self.members,
                    len(self.space.groups), np.stack([r for r, _ in rows]),
                    np.array([i for _, i in rows], np.int32))
