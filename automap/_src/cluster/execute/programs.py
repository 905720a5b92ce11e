"""The programs of a pipelined step: each chunk's forward and backward on its stage's mesh.

Within a stage the programs are `shard_map`s manual over "data" (each replica
runs the chunk on its rows of the microbatch) and automatic over "tensor" (the
parameters carry the plan's sharding at the stage's width, the partitioner
inserts the tensor-parallel collectives). Gradients stay per replica until the
stage's last backward, whose program also reduces them: once per batch, as the
cluster model prices the data-parallel sync. ZeRO shards over "data", per
parameter on its first dimension the tensor axis leaves whole and the replicas
divide (`step_state.StateLayout`): 1 the optimizer state (gradients
reduce-scattered at the end, updated shards all-gathered), 2 the gradients too
(reduce-scattered every microbatch), 3 the parameters too (gathered in each
forward and again in the backward, never stashed). A hybrid plan's mesh
splits "data" into ("replica", "shard"): the programs are manual over both,
ZeRO shards over "shard" within a group, and the gradients' shards are then
all-reduced over "replica" across the groups once per batch, as the cluster
model prices hybrid sharding.

A chunk's forward returns the values its backward needs that are not its
inputs (the residuals of `jax.vjp`), under `jax.checkpoint` with the stage's
recompute policy: "full" keeps nothing, "dots" keeps the weight matmuls'
outputs (`checkpoint_dots_with_no_batch_dims`), "selective" keeps all but
attention's scores and softmax (`cut.Cut.attention_scores`), "offload" sends
the values named by the plan's `offload_activations` to pinned host memory
and rebuilds the rest (`save_and_offload_only_these_names`). Every program is
compiled once and reused for every microbatch.

A program takes the parameters as the state holds them (`StateLayout`'s
slots): a rolled run's layers held stacked are one argument, its scan's
input as it is, and their gradient comes back stacked; any other run's layers
are stacked inside the program.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from automap._src.cluster.execute import cut as cut_lib
from automap._src.cluster.execute import stage_layouts
from automap._src.cluster.execute.step_state import StateLayout

_ATTENTION = "automap.attention_scores"  # what selective recompute drops


class ChunkPrograms:
  """Each chunk's forward and backward program, compiled once per chunk.

  Args:
    cut: the loss cut into the plan's chunks.
    layout: where each parameter lives (`StateLayout`).
    modes: per stage, its recompute mode.
    microbatches: M, per pipeline replica (the loss's seed is 1 / (M d)).
    meshes: per stage, its mesh (`stage_layouts.meshes`).
    offloaded: the `checkpoint_name`s the "offload" mode sends to host memory.
    every: the recompute mode applies to a chunk's first layer and every
      k-th after it (`Placement.recompute_every`), the others keeping all.
  """

  def __init__(self, cut: cut_lib.Cut, layout: StateLayout, modes: Sequence[str],
               microbatches: int, meshes: Sequence[Mesh], offloaded: Sequence[str] = (),
               every: int = 1):
    self.cut, self.layout, self.modes = cut, layout, list(modes)
    self.offloaded, self.every = tuple(offloaded), every
    self.M, self.d, self.zero = microbatches, layout.d, layout.zero
    self.meshes, self.stage_params, self.zdim = list(meshes), layout.stage_params, layout.zdim
    self.attention = cut.attention_scores()
    # Per chunk, the slots it reads (in the order of its parameters' first
    # leaves), and per stack its rolled runs read, the slot holding it or
    # None (stacked in the program from its leaves).
    self.slots: list[list[int]] = []
    self._stack_slots: list[list[int | None]] = []
    for c, chunk in enumerate(cut.chunks):
      self.slots.append(list(dict.fromkeys(layout.slot_of[i][0] for i in chunk.params)))
      held = []
      for positions in self._stacked(c):
        head = layout.slot_of[chunk.params[positions[0]]][0]
        members = tuple(chunk.params[k] for k in positions)
        held.append(head if layout.members.get(head) == members else None)
      self._stack_slots.append(held)
    self._fwd: dict[int, Callable] = {}
    self._bwd: dict[tuple[int, bool], Callable] = {}
    self._residuals: dict[int, tuple] = {}
    self._zeros: dict[int, Callable] = {}

  def _policy(self, s: int):
    """The stage's `jax.checkpoint` policy (None: no checkpoint)."""
    mode = self.modes[s]
    if mode == "none" and self.zero < 3:
      return None
    base = {"none": jax.checkpoint_policies.everything_saveable,
            "full": jax.checkpoint_policies.nothing_saveable,
            "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
            "selective": jax.checkpoint_policies.save_anything_except_these_names(_ATTENTION),
            "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
                names_which_can_be_saved=(), names_which_can_be_offloaded=self.offloaded,
                offload_src="device", offload_dst=stage_layouts.HOST),
            }[mode]
    if self.zero < 3:
      return base
    # ZeRO 3's gathered parameters are never saved, whatever the mode: the
    # backward gathers them again.
    return lambda prim, *args, **params: (prim.name != "all_gather"
                                          and base(prim, *args, **params))

  def _local(self, c: int):
    """The chunk as a function of (parameters, received) on one replica's
    rows, its batch leaves bound: what is differentiated."""
    chunk = self.cut.chunks[c]
    s = chunk.stage
    zdims = [self.zdim[s][i] for i in self.slots[c]]
    zaxis = stage_layouts.zero_axis(self.meshes[s])
    tag_attention = self.modes[s] == "selective"

    def tag(i, x):
      if tag_attention and i in self.attention:
        return checkpoint_name(x, _ATTENTION)
      return x

    policy = self._policy(s)
    # Recompute layer by layer (each layer's inputs kept, one layer rebuilt at
    # a time); under ZeRO 3 around the whole chunk, whose parameter gathers
    # must stay inside what is rebuilt.
    per_layer = policy is not None and self.zero < 3
    wrap = functools.partial(jax.checkpoint, policy=policy) if per_layer else None

    def make(batch):
      def f(slots, received, made):
        if self.zero >= 3:
          slots = [p if k is None else jax.lax.all_gather(p, zaxis, axis=k, tiled=True)
                   for p, k in zip(slots, zdims)]
        params, stacks = self._expand(c, slots, made)
        return self.cut.run(c, params, batch, received, tag, wrap=wrap, every=self.every,
                            stacks=stacks, roll=rolls(self.zero, self.every),
                            own_remat=self.modes[s] == "selective")

      return f if policy is None or per_layer else jax.checkpoint(f, policy=policy)

    return make

  def _stacked(self, c: int) -> tuple[tuple[int, ...], ...]:
    """Chunk c's parameters its rolled runs read stacked (`cut.Cut.stacked`)."""
    return self.cut.stacked(c) if rolls(self.zero, self.every) else ()

  def _made(self, c: int, slots: Sequence) -> list:
    """The stacks chunk c's rolled runs read that no slot holds, stacked
    from their layers' leaves outside what is differentiated, so that a
    stack is an input of the vjp, never a residual kept per microbatch."""
    value = dict(zip(self.slots[c], slots))
    params = self.cut.chunks[c].params
    return [jnp.stack([value[params[k]] for k in positions])
            for positions, head in zip(self._stacked(c), self._stack_slots[c]) if head is None]

  def _expand(self, c: int, slots: Sequence, made: Sequence) -> tuple[list, list | None]:
    """(chunk c's parameters in `Chunk.params` order; the stacks its rolled
    runs read, or None where it runs unrolled) from its slots' values and
    the stacks `_made`: a stacked slot's layers are read only through its
    run's scan (None here) where the chunk rolls, else as its slices."""
    value = dict(zip(self.slots[c], slots))
    rolled = rolls(self.zero, self.every)
    params = []
    for i in self.cut.chunks[c].params:
      slot, j = self.layout.slot_of[i]
      params.append(value[i] if j is None else None if rolled else value[slot][j])
    if not rolled:
      return params, None
    it = iter(made)
    return params, [value[head] if head is not None else next(it)
                    for head in self._stack_slots[c]]

  def _slot_grads(self, c: int, grads: Sequence, d_made: Sequence) -> list:
    """Chunk c's gradients per slot (`slots[c]`): each slot's own, plus its
    share of the stacks made in the program."""
    grads, at = list(grads), {i: k for k, i in enumerate(self.slots[c])}
    params = self.cut.chunks[c].params
    unheld = [positions for positions, head in zip(self._stacked(c), self._stack_slots[c])
              if head is None]
    for positions, d in zip(unheld, d_made):
      for j, k in enumerate(positions):
        grads[at[params[k]]] = grads[at[params[k]]] + d[j]
    return grads

  def _param_in_specs(self, c: int) -> list[P]:
    chunk = self.cut.chunks[c]
    return [self._manual(self.layout.spec(chunk.stage, i, sharded=self.zero >= 3))
            for i in self.slots[c]]

  @staticmethod
  def _manual(spec: P) -> P:
    """The part of a layout a `shard_map` manual over the replicas states
    (its ZeRO axis; "tensor" and "context" are left to the partitioner)."""
    within = (stage_layouts.TENSOR, stage_layouts.CONTEXT)
    return P(*[None if e in within or isinstance(e, tuple) else e for e in spec])

  def _rows(self, s: int) -> P:
    """Values with a leading replica dim ([d, ...]) on stage s."""
    return P(stage_layouts.replicas(self.meshes[s]))

  def _manual_axes(self, s: int) -> set[str]:
    return set(stage_layouts.data_axes(self.meshes[s]))

  # The programs run the traced equations as they are, which carry no
  # varying-axes types, so their `shard_map`s check none (check_vma=False): a
  # replicated parameter's cotangent inside a replica is that replica's,
  # reduced only where the step says so.

  def forward(self, c: int) -> Callable:
    """Chunk c's forward: (params, batch, received) -> (sends, residuals);
    received and sent values carry a leading replica dim, [d, ...]."""
    if c in self._fwd:
      return self._fwd[c]
    chunk = self.cut.chunks[c]
    make = self._local(c)

    def local(params, batch, received):
      received = [r[0] for r in received]
      made = self._made(c, params)
      outs, vjp = jax.vjp(make(batch), params, received, made)
      leaves, tree = jax.tree.flatten(vjp)
      inputs = [("p", k, x) for k, x in enumerate(params)] + [
          ("r", k, x) for k, x in enumerate(received)] + [
          ("b", k, x) for k, x in enumerate(batch)] + [
          ("s", k, x) for k, x in enumerate(made)]
      where = [next(((kind, k) for kind, k, x in inputs if x is leaf), None) for leaf in leaves]
      self._residuals[c] = (tree, where)
      rest = [x[None] for x, w in zip(leaves, where) if w is None]
      return [o[None] for o in outs], rest

    s, rows = chunk.stage, self._rows(chunk.stage)
    body = jax.shard_map(
        local, mesh=self.meshes[s],
        in_specs=(self._param_in_specs(c), [rows] * len(chunk.batch),
                  [rows] * len(chunk.receives)),
        out_specs=(rows, rows), axis_names=self._manual_axes(s), check_vma=False)
    self._fwd[c] = jax.jit(body)
    return self._fwd[c]

  def backward(self, c: int, final: bool) -> Callable:
    """Chunk c's backward: (params, batch, received, residuals, cotangents,
    accumulated grads) -> (grads, cotangents of the received). With `final`
    (the stage's last work) the grads are every stage parameter's, reduced
    over the replicas."""
    key = (c, final)
    if key in self._bwd:
      return self._bwd[key]
    chunk = self.cut.chunks[c]
    s = chunk.stage
    last = c == len(self.cut.chunks) - 1
    acc_ids = self.stage_params[s] if final else list(self.slots[c])
    mine = set(self.slots[c])
    seed = 1.0 / (self.M * self.d)

    def local(params, batch, received, rest, cots, acc):
      tree, where = self._residuals[c]
      received = [r[0] for r in received]
      pools = {"p": params, "r": received, "b": batch, "s": self._made(c, params)}
      it = iter(rest)
      leaves = [next(it)[0] if w is None else pools[w[0]][w[1]] for w in where]
      vjp = jax.tree.unflatten(tree, leaves)
      if last:
        (loss,) = self.send_avals(c)
        cots = [jnp.full((), seed, loss.dtype)]
      else:
        cots = [x[0] for x in cots]
      cots = [stage_layouts.cotangent(x, aval) for x, aval in zip(cots, self.send_avals(c))]
      grads, d_received, d_made = vjp(cots)
      grads = dict(zip(self.slots[c], self._slot_grads(c, grads, d_made)))
      acc = list(acc)
      for k, i in enumerate(acc_ids):
        if i in mine:
          acc[k] = acc[k] + self._accumulate(s, i, grads[i])
        if final:
          acc[k] = self._reduce(s, i, acc[k])
      back = [x[None] for x, r in zip(d_received, self.receive_avals(c))
              if stage_layouts.inexact(r)]
      return acc, back

    rows = self._rows(s)
    body = jax.shard_map(
        local, mesh=self.meshes[s],
        in_specs=(self._param_in_specs(c), [rows] * len(chunk.batch),
                  [rows] * len(chunk.receives), rows, [rows] * (
                      0 if last else len(chunk.sends)),
                  [self._acc_spec(s, i) for i in acc_ids]),
        out_specs=([self._acc_spec(s, i, reduced=final) for i in acc_ids], rows),
        axis_names=self._manual_axes(s), check_vma=False)
    self._bwd[key] = jax.jit(body, donate_argnums=(5,))
    return self._bwd[key]

  def _accumulated_local(self, s: int, i: int) -> bool:
    """Whether parameter i's gradient accumulates per replica ([d, ...])
    rather than reduce-scattered every microbatch (ZeRO 2 and 3)."""
    return self.zero < 2 or self.zdim[s][i] is None

  def _acc_spec(self, s: int, i: int, reduced: bool = False) -> P:
    if reduced:
      return self._manual(self.layout.spec(s, i, sharded=self.zero >= 1))
    if self._accumulated_local(s, i):
      return self._rows(s)
    return self._manual(self.layout.spec(s, i, sharded=True))

  def _accumulate(self, s: int, i: int, g):
    """One microbatch's gradient of parameter i, as its accumulator holds it."""
    k = self.zdim[s][i]
    if self._accumulated_local(s, i):
      return g[None]
    if self.zero == 2:
      zaxis = stage_layouts.zero_axis(self.meshes[s])
      return jax.lax.psum_scatter(g, zaxis, scatter_dimension=k, tiled=True)
    return g  # ZeRO 3: the gather's transpose reduce-scattered it already

  def _reduce(self, s: int, i: int, acc):
    """The data-parallel sync of parameter i's accumulated gradient: its
    ZeRO shard reduce-scattered within the group (every microbatch under
    ZeRO 2 and 3), then, under hybrid sharding, the shard all-reduced
    across the groups."""
    mesh = self.meshes[s]
    across = stage_layouts.across_groups(mesh)
    if not self._accumulated_local(s, i):
      return acc if across is None else jax.lax.psum(acc, across)
    g = acc[0]
    k = self.zdim[s][i]
    if self.zero >= 1 and k is not None:
      g = jax.lax.psum_scatter(g, stage_layouts.zero_axis(mesh), scatter_dimension=k,
                               tiled=True)
      return g if across is None else jax.lax.psum(g, across)
    return jax.lax.psum(g, stage_layouts.replicas(mesh))

  def acc_zeros(self, s: int) -> dict[int, jax.Array]:
    """Stage s's gradient accumulators, zero: per replica ([d, ...]) or,
    reduce-scattered every microbatch, in their ZeRO shards."""
    if s not in self._zeros:
      ids, avals = self.stage_params[s], self.acc_avals(s)
      make = jax.jit(lambda: [jnp.zeros(a.shape, a.dtype) for a in avals],
                     out_shardings=[a.sharding for a in avals])
      self._zeros[s] = lambda: dict(zip(ids, make()))
    return self._zeros[s]()

  def acc_avals(self, s: int) -> list[jax.ShapeDtypeStruct]:
    """Stage s's gradient accumulators' types and layouts, in the order of
    its parameters (`StateLayout.stage_params`)."""
    out = []
    for i in self.stage_params[s]:
      aval = self.layout.slot_avals[i]
      if self._accumulated_local(s, i):
        shape = (self.d, *aval.shape)
        spec = P(stage_layouts.replicas(self.meshes[s]), *self.layout.tp[s][i])
      else:
        shape, spec = aval.shape, self.layout.spec(s, i, sharded=True)
      out.append(jax.ShapeDtypeStruct(shape, aval.dtype,
                                      sharding=NamedSharding(self.meshes[s], spec)))
    return out

  def send_avals(self, c: int) -> list:
    """The avals of what chunk c sends on (its last: the loss)."""
    return self._avals_of(self.cut.chunks[c].sends)

  def receive_avals(self, c: int) -> list:
    """The avals of what chunk c receives from earlier chunks."""
    return self._avals_of(self.cut.chunks[c].receives)

  def _avals_of(self, ids):
    return [self.cut.avals[i] for i in ids]


def rolls(zero: int, every: int) -> bool:
  """Whether the stages run their runs of identical layers as scans
  (`cut.Cut.rolled`), each layer under its stage's recompute policy as
  unrolled, so that a scan keeps, stacked, what the layers kept one by one.
  Two setups run their layers unrolled: recompute of every k-th layer alone
  (k > 1), whose layers differ in what they keep; and ZeRO 3, whose chunk
  gathers its parameters inside what it rebuilds, where XLA:CPU's scan over
  the gathered stack doubled the programs' temporaries (the 4-layer GPT on
  two stages: 165 KB to 298 KB per device, over the plan's price)."""
  return every == 1 and zero < 3


__all__ = ["ChunkPrograms", "rolls"]
