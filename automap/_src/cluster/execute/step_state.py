"""A pipelined step's state: where each parameter and its optimizer state live.

Each stage holds the parameters its chunks read. A parameter several stages
read (a tied embedding) is owned by the first of them, which sums the
readers' gradients and updates it; the others get a copy after each update.
Parameters the loss never reads live on the first stage. On its stage a
parameter carries the plan's tensor-parallel sharding at the stage's width,
and ZeRO shards over "data" (a hybrid plan's "shard": the replicas of a
group) on the first dimension the tensor axis leaves whole and the
replicas it shards over divide: the optimizer state and the reduced
gradients from ZeRO 1 on, the parameters themselves from ZeRO 3 on.
A plan offloading the optimizer state keeps it in host memory
(`stage_layouts.HOST`) between steps, in the same layouts: each stage's
update brings it to the stage's devices and returns it to the host, the
two crossings of the host link the plan prices.

The layers of a rolled run (`cut.Cut.rolled`: a scanned stack's slice, or
identical layers written one by one, that a stage runs as one scan) are held
as one stacked leaf, a slot, when nothing outside the run reads them: the
stage's programs, gradient accumulators and optimizer update then take one
array per weight of the layer, not one per layer, so their compile does not
grow with the stage's depth. A slot keeps each layer's tensor layout (the
stacked dimension whole over "tensor"), and ZeRO shards it over its layers
where the replicas divide them, else on its layers' own dimension: the same
bytes per replica as its layers held and moved.

`StateLayout` places the user's parameters there and initialises the
optimizer per stage (`init`), gathers them back into the user's pytree
(`params`), and runs each stage's optimizer step on the gradients the
schedule reduced (`apply`); the executor (`executor.py`) runs the schedule
between.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from automap._src.cluster.errors import PlacementError
from automap._src.cluster.execute import stage_layouts
from automap._src.ir.trace import path_str


@dataclasses.dataclass
class PipelineState:
  """Parameters and optimizer state, per stage.

  Attributes:
    params: per stage, slot -> array on the stage's mesh, for the
      parameters the stage owns and the copies it holds of others' (a slot
      is a flat parameter index, or its first leaf's for layers held stacked:
      `StateLayout.members`).
    opt_state: per stage, the optimizer state of the slots it owns.
    step: optimizer steps taken.
  """

  params: list[dict[int, jax.Array]]
  opt_state: list[Any]
  step: int = 0


class StateLayout:
  """Where a pipelined step keeps each parameter and its optimizer state.

  Args:
    plan: the `ClusterPlan` run (its placement's stages, replicas and ZeRO
      stage; its searched shardings per width).
    optimizer: the `optax.GradientTransformation` each stage runs.
    params: the parameters' pytree (arrays or `jax.ShapeDtypeStruct`s).
    chunks: the cut's chunks (`cut.Cut.chunks`): which parameters each
      stage's chunks read.
    meshes: per stage, its mesh (`stage_layouts.meshes`).
    stacked: candidate groups of flat parameter indices to hold stacked, one
      per weight of a rolled run (`cut.Cut.held_stacked`); a group is held
      stacked where its leaves agree in type and tensor layout.

  Attributes:
    treedef: the parameters' pytree structure.
    param_avals: per flat parameter index, its shape and dtype.
    members: slot -> the flat indices it holds stacked, in order (only
      stacked slots); `slot_of`: flat index -> (slot, position in it or None).
    slot_avals: slot -> its shape and dtype (stacked: [layers, ...]).
    stage_params: per stage, the sorted slots it holds (owned and copied).
    owner: flat parameter index (and slot) -> the stage that updates it.
    owned: per stage, the slots it owns.
    tp: per stage, slot -> its tensor-parallel layout (one entry per
      dimension: "tensor" or None).
    zdim: per stage, slot -> the dimension ZeRO shards over its axis (None:
      kept whole).
  """

  def __init__(self, plan, optimizer: optax.GradientTransformation, params: Any,
               chunks: Sequence[Any], meshes: Sequence[Mesh],
               stacked: Sequence[tuple[int, ...]] = ()):
    p = plan.placement
    self.optimizer, self.meshes = optimizer, list(meshes)
    self.S, self.d, self.zero = len(p.stages), p.data_parallel, p.zero
    self.group = p.shard_group or p.data_parallel  # replicas ZeRO shards over
    self.offload = p.offload != "none"
    self.treedef = jax.tree.structure(params)
    self.param_avals = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))
                        for a in jax.tree.leaves(params)]
    self.stage_params = [sorted({i for c in chunks if c.stage == s for i in c.params})
                         for s in range(self.S)]
    self.owner: dict[int, int] = {}
    for c in chunks:
      for i in c.params:
        self.owner.setdefault(i, c.stage)
    # Parameters the loss never reads live on the first stage, their
    # gradients zero, so the optimizer steps them as the unpipelined step does.
    unread = [i for i in range(len(self.param_avals)) if i not in self.owner]
    self.owner.update(dict.fromkeys(unread, 0))
    self.stage_params[0] = sorted(self.stage_params[0] + unread)
    self.owned = [[i for i in self.stage_params[s] if self.owner[i] == s] for s in range(self.S)]
    paths = [path_str(k) for k, _ in jax.tree_util.tree_flatten_with_path((params,))[0]]
    widths = [stage.width for stage in p.stages]
    self.tp = [{i: stage_layouts.tensor_spec(plan.shardings.get(widths[s], {}).get(paths[i]),
                                             self.param_avals[i], widths[s], paths[i],
                                             p.context)
                for i in self.stage_params[s]} for s in range(self.S)]
    self.zdim = [{i: self._zero_dim(self.tp[s][i], self.param_avals[i])
                  for i in self.stage_params[s]} for s in range(self.S)]
    self.slot_avals = dict(enumerate(self.param_avals))
    self.slot_of: list[tuple[int, int | None]] = [(i, None) for i in self.slot_avals]
    self.members: dict[int, tuple[int, ...]] = {}
    for group in stacked:
      self._stack(group)
    self._updates: dict[int, Callable] = {}

  def _stack(self, group: tuple[int, ...]) -> None:
    """Holds `group`'s leaves as one slot, where they agree (one stage, one
    type, one layout) and none is held already."""
    head, s = group[0], self.owner[group[0]]
    avals = {(self.param_avals[i].shape, self.param_avals[i].dtype) for i in group}
    held_elsewhere = {i for t, stage in enumerate(self.stage_params) if t != s for i in stage}
    if (len(group) < 2 or len(avals) != 1
        or any(self.owner[i] != s or i in held_elsewhere for i in group)
        or any(self.slot_of[i][0] != i or i in self.members for i in group)
        or len({self.tp[s][i] for i in group}) != 1
        or len({self.zdim[s][i] for i in group}) != 1):
      return
    aval, k = self.param_avals[head], self.zdim[s][head]
    self.members[head] = tuple(group)
    for j, i in enumerate(group):
      self.slot_of[i] = (head, j)
    self.slot_avals[head] = jax.ShapeDtypeStruct((len(group), *aval.shape), aval.dtype)
    self.tp[s][head] = (None, *self.tp[s][head])
    # ZeRO shards a stack over its layers where the replicas divide them: the
    # same bytes per replica as sharding each layer, on the major dimension,
    # which XLA:TPU reduce-scatters (a minor one it may all-reduce whole and
    # slice, as it did here for layer norms stacked [2, 256]).
    if k is not None and len(group) % self.group == 0:
      k = -1
    self.zdim[s][head] = None if k is None else k + 1
    rest = set(group[1:])
    for i in rest:
      del self.tp[s][i], self.zdim[s][i]
    self.stage_params[s] = [i for i in self.stage_params[s] if i not in rest]
    self.owned[s] = [i for i in self.owned[s] if i not in rest]

  def _zero_dim(self, spec: tuple, aval) -> int | None:
    """The dimension ZeRO shards a parameter on (None: kept whole)."""
    if self.zero == 0 or self.group == 1:
      return None
    for k, n in enumerate(aval.shape):
      if spec[k] is None and n % self.group == 0:
        return k
    return None

  def spec(self, s: int, i: int, *, sharded: bool) -> P:
    """Parameter i's layout on stage s: the plan's tensor sharding, plus
    ZeRO's axis on its ZeRO dimension when `sharded`."""
    spec = list(self.tp[s][i])
    k = self.zdim[s][i]
    if sharded and k is not None:
      spec[k] = stage_layouts.zero_axis(self.meshes[s])
    return P(*spec)

  def param_sharding(self, s: int, i: int) -> NamedSharding:
    """Parameter i on stage s: sharded over ZeRO's axis under ZeRO 3."""
    return NamedSharding(self.meshes[s], self.spec(s, i, sharded=self.zero >= 3))

  def grad_sharding(self, s: int, i: int) -> NamedSharding:
    """Reduced gradients: whole under ZeRO 0, sharded from ZeRO 1 on."""
    return NamedSharding(self.meshes[s], self.spec(s, i, sharded=self.zero >= 1))

  def init(self, params: Any, leaves: Sequence | None = None) -> PipelineState:
    """The parameters placed on their stages and the optimizer initialised.
    `leaves`: where given, `params`' flat values (`params` then only checked,
    abstract as it may be); with `rows(flat)` (`stacks.SplitLeaves`), a
    stacked slot's layers in one array, placed as they are rather than
    layer by layer."""
    checked = self.leaves(params)
    leaves = checked if leaves is None else leaves
    # Copies: the step donates its parameters, never the caller's arrays (a
    # replicated `device_put` may share the caller's buffer).
    placed = [{i: self._placed(leaves, s, i, self.param_sharding(s, i), copy=True)
               for i in self.stage_params[s]} for s in range(self.S)]
    opt = []
    for s in range(self.S):
      owned = [self._placed(leaves, s, i, self.grad_sharding(s, i)) for i in self.owned[s]]
      opt.append(jax.jit(self.optimizer.init, out_shardings=self._state_layouts(s, owned))(
          owned))
    return PipelineState(placed, opt)

  def _placed(self, leaves: Sequence, s: int, i: int, sharding: NamedSharding,
              copy: bool = False) -> jax.Array:
    """Slot i laid out by `sharding` on stage s, from the flat leaves (a
    copy with `copy`): a stacked slot's layers as one slice of the user's
    stacked leaf where the leaves give it (`stacks.SplitLeaves.rows`, in
    one process), else each placed in its own layout, then stacked where
    they lie, never whole on one device."""
    if i not in self.members:
      leaf = stage_layouts.copy(leaves[i]) if copy else leaves[i]
      return stage_layouts.place(leaf, sharding)
    rows = getattr(leaves, "rows", None)
    sliced = rows(self.members[i]) if rows is not None and jax.process_count() == 1 else None
    if sliced is not None:  # (a slice of a whole stack may be the caller's own array)
      return stage_layouts.place(stage_layouts.copy(sliced) if copy else sliced, sharding)
    layer = NamedSharding(sharding.mesh, P(*self.tp[s][i][1:]))
    layers = [stage_layouts.place(leaves[k], layer) for k in self.members[i]]
    return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)(*layers)

  def _leaf(self, held: dict[int, Any], i: int):
    """Flat parameter i's value from a stage's slots."""
    slot, j = self.slot_of[i]
    return held[slot] if j is None else held[slot][j]

  def _state_layouts(self, s: int, owned: list):
    """The optimizer state's layouts: a moment laid out as its parameter's
    gradient (sharded from ZeRO 1 on), anything else (a step count)
    replicated on the stage; in host memory under offload."""
    state = jax.eval_shape(self.optimizer.init, owned)
    layouts = [NamedSharding(self.meshes[s], P())] * len(jax.tree.leaves(state))
    treedef = jax.tree.structure(owned)
    for start in stage_layouts.param_like_subtrees(state, treedef):
      for k, i in enumerate(self.owned[s]):
        layouts[start + k] = self.grad_sharding(s, i)
    if self.offload:
      layouts = [x.with_memory_kind(stage_layouts.HOST) for x in layouts]
    return jax.tree.unflatten(jax.tree.structure(state), layouts)

  def opt_state_avals(self, s: int) -> Any:
    """Stage s's optimizer state as `init` lays it out, in
    `jax.ShapeDtypeStruct`s: what its update compiles for without arrays."""
    owned = [jax.ShapeDtypeStruct(self.slot_avals[i].shape, self.slot_avals[i].dtype,
                                  sharding=self.grad_sharding(s, i)) for i in self.owned[s]]
    return jax.tree.map(lambda a, where: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where),
                        jax.eval_shape(self.optimizer.init, owned),
                        self._state_layouts(s, owned))

  def params(self, state: PipelineState) -> Any:
    """The parameters as the user's pytree (each leaf from the stage owning it)."""
    leaves = [self._leaf(state.params[self.owner[i]], i) for i in range(len(self.param_avals))]
    return jax.tree.unflatten(self.treedef, leaves)

  def opt_state(self, state: PipelineState, join: Callable[[Any], Any] = lambda x: x) -> Any:
    """The optimizer state as `optimizer.init(params)` structures it: each
    parameter's moments from the stage owning it, anything else (a step
    count, the same on every stage) from the first stage; `join` maps each
    parameter-like subtree back to the user's pytree."""
    params = jax.tree.unflatten(self.treedef, self.param_avals)
    want = jax.eval_shape(self.optimizer.init, params)
    leaves, n = jax.tree.leaves(want), len(self.param_avals)
    held = [jax.tree.leaves(state.opt_state[s]) for s in range(self.S)]
    starts = [stage_layouts.param_like_subtrees(
        jax.eval_shape(self.optimizer.init, [self.slot_avals[i] for i in self.owned[s]]),
        jax.tree.structure([0] * len(self.owned[s]))) for s in range(self.S)]
    position = {i: k for owned in self.owned for k, i in enumerate(owned)}
    mine = set()
    for j, start in enumerate(stage_layouts.param_like_subtrees(want, self.treedef)):
      for i in range(n):
        s, (slot, at) = self.owner[i], self.slot_of[i]
        leaf = held[s][starts[s][j] + position[slot]]
        leaves[start + i] = leaf if at is None else leaf[at]
      mine.update(range(start, start + n))
    others = iter(k for k in range(len(held[0])) if not any(
        b <= k < b + len(self.owned[0]) for b in starts[0]))
    for k in range(len(leaves)):
      if k not in mine:
        leaves[k] = held[0][next(others)]
    out = jax.tree.unflatten(jax.tree.structure(want), leaves)
    return _map_param_like(out, self.treedef, join)

  def leaves(self, params: Any) -> list:
    """`params`' leaves, checked against the structure, shapes and dtypes
    the step was built for."""
    leaves, treedef = jax.tree.flatten(params)
    if treedef != self.treedef:
      raise PlacementError(
          f"params: expected the structure the step was built with, {self.treedef}, got "
          f"{treedef}.")
    for i, (a, want) in enumerate(zip(leaves, self.param_avals)):
      if (jnp.shape(a), jnp.result_type(a)) != (want.shape, want.dtype):
        raise PlacementError(
            f"params: leaf {i} is {jnp.result_type(a)}{list(jnp.shape(a))}, the step was built "
            f"for {want.dtype}{list(want.shape)}.")
    return leaves

  def update(self, s: int, opt_state) -> Callable:
    """Stage s's optimizer step: (owned params, reduced grads, state) -> (params,
    state), each kept in its layout (updated ZeRO shards all-gathered); an
    offloaded state brought from the host and returned to it."""
    if s not in self._updates:
      tx = self.optimizer
      shards = [self.grad_sharding(s, i) for i in self.owned[s]]
      held = jax.tree.map(lambda a: a.sharding, opt_state)
      on_device = jax.tree.map(lambda x: x.with_memory_kind("device"), held)

      def update(params, grads, opt_state):
        if self.offload:
          opt_state = jax.device_put(opt_state, on_device)
        # Each replica updates its ZeRO shard (slicing a whole parameter moves
        # nothing); only the updated shards are gathered, by out_shardings.
        params = [jax.lax.with_sharding_constraint(p, z) for p, z in zip(params, shards)]
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

      layouts = ([self.param_sharding(s, i) for i in self.owned[s]], held)
      self._updates[s] = jax.jit(update, out_shardings=layouts, donate_argnums=(0, 2))
    return self._updates[s]

  def apply(self, state: PipelineState, reduced: list[dict[int, jax.Array]],
            call: Callable[..., Any]) -> PipelineState:
    """The state after one optimizer step: shared parameters' gradients
    summed on their owner, each stage's update (run as `call(key, program,
    *args)`), copies refreshed."""
    params = [dict(p) for p in state.params]
    opt = list(state.opt_state)
    for s in range(self.S):
      for i, g in reduced[s].items():
        o = self.owner[i]
        if o != s:
          reduced[o][i] = reduced[o][i] + stage_layouts.place(g, reduced[o][i].sharding)
    for s in range(self.S):
      owned = self.owned[s]
      new, opt[s] = call(("update", s), self.update(s, opt[s]),
                         [params[s][i] for i in owned], [reduced[s][i] for i in owned], opt[s])
      params[s].update(zip(owned, new))
    for s in range(self.S):
      for i in self.stage_params[s]:
        o = self.owner[i]
        if o != s:
          params[s][i] = stage_layouts.place(params[o][i], self.param_sharding(s, i))
    return PipelineState(params, opt, state.step + 1)


def _map_param_like(state, treedef, fn: Callable[[Any], Any]) -> Any:
  """`state` with each subtree of the parameters' structure mapped by `fn`."""
  if jax.tree.structure(state) == treedef:
    return fn(state)
  children, node = jax.tree_util.tree_flatten(state, is_leaf=lambda x: x is not state)
  if len(children) == 1 and children[0] is state:
    return state
  return jax.tree.unflatten(node, [_map_param_like(c, treedef, fn) for c in children])


__all__ = ["PipelineState", "StateLayout"]
