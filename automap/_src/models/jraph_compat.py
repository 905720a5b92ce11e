"""jraph for this JAX, in one place.

jraph 0.0.6.dev0 predates JAX 0.10: importing it emits deprecation noise,
and two of its helpers (`zero_out_padding`, `get_fully_connected_graph`)
call `jax.tree_map` / `jax.tree_leaves`, which JAX removed. automap imports
jraph only through this module, which filters the noise and exports only
what works here.
"""

from __future__ import annotations

import warnings

with warnings.catch_warnings():
  warnings.simplefilter("ignore", DeprecationWarning)
  import jraph

GraphsTuple = jraph.GraphsTuple
GraphNetwork = jraph.GraphNetwork
pad_with_graphs = jraph.pad_with_graphs
segment_mean = jraph.segment_mean
get_node_padding_mask = jraph.get_node_padding_mask
get_graph_padding_mask = jraph.get_graph_padding_mask
