"""The policy network: a jraph GraphNetwork over the program's values that
scores the search's legal actions and values the state.

Nodes, edges and globals are encoded to `width`, updated for `rounds`
rounds of message passing (edges from their endpoints, nodes from what they
receive and send, the global from every node and edge; residual, layer
normalised), then each action is scored from its own features, the mean
embedding of the group it tiles and the global embedding, as a correction
to a prior that decays with the action's place in the space's order. Inputs are padded
to power-of-two buckets (`pad`), so one compiled function serves every
program of a bucket.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from automap._src.models import jraph_compat as jraph
from automap._src.search.policy.features import Features

NEG = -1e9  # logit of a padded action


class Batch(NamedTuple):
  """Padded network inputs. graph: one real graph and one padding graph;
  members [M, 2] (node, group) with member_mask [M]; group_mask [G];
  actions [K, A], action_group [K] (-1: none), action_mask [K]."""

  graph: jraph.GraphsTuple
  members: np.ndarray
  member_mask: np.ndarray
  group_mask: np.ndarray
  actions: np.ndarray
  action_group: np.ndarray
  action_mask: np.ndarray


def _bucket(n: int, least: int) -> int:
  return max(least, 1 << max(n - 1, 0).bit_length())


def pad(f: Features) -> Batch:
  """Pads `f` to power-of-two sizes (nodes one more than needed: the
  padding graph must own one)."""
  n, e = len(f.nodes), len(f.senders)
  graph = jraph.GraphsTuple(
      nodes=f.nodes, edges=f.edges, senders=f.senders, receivers=f.receivers,
      n_node=np.array([n], np.int32), n_edge=np.array([e], np.int32),
      globals=f.globals[None])
  graph = jraph.pad_with_graphs(graph, _bucket(n + 1, 256), _bucket(e, 1024), 2)
  m = len(f.members)
  members = np.zeros((_bucket(m, 64), 2), np.int32)
  members[:m] = f.members
  member_mask = np.arange(len(members)) < m
  group_mask = np.arange(_bucket(f.num_groups + 1, 64)) < f.num_groups
  k = len(f.actions)
  actions = np.zeros((_bucket(k, 64), f.actions.shape[1]), np.float32)
  actions[:k] = f.actions
  action_group = np.full(len(actions), -1, np.int32)
  action_group[:k] = f.action_group
  return Batch(graph, members, member_mask, group_mask, actions, action_group,
               np.arange(len(actions)) < k)


class _MLP(nn.Module):
  width: int
  out: int

  @nn.compact
  def __call__(self, x):
    x = nn.gelu(nn.Dense(self.width)(x))
    return nn.Dense(self.out)(x)


class PolicyNet(nn.Module):
  width: int = 64
  rounds: int = 3

  @nn.compact
  def __call__(self, b: Batch) -> tuple[jax.Array, jax.Array]:
    """Returns (logits [K], value []): action logits (padding at NEG) and
    the predicted log speed-up still reachable from this state."""
    w = self.width
    g = b.graph
    nodes = _MLP(w, w, name="encode_nodes")(g.nodes)
    edges = _MLP(w, w, name="encode_edges")(g.edges)
    globals_ = _MLP(w, w, name="encode_globals")(g.globals)
    for r in range(self.rounds):
      edge_fn = _MLP(w, w, name=f"edge_{r}")
      node_fn = _MLP(w, w, name=f"node_{r}")
      global_fn = _MLP(w, w, name=f"global_{r}")
      net = jraph.GraphNetwork(
          update_edge_fn=lambda e, s, t, u, f=edge_fn: f(jnp.concatenate([e, s, t, u], -1)),
          update_node_fn=lambda n, s, t, u, f=node_fn: f(jnp.concatenate([n, s, t, u], -1)),
          update_global_fn=lambda n, e, u, f=global_fn: f(jnp.concatenate([n, e, u], -1)),
          aggregate_edges_for_nodes_fn=jraph.segment_mean,
          aggregate_nodes_for_globals_fn=jraph.segment_mean,
          aggregate_edges_for_globals_fn=jraph.segment_mean)
      out = net(g._replace(nodes=nodes, edges=edges, globals=globals_))
      nodes = nn.LayerNorm(name=f"norm_nodes_{r}")(nodes + out.nodes)
      edges = nn.LayerNorm(name=f"norm_edges_{r}")(edges + out.edges)
      globals_ = nn.LayerNorm(name=f"norm_globals_{r}")(globals_ + out.globals)
    # Mean embedding of each group's members.
    groups = b.group_mask.shape[0]
    weight = b.member_mask.astype(nodes.dtype)[:, None]
    total = jax.ops.segment_sum(nodes[b.members[:, 0]] * weight, b.members[:, 1], groups)
    count = jax.ops.segment_sum(weight, b.members[:, 1], groups)
    group_emb = total / jnp.maximum(count, 1.0)
    has = (b.action_group >= 0)[:, None]
    action_groups = jnp.where(has, group_emb[jnp.maximum(b.action_group, 0)], 0.0)
    top = globals_[0]
    h = jnp.concatenate([b.actions, action_groups,
                         jnp.broadcast_to(top, (b.actions.shape[0], w))], -1)
    # A residual on the action space's own order (tactics, then the largest
    # groups): an untrained network ranks actions as the space does.
    order = -jnp.log1p(jnp.arange(b.actions.shape[0], dtype=h.dtype))
    logits = order + _MLP(w, 1, name="score")(h)[:, 0]
    logits = jnp.where(b.action_mask, logits, NEG)
    value = _MLP(w, 1, name="value")(top)[0]
    return logits, value
