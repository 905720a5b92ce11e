"""A jraph GraphNetwork and its optax training step.

Edge update relu([e, s, r] W_e), node update tanh([n, sum of incoming e] W_n),
a mean-square loss on the nodes. Used by the tests and benchmarks as the
graph-network program: gathers by sender and receiver, scatter-adds into
nodes. Shape letters: N nodes, E edges, W feature width.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from automap._src.models import jraph_compat as jraph


def loss(params: dict, graph: jraph.GraphsTuple) -> jax.Array:
  net = jraph.GraphNetwork(
      update_edge_fn=lambda e, s, r, g: jax.nn.relu(
          jnp.concatenate([e, s, r], axis=-1) @ params["edge"]),  # [E, 3W] @ [3W, W]
      update_node_fn=lambda n, s, r, g: jnp.tanh(
          jnp.concatenate([n, r], axis=-1) @ params["node"]))  # [N, 2W] @ [2W, W]
  return jnp.mean(net(graph).nodes ** 2)


def make_train_step(nodes: int, edges: int, width: int, learning_rate: float = 1e-3,
                    abstract: bool = False) -> tuple[Callable, tuple]:
  """Returns `(train_step, (params, opt_state, graph))` with real arrays (a
  fixed random graph), or with `jax.ShapeDtypeStruct`s if `abstract`."""
  optimizer = optax.adam(learning_rate)

  def init():
    k = jax.random.split(jax.random.key(0), 4)
    graph = jraph.GraphsTuple(
        nodes=jax.random.normal(k[0], (nodes, width)),
        edges=jax.random.normal(k[1], (edges, width)),
        senders=jnp.arange(edges) % nodes,
        receivers=(jnp.arange(edges) * 7) % nodes,
        n_node=jnp.array([nodes]), n_edge=jnp.array([edges]), globals=None)
    params = {"edge": jax.random.normal(k[2], (3 * width, width)) / 10,
              "node": jax.random.normal(k[3], (2 * width, width)) / 10}
    return params, optimizer.init(params), graph

  def train_step(params, opt_state, graph):
    value, grads = jax.value_and_grad(loss)(params, graph)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return train_step, jax.eval_shape(init) if abstract else jax.jit(init)()
