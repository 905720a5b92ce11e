"""A cluster plan run as a training step: MPMD pipeline stages on device groups.

Each pipeline stage is its own program on its own devices: a (data, tensor)
mesh of the plan's data-parallel replicas and the stage's tensor-parallel
width ((replica, shard, tensor) under hybrid sharding, the replicas in
groups ZeRO shards within). A single controller issues, in the timetable's order
(`schedule/timetable.py`), one forward or backward program per chunk and
microbatch, and moves activations and their cotangents between stage meshes;
JAX's asynchronous dispatch lets every stage run as soon as its inputs exist,
so the stages overlap as the schedule says. Programs per stage rather than one
SPMD program over a stage axis, because the stages differ: the embedding in the
first, the head and loss in the last, each stage at its own tensor-parallel
width. Every program is compiled once and reused for every microbatch.

The step's parts: `step_state.StateLayout` places the parameters and the
optimizer state on the stages (ZeRO's shards included; an offloaded state
in host memory), gathers them back and runs each stage's update;
`programs.ChunkPrograms` builds each chunk's forward and backward program
(recompute policies, gradient accumulation and the data-parallel
reduction); `PipelineStep` issues the timetable's work and moves values
between the stages.

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

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from automap._src.cluster.errors import PlacementError
from automap._src.cluster.execute import cut as cut_lib
from automap._src.cluster.execute import stage_compile, stage_layouts
from automap._src.cluster.execute.programs import ChunkPrograms, rolls
from automap._src.cluster.execute.stage_compile import StageCompile
from automap._src.cluster.execute.step_state import PipelineState, StateLayout
from automap._src.cluster.placement import slices
from automap._src.cluster.schedule import schedules
from automap._src.cluster.schedule import timetable as pipeline_schedule
from automap._src.cost.hardware import Hardware
from automap._src.ir import stacks
from automap._src.ir.trace import path_str

# INFO: each pipeline program's first call (its compile and first run).
_log = logging.getLogger("automap")

DATA = stage_layouts.DATA
_ATTENTION = "automap.attention_scores"  # what selective recompute drops


class PipelineStep:
  """A cluster plan run as a training step: `step(state, *batch) -> (state, loss)`.

  One call runs one global batch as the plan priced it: each stage's chunks
  of the loss are programs of their own on the stage's mesh (`meshes`),
  issued in the timetable's order (`timetable`), each microbatch's
  activations and cotangents moved between the stages' meshes; each stage
  reduces its gradients once, after its last backward, and the parameters
  are updated once. The state lives on the stages as `layout` places it.
  `ClusterPlan.train_step` builds one:

      step = plan.train_step(loss_fn, optax.adam(1e-3), params, *batch)
      state = step.init(params)          # parameters on their stages
      state, loss = step(state, *batch)  # one global batch
      params = step.params(state)        # the user's pytree again
      opt_state = step.opt_state(state)  # as optimizer.init(params) makes it

  Args:
    plan: the `ClusterPlan` to run (its stages, widths, recompute modes,
      data parallelism, ZeRO stage and per-width shardings).
    loss_fn: `loss_fn(params, *batch) -> scalar`, the batch's mean loss.
    optimizer: an `optax.GradientTransformation` updating each parameter
      from its own gradient and state.
    params: example parameters (arrays or `jax.ShapeDtypeStruct`s).
    batch: example batch leaves, each with the plan's `global_batch` rows.
    devices: the devices to run on (default `jax.devices()`), a mesh (its
      devices), or a TPU slice's name ("v5p-16": its compile-only devices,
      for `compile_stages`).
    schedule: a registered schedule's name to run instead of the plan's.

  Attributes:
    schedule: the schedule run; `timetable` its `Timetable`.
    cut: the loss cut into the plan's chunks (`cut.Cut`).
    meshes: per stage, its mesh.
    layout: where the parameters and optimizer state live (`StateLayout`);
      `stage_params`, `owner` and `param_avals` are its.
    executed: the work the last call ran, in order: the timetable's.
    chunk_programs: each chunk's forward and backward program (`ChunkPrograms`).
    programs: the programs run so far, with their argument types.
    compiled: every program the step runs, compiled before its first call
      (`stage_compile.Compiled`: executable, argument types, compile
      seconds), by the keys of `programs`.
    compile_only: whether the devices only compile (`compile_stages`).

  Raises:
    PlacementError: a schedule that cannot run the plan, a batch leaf
      without `global_batch` rows, a plan the loss cannot be cut into, an
      optimizer that couples parameters, or an optimizer offload on devices
      without pinned host memory.
  """

  def __init__(self, plan: Any, loss_fn: Callable, optimizer: optax.GradientTransformation,
               params: Any, batch: Sequence[Any], devices: Sequence[Any] | None = None,
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
    self.compile_only = slices.compile_only(
        [dev for mesh in self.meshes for dev in mesh.devices.flat])
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
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)),
                            params)
    # A stack of layers scanned over stacked parameters runs as its layers,
    # each stage holding its layers' slices (`stacks`), as the planner saw it.
    self.stacks = stacks.unstack(loss_fn, abstract, local)
    if self.stacks is not None:
      loss_fn, abstract = self.stacks.loss_fn, self.stacks.split(abstract)
      params = abstract
    self.cut = cut_lib.cut(loss_fn, abstract, local, p)
    chunks = self.cut.chunks
    modes = [stage.recompute_mode for stage in p.stages]
    # A rolled run's layers are held stacked where its stage runs it as a scan.
    stacked = [group for c in chunks for group in self.cut.held_stacked(c.index)
               ] if rolls(p.zero, p.recompute_every) else []
    self.layout = StateLayout(plan, optimizer, params, chunks, self.meshes, stacked)
    self.stage_params, self.owner = self.layout.stage_params, self.layout.owner
    self.param_avals = self.layout.param_avals
    self.chunk_programs = ChunkPrograms(self.cut, self.layout, modes, self.M, self.meshes,
                                        p.offload_activations, p.recompute_every)
    widths = [stage.width for stage in p.stages]
    batch_paths = [path_str(k) for k, _ in jax.tree_util.tree_flatten_with_path(
        (params, *batch))[0]][len(self.param_avals):]
    self.split_batch = [stage_layouts.splits_batch(plan.shardings.get(widths[s], {}),
                                                   batch_paths) for s in range(self.S)]
    # On the split leaves: a stage updates its own layers of a stack, so an
    # update reading other layers of one stacked leaf is refused too.
    stage_layouts.check_elementwise(optimizer, abstract)
    self.readers = defaultdict(int)  # value id -> chunks receiving it
    for c in chunks:
      for i in c.receives:
        self.readers[i] += 1
    self.last_work = {s: max(self.timetable.work[s]) for s in range(self.S)}
    # ("forward", c) / ("backward", c, final) / ("update", s) -> (program, argument types)
    self.programs: dict[tuple, tuple[Callable, Any]] = {}
    self.compiled: dict[tuple, stage_compile.Compiled] = {}  # by the same keys
    self.executed: list[pipeline_schedule.Work] = []

  # State (`step_state.StateLayout`).

  def init(self, params: Any) -> PipelineState:
    """The parameters placed on their stages and the optimizer initialised."""
    self._runnable()
    if self.stacks is None:
      return self.layout.init(params)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
                            params)
    return self.layout.init(self.stacks.split(abstract), self.stacks.leaves(params))

  def params(self, state: PipelineState) -> Any:
    """The parameters as the user's pytree (each leaf from the stage owning
    it; a stack's layers stacked again)."""
    params = self.layout.params(state)
    return params if self.stacks is None else self.stacks.join(params)

  def opt_state(self, state: PipelineState) -> Any:
    """The optimizer state as `optimizer.init(params)` structures it on the
    user's pytree (a stack's layers stacked again): what a checkpoint saves."""
    join = (lambda x: x) if self.stacks is None else self.stacks.join
    return self.layout.opt_state(state, join)

  def param_sharding(self, s: int, i: int) -> NamedSharding:
    """Parameter i on stage s: sharded over "data" under ZeRO 3."""
    return self.layout.param_sharding(s, i)

  def grad_sharding(self, s: int, i: int) -> NamedSharding:
    """Reduced gradients: whole under ZeRO 0, sharded from ZeRO 1 on."""
    return self.layout.grad_sharding(s, i)

  def forward(self, c: int) -> Callable:
    """Chunk c's forward program (`ChunkPrograms.forward`)."""
    return self.chunk_programs.forward(c)

  def backward(self, c: int, final: bool) -> Callable:
    """Chunk c's backward program (`ChunkPrograms.backward`)."""
    return self.chunk_programs.backward(c, final)

  def _runnable(self) -> None:
    if self.compile_only:
      raise PlacementError(
          f"devices: the step's devices ({self.meshes[0].devices.flat[0].device_kind}) can "
          "only compile (a TPU slice from libtpu); compile its stages with "
          "`compile_stages()`, or build the step on devices that run.")

  def _arrival(self, s: int, shape: tuple) -> NamedSharding:
    return stage_layouts.arrival(self.meshes[s], shape, self.split_batch[s])

  # Running.

  def __call__(self, state: PipelineState, *batch) -> tuple[PipelineState, jax.Array]:
    """One global batch: the state after its update, and the batch's mean loss."""
    return self.run(state, *batch)

  def run(self, state: PipelineState, *batch, timed: bool = False,
          observe: Callable | None = None) -> tuple[PipelineState, jax.Array]:
    """`step(state, *batch)`; with `timed`, each program is waited for and
    its seconds kept in `self.seconds` (per piece of work, in order): what
    each stage is busy with, for measuring the bubble (serialises the
    stages). `observe(work, bytes)` is called after each piece of work with
    the bytes per device it received from other stages (`run_check`)."""
    self._runnable()
    leaves, treedef = jax.tree.flatten(tuple(batch))
    if treedef != self.batch_treedef or any(
        (jnp.shape(a), jnp.result_type(a)) != (w.shape, w.dtype)
        for a, w in zip(leaves, self.batch_avals)):
      raise PlacementError(
          "batch: expected the structure, shapes and dtypes the step was built with: "
          f"{[f'{w.dtype}{list(w.shape)}' for w in self.batch_avals]}.")
    if not self.compiled:
      self._compile()
    M = self.M
    # Microbatch m: rows m, m + M, ... (every replica's share of it strided alike).
    micro = [[np.asarray(a).reshape(a.shape[0] // M, M, *a.shape[1:])[:, m] for a in leaves]
             for m in range(M)]
    chunks = self.cut.chunks
    values: dict[tuple[int, int], jax.Array] = {}  # (microbatch, value id) -> [d, ...]
    readers: dict[tuple[int, int], int] = {}  # forwards yet to read it
    cotangents: dict[tuple[int, int], list] = defaultdict(list)
    stash: dict[tuple[int, int], tuple] = {}
    acc = [self.chunk_programs.acc_zeros(s) for s in range(self.S)]
    reduced: list[dict[int, jax.Array]] = [{} for _ in range(self.S)]
    losses = []
    self.executed, self.seconds = [], []
    for work in self.timetable.in_order():
      began = time.perf_counter()
      c, m = work.chunk, work.microbatch
      chunk = chunks[c]
      s = chunk.stage
      mesh = self.meshes[s]
      params = [state.params[s][i] for i in self.chunk_programs.slots[c]]
      if work.phase == "forward":
        batch_in = [stage_layouts.place(micro[m][i], stage_layouts.rows(
            mesh, self.plan.microbatch * self.d, self.split_batch[s], micro[m][i].shape))
            for i in chunk.batch]
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
                for p, aval in zip(parts, self.chunk_programs.send_avals(c))]
        final = work == self.last_work[s]
        ids = self.stage_params[s] if final else self.chunk_programs.slots[c]
        grads, back = made = self._call(("backward", c, final), self.backward(c, final),
                                        params, batch_in, received, rest, cots,
                                        [acc[s][i] for i in ids])
        if final:
          # The accumulators die here: a donated one XLA did not reuse for
          # an output would otherwise stay alive beside the reduced grads.
          reduced[s], acc[s] = dict(zip(ids, grads)), {}
        else:
          acc[s].update(zip(ids, grads))
        inexact = [i for i, r in zip(chunk.receives, self.chunk_programs.receive_avals(c))
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
    state = self.layout.apply(state, reduced, self._call)
    loss = sum(jnp.mean(x) for x in losses) / M
    return state, loss

  def _compile(self) -> None:
    """Every program the step runs, compiled before its first call, side by
    side (`stage_compile.compile_programs`); with the `automap` logger at
    INFO, each program's compile seconds and the wall time of all."""
    began = time.perf_counter()
    self.compiled = stage_compile.compile_programs(self)
    if _log.isEnabledFor(logging.INFO):
      for key, compiled in self.compiled.items():
        _log.info("automap: pipeline program %s, compiled in %.2f s",
                  _describe(key, self.cut.chunks), compiled.seconds)
      _log.info("automap: %d pipeline programs compiled in %.2f s (%.2f s of compiles, side "
                "by side)", len(self.compiled), time.perf_counter() - began,
                sum(c.seconds for c in self.compiled.values()))

  def _call(self, key: tuple, program: Callable, *args):
    """`program(*args)` by its executable compiled ahead, its arguments'
    types kept (by `key`) to compile it again for inspection (`run_check`).
    Arguments laid out otherwise than compiled for (a gradient accumulator
    in the layout the partitioner chose for a backward's result over the
    tensor axis) run through `program`, which compiles for them."""
    compiled = self.compiled[key]
    run = compiled.executable
    if any(w is not None and not a.sharding.is_equivalent_to(w, a.ndim)
           for a, w in zip(jax.tree.leaves(args), compiled.input_shardings, strict=True)):
      run = program
    if key not in self.programs:
      self.programs[key] = (program, jax.tree.map(
          lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), args))
      if _log.isEnabledFor(logging.INFO):
        # Timed (its run waited for) only while the profile is asked for.
        began = time.perf_counter()
        out = jax.block_until_ready(run(*args))
        _log.info("automap: pipeline program %s, first run: %.2f s",
                  _describe(key, self.cut.chunks), time.perf_counter() - began)
        return out
    return run(*args)

  def compile_stages(self, hardware: str | Hardware | None = None) -> list[StageCompile]:
    """Every program of the step compiled for its stages' devices, nothing
    run: on a TPU slice's compile-only devices, XLA:TPU's own compile of
    each stage on its block of the slice (`stage_compile`).

    Args:
      hardware: the device spec to hold memory against (default: the
        catalogue's entry for the stages' devices, else the plan's).

    Returns:
      Per stage, a `StageCompile`: its compiled collectives by kind and
      axes, memory per device against the device's HBM, and the backend's
      time estimate, each beside the plan's prediction for the stage.
    """
    return stage_compile.compile_stages(self, hardware)

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


def _describe(key: tuple, chunks) -> str:
  """A program's key in words: ("backward", 3, True) -> "backward of chunk 3
  (stage 1, the stage's last)"."""
  if key[0] == "update":
    return f"update of stage {key[1]}"
  where = f"{key[0]} of chunk {key[1]} (stage {chunks[key[1]].stage}"
  return where + (", the stage's last)" if key[0] == "backward" and key[2] else ")")


__all__ = ["PipelineState", "PipelineStep"]
