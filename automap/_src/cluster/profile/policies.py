"""What a layer's `jax.checkpoint` policy keeps and reruns, read off the traced graph.

`policy_rerun` walks a layer's forward back from what its backward reads:
a value a policy saves is kept, any other is rebuilt by rerunning the op that
made it (`cut` is the program's `layers.LayerCut`: its layers and which
ops are forward). The policies priced: JAX's `checkpoint_dots_with_no_batch_dims` (the
"dots" recompute mode: `weight_matmuls`) and
`save_and_offload_only_these_names` (the "offload" mode: `offloaded`).
"""

from __future__ import annotations

import numpy as np

from automap._src.ir.factor_rule import UNSHARDABLE


def weight_matmuls(g, forward: np.ndarray) -> np.ndarray:
  """[O] bool: the forward dot_generals without batch dimensions (no factor
  in both operands and the result): the projections, whose outputs JAX's
  `checkpoint_dots_with_no_batch_dims` policy saves; attention's batched
  contractions are not among them. A batch dimension of extent 1 has no
  factor and goes unseen."""
  found = np.zeros(g.num_ops, bool)
  for o in np.flatnonzero(forward):
    if g.prims[o] == "dot_general":
      rule = g.rules[o]
      shared = set(rule.operands[0]) & set(rule.operands[1]) & set(rule.results[0])
      found[o] = not shared - {UNSHARDABLE}
  return found


def policy_rerun(g, cut, needed: np.ndarray,
                 saveable: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """What a layer under `jax.checkpoint(policy=...)` keeps and reruns.

  needed: [V] forward values its own backward reads.
  saveable: [O] ops whose results the policy saves.
  Returns ([V] saved, [O] rerun): walking each layer's forward last to first,
  a needed value made by a saveable op is saved, one made by any other op is
  rebuilt by rerunning it, and that op's operands from the same layer are
  needed in turn. Values from other layers are the layer's input, kept."""
  needed = needed.copy()
  saved = np.zeros(g.num_values, bool)
  rerun = np.zeros(g.num_ops, bool)
  for o in reversed(np.flatnonzero(cut.forward)):
    results = [v for v in g.results[o] if v >= 0 and needed[v]]
    if not results:
      continue
    if saveable[o]:
      saved[results] = True
      continue
    rerun[o] = True
    for v in g.operands[o]:
      if v >= 0 and g.producer[v] >= 0 and cut.segment[g.producer[v]] == cut.segment[o]:
        needed[v] = True
  return saved, rerun


def offloaded(g, cut, needed: np.ndarray,
              names: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
  """What `save_and_offload_only_these_names(names_which_can_be_offloaded=
  names)` sends to host memory and reruns, per `policy_rerun`: the values
  `checkpoint_name` names with one of `names` are offloaded, each counted
  once (a name and the array it names are one array), the rest rebuilt.

  Returns:
    ([V] offloaded, [O] rerun).
  """
  named = [o for o, n in g.checkpoint_names.items() if n in names and cut.forward[o]]
  saveable = np.zeros(g.num_ops, bool)
  for o in named:
    saveable[o] = True
    for v in g.operands[o]:
      if v >= 0 and g.producer[v] >= 0:
        saveable[g.producer[v]] = True  # what the backward may read in its stead
  saved, rerun = policy_rerun(g, cut, needed, saveable)
  named_values = {v for o in named for v in (*g.results[o], *g.operands[o]) if v >= 0}
  for o in named:
    for u, r in zip(g.operands[o], g.results[o]):
      if u >= 0 and r >= 0 and saved[u] and saved[r]:
        saved[r] = False
  # Only named values (or what they name) leave; other results of a
  # producing op (none, for a matmul) are not the policy's.
  for v in np.flatnonzero(saved):
    if v not in named_values:
      saved[v] = False
  return saved, rerun


__all__ = ["offloaded", "policy_rerun", "weight_matmuls"]
