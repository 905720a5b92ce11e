"""The policy network: a jraph GraphNetwork over the program's classes of
values that scores the search's legal actions.

Nodes, edges and globals are encoded to `width`, updated for `rounds`
rounds of message passing (edges from their endpoints, nodes from what they
receive and send, the global from every node and edge; residual, layer
normalised), then each decision the search can take gets a logit from its own
features, the embedding of the group it tiles (its classes' embeddings
weighted by their share of its members) and the global embedding. Inputs
are padded to buckets (`pad`: powers of four), so one compiled function
serves every program of a bucket.
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
  members [M, 3] (node, group, weight) with member_mask [M]; group_mask [G];
  actions [K, A], action_group [K] (-1: none), action_mask [K]."""

  graph: jraph.GraphsTuple
  members: np.ndarray
  member_mask: np.ndarray
  group_mask: np.ndarray
  actions: np.ndarray
  action_group: np.ndarray
  action_mask: np.ndarray


def _bucket(n: int, least: int) -> int:
  """The least power of four times `least` that holds n: few shapes, so few
  compiles, at most 4x the work."""
  size = least
  while size < n:
    size *= 4
  return size


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
  members = np.zeros((_bucket(m, 64), 3), np.float32)
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
  def __call__(self, b: Batch) -> jax.Array:
    """Returns the logits [K] of the decisions (padding at NEG)."""
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
    # Each group: its classes' embeddings, weighted by their share of it.
    groups = b.group_mask.shape[0]
    node, group = b.members[:, 0].astype(jnp.int32), b.members[:, 1].astype(jnp.int32)
    weight = (b.members[:, 2] * b.member_mask)[:, None]
    group_emb = jax.ops.segment_sum(nodes[node] * weight, group, groups)
    has = (b.action_group >= 0)[:, None]
    action_groups = jnp.where(has, group_emb[jnp.maximum(b.action_group, 0)], 0.0)
    top = globals_[0]
    h = jnp.concatenate([b.actions, action_groups,
                         jnp.broadcast_to(top, (b.actions.shape[0], w))], -1)
    logits = _MLP(w, 1, name="score")(h)[:, 0]
    return jnp.where(b.action_mask, logits, NEG)
