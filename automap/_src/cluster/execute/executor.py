"""A cluster plan run as a training step: MPMD pipeline stages on device groups.

Each pipeline stage is its own program on its own devices: a (data, tensor)
mesh of the plan's data-parallel replicas and the stage's tensor-parallel
width. A single controller issues, in the timetable's order
(`pipeline_schedule`), one forward or backward program per chunk and
microbatch, and moves activations and their cotangents between stage meshes;
JAX's asynchronous dispatch lets every stage run as soon as its inputs exist,
so the stages overlap as the schedule says. Programs per stage rather than one
SPMD program over a stage axis, because the stages differ: the embedding in the
first, the head and loss in the last, each stage at its own tensor-parallel
width. Every program is compiled once and reused for every microbatch.

Within a stage the programs are `shard_map`s manual over "data" (each replica
runs the chunk on its rows of the microbatch) and automatic over "tensor" (the
parameters carry the plan's sharding at the stage's width, the partitioner
inserts the tensor-parallel collectives). Gradients stay per replica until the
stage's last backward, whose program also reduces them: once per batch, as the
cluster model prices the data-parallel sync. ZeRO shards over "data", per
parameter on its first dimension the tensor axis leaves whole and the replicas
divide: 1 the optimizer state (gradients reduce-scattered at the end, updated
shards all-gathered), 2 the gradients too (reduce-scattered every
microbatch), 3 the parameters too (gathered in each forward and again in the
backward, never stashed).

A chunk's forward returns the values its backward needs that are not its
inputs (the residuals of `jax.vjp`), under `jax.checkpoint` with the stage's
recompute policy: "full" keeps nothing, "dots" keeps the weight matmuls'
outputs (`checkpoint_dots_with_no_batch_dims`), "selective" keeps all but
attention's scores and softmax (`cut.Cut.attention_scores`).

Parameters read by several stages (a tied embedding) live on each; their
gradients are summed on the first stage that reads them, which updates them,
and the result is copied back. The optimizer runs per stage on the parameters
the stage owns: exact for optimizers that update each parameter from its own
gradient and state (SGD, Adam, AdamW, Lion...); one that couples parameters
(`clip_by_global_norm`) is refused.

One process may drive every device, or one per host (multi-controller JAX):
every process runs the same driver, each program spans its stage's devices
in every process, and values between stages move through each process's own
devices, a pipeline replica living in one process (`stage_layouts.place`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from automap._src.cluster.execute import cut as cut_lib
from automap._src.cluster.execute import stage_layouts
from automap._src.cluster.profile.layer_graph import PlacementError
from automap._src.cluster.schedule import schedules
from automap._src.cluster.schedule import timetable as pipeline_schedule
from automap._src.ir.trace import path_str

DATA = stage_layouts.DATA
_ATTENTION = "automap.attention_scores"  # what selective recompute drops


@dataclasses.dataclass
class PipelineState:
  """Parameters and optimizer state, per stage.

  params: per stage, flat parameter index -> array on the stage's mesh
    (owned and copied ones).
  opt_state: per stage, the optimizer state of the parameters it owns.
  step: optimizer steps taken.
  """

  params: list[dict[int, jax.Array]]
  opt_state: list[Any]
  step: int = 0


class PipelineStep:
  """`step(state, *batch) -> (state, loss)`: one global batch as the plan runs it.

  Built by `ClusterPlan.train_step`; see there.
  """

  def __init__(self, plan, loss_fn: Callable, optimizer: optax.GradientTransformation,
               params, batch: Sequence, devices: Sequence | None = None,
               schedule: str | None = None):
    p = plan.placement
    self.plan, self.optimizer = plan, optimizer
    self.S, self.v, self.d = len(p.stages), p.virtual_stages, p.data_parallel
    self.M, self.zero = p.microbatches, p.zero
    self.schedule = schedule or p.schedule
    if not schedules.get(self.schedule).chunked and self.v != 1:
      raise PlacementError(
          f"schedule: {self.schedule!r} runs one chunk per stage; this plan has {self.v} "
          f"({p.schedule}).")
    self.timetable = pipeline_schedule.timetable(self.schedule, self.S, self.M, self.v)
    self.meshes = stage_layouts.meshes(plan, devices)
    self.treedef = jax.tree.structure(params)
    self.param_avals = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))
                        for a in jax.tree.leaves(params)]
    rows = plan.microbatch
    self.batch_treedef = jax.tree.structure(tuple(batch))
    leaves = jax.tree.leaves(tuple(batch))
    for i, a in enumerate(leaves):
      if jnp.ndim(a) < 1 or jnp.shape(a)[0] != plan.global_batch:
        raise PlacementError(
            f"batch: leaf {i} has shape {jnp.shape(a)}; every batch leaf needs the leading "
            f"batch dim of the plan's global_batch={plan.global_batch}.")
    self.batch_avals = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in leaves]
    local = jax.tree.unflatten(self.batch_treedef, [
        jax.ShapeDtypeStruct((rows, *a.shape[1:]), a.dtype) for a in self.batch_avals])
    abstract = jax.tree.unflatten(self.treedef, self.param_avals)
    self.cut = cut_lib.cut(loss_fn, abstract, local, p)
    self.attention = self.cut.attention_scores()
    chunks = self.cut.chunks
    self.stage_params = [sorted({i for c in chunks if c.stage == s for i in c.params})
                         for s in range(self.S)]
    self.owner = {}
    for c in chunks:
      for i in c.params:
        self.owner.setdefault(i, c.stage)
    # Parameters the loss never reads live on the first stage, their
    # gradients zero, so the optimizer steps them as the unpipelined step does.
    unread = [i for i in range(len(self.param_avals)) if i not in self.owner]
    self.owner.update(dict.fromkeys(unread, 0))
    self.stage_params[0] = sorted(self.stage_params[0] + unread)
    self.owned = [[i for i in self.stage_params[s] if self.owner[i] == s] for s in range(self.S)]
    self.modes = [s.recompute_mode for s in p.stages]
    paths = [path_str(k) for k, _ in jax.tree_util.tree_flatten_with_path((params,))[0]]
    widths = [stage.width for stage in p.stages]
    self.tp = [{i: stage_layouts.tensor_spec(plan.shardings.get(widths[s], {}).get(paths[i]),
                                             self.param_avals[i], widths[s], paths[i])
                for i in self.stage_params[s]} for s in range(self.S)]
    batch_paths = [path_str(k) for k, _ in
                   jax.tree_util.tree_flatten_with_path((params, *batch))[0]][len(paths):]
    self.split_batch = [stage_layouts.splits_batch(plan.shardings.get(widths[s], {}),
                                                   batch_paths) for s in range(self.S)]
    self.zdim = [{i: self._zero_dim(self.tp[s][i], self.param_avals[i])
                  for i in self.stage_params[s]} for s in range(self.S)]
    stage_layouts.check_elementwise(optimizer, abstract)
    self.readers = defaultdict(int)  # value id -> chunks receiving it
    for c in chunks:
      for i in c.receives:
        self.readers[i] += 1
    self.last_work = {s: max(self.timetable.work[s]) for s in range(self.S)}
    self._fwd: dict[int, Callable] = {}
    self._bwd: dict[tuple[int, bool], Callable] = {}
    self._residuals: dict[int, tuple] = {}
    self._updates: dict[int, Callable] = {}
    self._zeros: dict[int, Callable] = {}
    # ("forward", c) / ("backward", c, final) / ("update", s) -> (program, argument types)
    self.programs: dict[tuple, tuple[Callable, Any]] = {}
    self.executed: list[pipeline_schedule.Work] = []

  # Layouts.

  def _zero_dim(self, spec: tuple, aval) -> int | None:
    """The dimension ZeRO shards a parameter on over "data" (None: kept whole)."""
    if self.zero == 0 or self.d == 1:
      return None
    for k, n in enumerate(aval.shape):
      if spec[k] is None and n % self.d == 0:
        return k
    return None

  def _spec(self, s: int, i: int, *, sharded: bool) -> P:
    """Parameter i's layout on stage s: the plan's tensor sharding, plus
    "data" on its ZeRO dimension when `sharded`."""
    spec = list(self.tp[s][i])
    k = self.zdim[s][i]
    if sharded and k is not None:
      spec[k] = DATA
    return P(*spec)

  def param_sharding(self, s: int, i: int) -> NamedSharding:
    return NamedSharding(self.meshes[s], self._spec(s, i, sharded=self.zero >= 3))

  def grad_sharding(self, s: int, i: int) -> NamedSharding:
    """Reduced gradients: whole under ZeRO 0, sharded from ZeRO 1 on."""
    return NamedSharding(self.meshes[s], self._spec(s, i, sharded=self.zero >= 1))

  # State.

  def init(self, params) -> PipelineState:
    """The parameters placed on their stages and the optimizer initialised."""
    leaves = self._param_leaves(params)
    # Copies: the step donates its parameters, never the caller's arrays (a
    # replicated `device_put` may share the caller's buffer).
    placed = [{i: stage_layouts.place(stage_layouts.copy(leaves[i]), self.param_sharding(s, i))
               for i in self.stage_params[s]} for s in range(self.S)]
    opt = []
    for s in range(self.S):
      owned = [stage_layouts.place(leaves[i], self.grad_sharding(s, i)) for i in self.owned[s]]
      opt.append(jax.jit(self.optimizer.init, out_shardings=self._state_layouts(s, owned))(
          owned))
    return PipelineState(placed, opt)

  def _state_layouts(self, s: int, owned: list):
    """The optimizer state's layouts: a moment laid out as its parameter's
    gradient (sharded from ZeRO 1 on), anything else (a step count)
    replicated on the stage."""
    state = jax.eval_shape(self.optimizer.init, owned)
    layouts = [NamedSharding(self.meshes[s], P())] * len(jax.tree.leaves(state))
    treedef = jax.tree.structure(owned)
    for start in stage_layouts.param_like_subtrees(state, treedef):
      for k, i in enumerate(self.owned[s]):
        layouts[start + k] = self.grad_sharding(s, i)
    return jax.tree.unflatten(jax.tree.structure(state), layouts)

  def params(self, state: PipelineState):
    """The parameters as the user's pytree (each leaf from the stage owning it)."""
    leaves = [state.params[self.owner[i]][i] for i in range(len(self.param_avals))]
    return jax.tree.unflatten(self.treedef, leaves)

  def _param_leaves(self, params) -> list:
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

  # Programs.

  def _policy(self, s: int):
    """The stage's `jax.checkpoint` policy (None: no checkpoint)."""
    mode = self.modes[s]
    if mode == "none" and self.zero < 3:
      return None
    base = {"none": jax.checkpoint_policies.everything_saveable,
            "full": jax.checkpoint_policies.nothing_saveable,
            "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
            "selective": jax.checkpoint_policies.save_anything_except_these_names(_ATTENTION),
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
    zdims = [self.zdim[s][i] for i in chunk.params]
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
      def f(params, received):
        if self.zero >= 3:
          params = [p if k is None else jax.lax.all_gather(p, DATA, axis=k, tiled=True)
                    for p, k in zip(params, zdims)]
        return self.cut.run(c, params, batch, received, tag, wrap=wrap)

      return f if policy is None or per_layer else jax.checkpoint(f, policy=policy)

    return make

  def _param_in_specs(self, c: int) -> list[P]:
    chunk = self.cut.chunks[c]
    return [self._manual(self._spec(chunk.stage, i, sharded=self.zero >= 3))
            for i in chunk.params]

  @staticmethod
  def _manual(spec: P) -> P:
    """The part of a layout a `shard_map` manual over "data" states."""
    return P(*[DATA if e == DATA else None for e in spec])

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
      outs, vjp = jax.vjp(make(batch), params, received)
      leaves, tree = jax.tree.flatten(vjp)
      inputs = [("p", k, x) for k, x in enumerate(params)] + [
          ("r", k, x) for k, x in enumerate(received)] + [
          ("b", k, x) for k, x in enumerate(batch)]
      where = [next(((kind, k) for kind, k, x in inputs if x is leaf), None) for leaf in leaves]
      self._residuals[c] = (tree, where)
      rest = [x[None] for x, w in zip(leaves, where) if w is None]
      return [o[None] for o in outs], rest

    body = jax.shard_map(
        local, mesh=self.meshes[chunk.stage],
        in_specs=(self._param_in_specs(c), [P(DATA)] * len(chunk.batch),
                  [P(DATA)] * len(chunk.receives)),
        out_specs=(P(DATA), P(DATA)), axis_names={DATA}, check_vma=False)
    self._fwd[c] = jax.jit(body)
    return self._fwd[c]

  def backward(self, c: int, final: bool) -> Callable:
    """Chunk c's backward: (params, batch, received, residuals, cotangents,
    accumulated grads) -> (grads, cotangents of the received). With `final`
    (the stage's last work) the grads are every stage parameter's, reduced
    over "data"."""
    key = (c, final)
    if key in self._bwd:
      return self._bwd[key]
    chunk = self.cut.chunks[c]
    s = chunk.stage
    last = c == len(self.cut.chunks) - 1
    acc_ids = self.stage_params[s] if final else list(chunk.params)
    seed = 1.0 / (self.M * self.d)

    def local(params, batch, received, rest, cots, acc):
      tree, where = self._residuals[c]
      received = [r[0] for r in received]
      pools = {"p": params, "r": received, "b": batch}
      it = iter(rest)
      leaves = [next(it)[0] if w is None else pools[w[0]][w[1]] for w in where]
      vjp = jax.tree.unflatten(tree, leaves)
      if last:
        (loss,) = self._send_avals(c)
        cots = [jnp.full((), seed, loss.dtype)]
      else:
        cots = [x[0] for x in cots]
      cots = [stage_layouts.cotangent(x, aval) for x, aval in zip(cots, self._send_avals(c))]
      grads, d_received = vjp(cots)
      acc = list(acc)
      for k, i in enumerate(acc_ids):
        if i in chunk.params:
          g = grads[chunk.params.index(i)]
          acc[k] = acc[k] + self._accumulate(s, i, g)
        if final:
          acc[k] = self._reduce(s, i, acc[k])
      back = [x[None] for x, r in zip(d_received, self._receive_avals(c))
              if stage_layouts.inexact(r)]
      return acc, back

    body = jax.shard_map(
        local, mesh=self.meshes[s],
        in_specs=(self._param_in_specs(c), [P(DATA)] * len(chunk.batch),
                  [P(DATA)] * len(chunk.receives), P(DATA), [P(DATA)] * (
                      0 if last else len(chunk.sends)),
                  [self._acc_spec(s, i) for i in acc_ids]),
        out_specs=([self._acc_spec(s, i, reduced=final) for i in acc_ids], P(DATA)),
        axis_names={DATA}, check_vma=False)
    self._bwd[key] = jax.jit(body, donate_argnums=(5,))
    return self._bwd[key]

  def _accumulated_local(self, s: int, i: int) -> bool:
    """Whether parameter i's gradient accumulates per replica ([d, ...])
    rather than reduce-scattered every microbatch (ZeRO 2 and 3)."""
    return self.zero < 2 or self.zdim[s][i] is None

  def _acc_spec(self, s: int, i: int, reduced: bool = False) -> P:
    if reduced:
      return self._manual(self._spec(s, i, sharded=self.zero >= 1))
    if self._accumulated_local(s, i):
      return P(DATA)
    return self._manual(self._spec(s, i, sharded=True))

  def _accumulate(self, s: int, i: int, g):
    """One microbatch's gradient of parameter i, as its accumulator holds it."""
    k = self.zdim[s][i]
    if self._accumulated_local(s, i):
      return g[None]
    if self.zero == 2:
      return jax.lax.psum_scatter(g, DATA, scatter_dimension=k, tiled=True)
    return g  # ZeRO 3: the gather's transpose reduce-scattered it already

  def _reduce(self, s: int, i: int, acc):
    """The data-parallel sync of parameter i's accumulated gradient."""
    if not self._accumulated_local(s, i):
      return acc
    g = acc[0]
    k = self.zdim[s][i]
    if self.zero >= 1 and k is not None:
      return jax.lax.psum_scatter(g, DATA, scatter_dimension=k, tiled=True)
    return jax.lax.psum(g, DATA)

  def _acc_zeros(self, s: int) -> dict[int, jax.Array]:
    """Stage s's gradient accumulators, zero: per replica ([d, ...]) or,
    reduce-scattered every microbatch, in their ZeRO shards."""
    if s not in self._zeros:
      ids = self.stage_params[s]
      shapes, layouts = [], []
      for i in ids:
        aval = self.param_avals[i]
        if self._accumulated_local(s, i):
          shape, spec = (self.d, *aval.shape), P(DATA, *self.tp[s][i])
        else:
          shape, spec = aval.shape, self._spec(s, i, sharded=True)
        shapes.append(jax.ShapeDtypeStruct(shape, aval.dtype))
        layouts.append(NamedSharding(self.meshes[s], spec))
      make = jax.jit(lambda: [jnp.zeros(a.shape, a.dtype) for a in shapes],
                     out_shardings=layouts)
      self._zeros[s] = lambda: dict(zip(ids, make()))
    return self._zeros[s]()

  def _arrival(self, s: int, shape: tuple) -> NamedSharding:
    return stage_layouts.arrival(self.meshes[s], shape, self.split_batch[s])

  def _send_avals(self, c: int):
    return self._avals_of(self.cut.chunks[c].sends)

  def _receive_avals(self, c: int):
    return self._avals_of(self.cut.chunks[c].receives)

  def _avals_of(self, ids):
    return [self.cut.avals[i] for i in ids]

  def _update(self, s: int, opt_state) -> Callable:
    """Stage s's optimizer step: (owned params, reduced grads, state) -> (params,
    state), each kept in its layout (updated ZeRO shards all-gathered)."""
    if s not in self._updates:
      tx = self.optimizer
      shards = [self.grad_sharding(s, i) for i in self.owned[s]]

      def update(params, grads, opt_state):
        # Each replica updates its ZeRO shard (slicing a whole parameter moves
        # nothing); only the updated shards are gathered, by out_shardings.
        params = [jax.lax.with_sharding_constraint(p, z) for p, z in zip(params, shards)]
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

      layouts = ([self.param_sharding(s, i) for i in self.owned[s]],
                 jax.tree.map(lambda a: a.sharding, opt_state))
      self._updates[s] = jax.jit(update, out_shardings=layouts, donate_argnums=(0, 2))
    return self._updates[s]

  # Running.

  def __call__(self, state: PipelineState, *batch) -> tuple[PipelineState, jax.Array]:
    return self.run(state, *batch)

  def run(self, state: PipelineState, *batch, timed: bool = False,
          observe: Callable | None = None) -> tuple[PipelineState, jax.Array]:
    """`step(state, *batch)`; with `timed`, each program is waited for and
    its seconds kept in `self.seconds` (per piece of work, in order): what
    each stage is busy with, for measuring the bubble (serialises the
    stages). `observe(work, bytes)` is called after each piece of work with
    the bytes per device it received from other stages (`run_check`)."""
    leaves, treedef = jax.tree.flatten(tuple(batch))
    if treedef != self.batch_treedef or any(
        (jnp.shape(a), jnp.result_type(a)) != (w.shape, w.dtype)
        for a, w in zip(leaves, self.batch_avals)):
      raise PlacementError(
          "batch: expected the structure, shapes and dtypes the step was built with: "
          f"{[f'{w.dtype}{list(w.shape)}' for w in self.batch_avals]}.")
    M = self.M
    # Microbatch m: rows m, m + M, ... (every replica's share of it strided alike).
    micro = [[np.asarray(a).reshape(a.shape[0] // M, M, *a.shape[1:])[:, m] for a in leaves]
             for m in range(M)]
    chunks = self.cut.chunks
    values: dict[tuple[int, int], jax.Array] = {}  # (microbatch, value id) -> [d, ...]
    readers: dict[tuple[int, int], int] = {}  # forwards yet to read it
    cotangents: dict[tuple[int, int], list] = defaultdict(list)
    stash: dict[tuple[int, int], tuple] = {}
    acc = [self._acc_zeros(s) for s in range(self.S)]
    reduced: list[dict[int, jax.Array]] = [{} for _ in range(self.S)]
    losses = []
    self.executed, self.seconds = [], []
    for work in self.timetable.in_order():
      began = time.perf_counter()
      c, m = work.chunk, work.microbatch
      chunk = chunks[c]
      s = chunk.stage
      mesh = self.meshes[s]
      data = stage_layouts.rows(mesh, self.plan.microbatch * self.d, self.split_batch[s])
      params = [state.params[s][i] for i in chunk.params]
      if work.phase == "forward":
        batch_in = [stage_layouts.place(micro[m][i], data) for i in chunk.batch]
        arriving = [values[(m, i)] for i in chunk.receives]
        received = [stage_layouts.place(x, self._arrival(s, x.shape)) for x in arriving]
        for i in chunk.receives:
          readers[(m, i)] -= 1
          if not readers[(m, i)]:
            del values[(m, i)]
        sends, rest = made = self._call(("forward", c), self.forward(c),
                                        params, batch_in, received)
        for i, x in zip(chunk.sends, sends):
          values[(m, i)] = x
          readers[(m, i)] = self.readers[i]
        if c == len(chunks) - 1:
          losses.append(sends[0])
        stash[(c, m)] = (batch_in, received, rest)
      else:
        batch_in, received, rest = stash.pop((c, m))
        parts = [] if c == len(chunks) - 1 else [cotangents.pop((m, i), [])
                                                 for i in chunk.sends]
        arriving = [x for p in parts for x in p]
        cots = [stage_layouts.sum_on(p, self._arrival(s, (self.d, *aval.shape)), aval)
                for p, aval in zip(parts, self._send_avals(c))]
        final = work == self.last_work[s]
        ids = self.stage_params[s] if final else list(chunk.params)
        grads, back = made = self._call(("backward", c, final), self.backward(c, final),
                                        params, batch_in, received, rest, cots,
                                        [acc[s][i] for i in ids])
        if final:
          reduced[s] = dict(zip(ids, grads))
        else:
          acc[s].update(zip(ids, grads))
        inexact = [i for i, r in zip(chunk.receives, self._receive_avals(c))
                   if stage_layouts.inexact(r)]
        for i, g in zip(inexact, back):
          cotangents[(m, i)].append(g)
      self.executed.append(work)
      if timed:
        jax.block_until_ready(made)
        self.seconds.append(time.perf_counter() - began)
      if observe is not None:
        observe(work, sum(stage_layouts.device_bytes(x, self._arrival(s, x.shape))
                          for x in arriving
                          if x.sharding.mesh != mesh))
    state = self._apply(state, reduced)
    loss = sum(jnp.mean(x) for x in losses) / M
    return state, loss

  def _apply(self, state: PipelineState, reduced: list[dict[int, jax.Array]]) -> PipelineState:
    """Shared parameters' gradients summed on their owner; each stage's update;
    copies refreshed."""
    params = [dict(p) for p in state.params]
    opt = list(state.opt_state)
    for s in range(self.S):
      for i, g in reduced[s].items():
        o = self.owner[i]
        if o != s:
          reduced[o][i] = reduced[o][i] + stage_layouts.place(g, reduced[o][i].sharding)
    for s in range(self.S):
      owned = self.owned[s]
      new, opt[s] = self._call(("update", s), self._update(s, opt[s]),
                               [params[s][i] for i in owned],
                               [reduced[s][i] for i in owned], opt[s])
      params[s].update(zip(owned, new))
    for s in range(self.S):
      for i in self.stage_params[s]:
        o = self.owner[i]
        if o != s:
          params[s][i] = stage_layouts.place(params[o][i], self.param_sharding(s, i))
    return PipelineState(params, opt, state.step + 1)

  def _call(self, key: tuple, program: Callable, *args):
    """`program(*args)`, its arguments' types kept (by `key`) to compile it
    again for inspection (`run_check`)."""
    if key not in self.programs:
      self.programs[key] = (program, jax.tree.map(
          lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), args))
    return program(*args)

  def check(self, state: PipelineState, *batch):
    """Runs one batch and sets what each stage did beside its plan's price:
    `(list of run_check.StageCheck, new state)` (compiled collectives over
    the tensor and data axes, bytes received from other stages, peak
    memory; measured and predicted)."""
    from automap._src.cluster.execute import run_check

    return run_check.check(self, state, *batch)

  def explain(self) -> str:
    """The schedule run: per stage, which microbatch's forward or backward in
    which slot."""
    return (f"{self.schedule} schedule, {self.S} stage(s) x {self.v} chunk(s), "
            f"{self.M} microbatch(es), {self.d} data-parallel replica(s), ZeRO {self.zero}\n"
            + self.timetable.render())


__all__ = ["PipelineState", "PipelineStep"]
