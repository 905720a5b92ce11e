"""A cluster plan compiled, not run: each pipeline stage's programs built for
its own devices, read beside the plan's price for that stage.

On a TPU slice's compile-only devices (`automap.tpu_mesh`, or a slice's
name) this is XLA:TPU's own compile of every program the step would run, on
any machine: stage s's (data, tensor) mesh takes its block of the slice's
devices as `stage_layouts.meshes` lays out a running step, and each chunk's
forward and backward and each stage's update are lowered for argument types
and layouts alone (`jax.ShapeDtypeStruct`s), nothing placed or run. A
backward's residuals are what the forward's compile says it returns.

Per stage, per global batch and device, read as `run_check` reads a run:
- collectives: the compiled programs' collectives by (kind, mesh axes),
  each times its loop trips and the times the step runs the program;
  "tensor" (within the tensor and context group) and "data" (over the
  replicas) beside the plan's `Stage.comm_bytes` x microbatches and its
  data-parallel sync (`run_check.predicted_data`).
- held: what the stage keeps between its programs, from the layouts: its
  parameters, optimizer state in device memory, gradient accumulators, and
  the most microbatches' stashes (a forward's inputs and residuals until
  its backward) the timetable keeps at once; memory: held plus the largest
  temporary of its programs; both beside `Stage.memory`, and memory against
  the device's HBM (`Hardware.hbm_capacity`).
- seconds: the backend's own estimate of each program's time
  (`optimal_seconds` on XLA:TPU) times its calls, beside the plan's busy
  time for the stage (compute, tensor collectives and ZeRO's per
  microbatch, and the data-parallel sync).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
import time
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp

from automap._src.cluster.execute import run_check, stage_layouts
from automap._src.cost.hardware import Hardware, get_hardware, hardware_for_devices
from automap._src.run import compiled as compiled_lib


@dataclasses.dataclass(frozen=True)
class ProgramCompile:
  """One compiled program of a stage (bytes per device, seconds per call).

  Attributes:
    key: which: ("forward", chunk), ("backward", chunk, final) or ("update",
      stage), as `PipelineStep.programs` keys them.
    calls: how often one global batch runs it.
    memory: its allocation (arguments, results less aliased, temporaries).
    temp: of which temporaries.
    seconds: the backend's estimate of one call (None: it gives none).
    collectives: its compiled collectives (`automap.Report.collectives`'s
      kind), each once.
  """

  key: tuple
  calls: int
  memory: float
  temp: float
  seconds: float | None
  collectives: tuple[compiled_lib.Collective, ...]


@dataclasses.dataclass(frozen=True)
class StageCompile:
  """One pipeline stage compiled for its devices, beside its plan.

  Pairs are (compiled, predicted), bytes per device per global batch,
  seconds per global batch.

  Attributes:
    stage: its index.
    mesh: its mesh's axes and sizes ({"data": 2, "tensor": 2}).
    device_kind: its devices' kind ("TPU v5").
    hardware: the device spec its memory is held against.
    programs: its compiled programs.
    collectives: compiled bytes by (kind, mesh axes), every program's
      collectives times their trips and the program's calls.
    predicted_data: the plan's collectives over the replicas by kind.
    tensor: collectives within the tensor group.
    data: collectives over the replicas.
    held: bytes kept between programs (state and stashes).
    memory: held plus the largest temporary of its programs.
    seconds: the backend's estimates summed over its calls (nan where the
      backend gives none), beside the plan's busy seconds for the stage.
  """

  stage: int
  mesh: dict[str, int]
  device_kind: str
  hardware: Hardware
  programs: tuple[ProgramCompile, ...]
  collectives: dict[tuple[str, tuple[str, ...]], float]
  predicted_data: dict[str, float]
  tensor: tuple[float, float]
  data: tuple[float, float]
  held: tuple[float, float]
  memory: tuple[float, float]
  seconds: tuple[float, float]

  @property
  def capacity(self) -> float:
    """The device's memory, bytes (`Hardware.hbm_capacity`)."""
    return self.hardware.hbm_capacity

  @property
  def fits(self) -> bool:
    """Whether the compiled memory fits the device's."""
    return self.memory[0] <= self.capacity

  @property
  def largest_program(self) -> float:
    """The largest one program's compiled allocation, bytes per device."""
    return max(p.memory for p in self.programs)

  def ratios(self) -> dict[str, float]:
    """compiled / predicted per quantity (1 where both are 0)."""
    return {name: run_check.ratio(*getattr(self, name))
            for name in ("tensor", "data", "held", "memory", "seconds")}

  def table(self) -> str:
    """The stage, readably: memory against the device's, then collectives."""
    axes = " x ".join(f"{n}={k}" for n, k in self.mesh.items())
    gib = 2.0**30
    lines = [f"stage {self.stage}: {self.device_kind} ({axes}), "
             f"{'fits' if self.fits else 'DOES NOT FIT'}: {self.memory[0] / gib:.3f} GiB of "
             f"{self.capacity / gib:.1f} GiB per device (plan {self.memory[1] / gib:.3f} GiB)"]
    for name in ("tensor", "data", "seconds"):
      got, want = getattr(self, name)
      lines.append(f"  {name:<8}compiled {got:.4g}  plan {want:.4g}")
    for (kind, axes), nbytes in sorted(self.collectives.items()):
      lines.append(f"  {kind:<16}{','.join(axes) or '-':<16}{nbytes:>14,.0f} B")
    return "\n".join(lines)


def _typed(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def _bytes(x: jax.ShapeDtypeStruct) -> float:
  """Bytes per device of a laid-out value; 0 in host memory, which the
  plan does not count as the device's."""
  if x.sharding.memory_kind == stage_layouts.HOST:
    return 0.0
  return float(math.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize


def _total(tree) -> float:
  return sum(_bytes(x) for x in jax.tree.leaves(tree))


def _outputs(compiled) -> Any:
  """A compiled program's results as laid-out `jax.ShapeDtypeStruct`s."""
  return jax.tree.map(lambda a, where: _typed(a.shape, a.dtype, where),
                      compiled.out_info, compiled.output_shardings)


def _microbatch(step, s: int, aval) -> jax.ShapeDtypeStruct:
  """A batch leaf's microbatch as stage s receives it."""
  shape = (aval.shape[0] // step.M, *aval.shape[1:])
  return _typed(shape, aval.dtype, stage_layouts.rows(
      step.meshes[s], step.plan.microbatch * step.d, step.split_batch[s], shape))


def _arriving(step, s: int, aval, dtype=None) -> jax.ShapeDtypeStruct:
  """A value from another stage, [d, ...], as it lands on stage s."""
  shape = (step.d, *aval.shape)
  return _typed(shape, dtype or aval.dtype,
                stage_layouts.arrival(step.meshes[s], shape, step.split_batch[s]))


def compile_stages(step, hardware: str | Hardware | None = None) -> list[StageCompile]:
  """Compiles every program of a `PipelineStep` for its stages' devices,
  running nothing, and reads each stage beside the plan.

  Args:
    step: the `PipelineStep` (its devices may be compile-only).
    hardware: the device spec to hold memory against (default: the
      catalogue's entry for the stages' devices, else the plan's).

  Returns:
    One `StageCompile` per stage.
  """
  plan, layout = step.plan, step.layout
  hw = (get_hardware(hardware) if hardware is not None
        else hardware_for_devices(step.meshes[0]) or get_hardware(plan.hardware))
  calls = run_check.program_calls(step, step.timetable.in_order())
  programs = compile_programs(step)
  compiled = {key: c.executable for key, c in programs.items()}
  stash: dict[int, float] = {}  # chunk -> bytes per device one microbatch keeps
  for c in range(len(step.cut.chunks)):
    _, batch, received = programs[("forward", c)].args
    stash[c] = _total((batch, received, _outputs(compiled[("forward", c)])[1]))
  state = [_total(([_param(step, s, i) for i in step.stage_params[s]],
                   step.chunk_programs.acc_avals(s), layout.opt_state_avals(s)))
           for s in range(step.S)]
  return [_stage(step, s, hw, {k: v for k, v in compiled.items()
                               if run_check.program_stage(step, k) == s},
                 calls, state[s] + _most_stashed(step, s, stash))
          for s in range(step.S)]


@dataclasses.dataclass(frozen=True)
class Compiled:
  """One program compiled ahead of its first call: the executable, the
  argument types it was compiled for, and the seconds its compile took."""

  executable: Any  # jax.stages.Compiled
  args: tuple
  seconds: float

  @functools.cached_property
  def input_shardings(self) -> list:
    """The executable's argument layouts, flat in the arguments' order; None
    for an argument the program does not read."""
    return jax.tree.leaves(self.executable.input_shardings[0], is_leaf=lambda x: x is None)


def compile_programs(step, workers: int | None = None) -> dict[tuple, Compiled]:
  """Every program one global batch of `step` runs, compiled for its
  stages' devices from argument types and layouts alone, by the keys of
  `PipelineStep.programs`.

  Three waves: the forwards; the backwards, which take the residuals a
  forward's compile says it returns (in host memory, where a policy
  offloads them); the updates, which take what a stage's last backward
  returns. Each wave's programs are lowered in turn and compiled side by
  side on `workers` threads (default: one per core), XLA compiling with
  Python's lock released: the stages' programs are independent, so a
  pipelined step's first call waits for its largest compiles, not their sum.
  """
  layout, chunks = step.layout, step.cut.chunks
  calls = run_check.program_calls(step, step.timetable.in_order())
  accs = [dict(zip(step.stage_params[s], step.chunk_programs.acc_avals(s)))
          for s in range(step.S)]
  workers = workers or os.cpu_count() or 1
  out: dict[tuple, Compiled] = {}
  forwards = {}
  for c, chunk in enumerate(chunks):
    s = chunk.stage
    own = [_param(step, s, i) for i in step.chunk_programs.slots[c]]
    batch = [_microbatch(step, s, step.batch_avals[i]) for i in chunk.batch]
    received = [_arriving(step, s, step.cut.avals[i]) for i in chunk.receives]
    forwards[("forward", c)] = (step.forward(c), (own, batch, received))
  out.update(_compile(forwards, workers))
  backwards = {}
  for c, chunk in enumerate(chunks):
    s = chunk.stage
    own, batch, received = out[("forward", c)].args
    _, rest = _outputs(out[("forward", c)].executable)
    cots = []
    if c != len(chunks) - 1:
      # An integer value's cotangent arrives as float32 zeros (`sum_on`).
      cots = [_arriving(step, s, aval, None if stage_layouts.inexact(aval) else jnp.float32)
              for aval in step.chunk_programs.send_avals(c)]
    for final in (False, True):
      key = ("backward", c, final)
      if calls[key]:
        ids = step.stage_params[s] if final else step.chunk_programs.slots[c]
        backwards[key] = (step.backward(c, final),
                          (own, batch, received, rest, cots, [accs[s][i] for i in ids]))
  out.update(_compile(backwards, workers))
  reduced: dict[tuple[int, int], jax.ShapeDtypeStruct] = {}  # (stage, slot) -> gradient
  for _, c, final in backwards:
    if final:
      s = chunks[c].stage
      grads, _ = _outputs(out[("backward", c, final)].executable)
      reduced.update({(s, i): g for i, g in zip(step.stage_params[s], grads)})
  updates = {}
  for s in range(step.S):
    owned, state = layout.owned[s], layout.opt_state_avals(s)
    updates[("update", s)] = (layout.update(s, state), (
        [_param(step, s, i) for i in owned], [reduced[(s, i)] for i in owned], state))
  out.update(_compile(updates, workers))
  return out


def _compile(programs: dict[tuple, tuple[Any, tuple]], workers: int) -> dict[tuple, Compiled]:
  """Each (jitted program, argument types) lowered here, then compiled on a
  pool of `workers` threads."""
  lowered = {key: (program.lower(*args), args) for key, (program, args) in programs.items()}

  def compile_one(item):
    key, (low, args) = item
    began = time.perf_counter()
    executable = low.compile()
    return key, Compiled(executable, args, time.perf_counter() - began)

  if workers == 1 or len(lowered) == 1:
    return dict(map(compile_one, lowered.items()))
  with concurrent.futures.ThreadPoolExecutor(min(workers, len(lowered))) as pool:
    return dict(pool.map(compile_one, lowered.items()))


def _param(step, s: int, i: int) -> jax.ShapeDtypeStruct:
  """Slot i as stage s holds it."""
  aval = step.layout.slot_avals[i]
  return _typed(aval.shape, aval.dtype, step.layout.param_sharding(s, i))


def _most_stashed(step, s: int, stash: dict[int, float]) -> float:
  """The most bytes of stashes stage s keeps at once, in the timetable's
  order: a forward's from it until its backward."""
  live = most = 0.0
  for work in step.timetable.in_order():
    if work.stage != s:
      continue
    live += stash[work.chunk] if work.phase == "forward" else -stash[work.chunk]
    most = max(most, live)
  return most


def _stage(step, s: int, hw: Hardware, compiled: dict[tuple, Any], calls: Counter,
           held: float) -> StageCompile:
  """Stage s's programs read beside its plan."""
  mesh, stage, M = step.meshes[s], step.plan.placement.stages[s], step.M
  programs, by_axes = [], Counter()
  groups = {"tensor": 0.0, "data": 0.0}
  seconds = 0.0
  for key, program in compiled.items():
    memory, stats = compiled_lib.compiled_memory(program)
    found = tuple(compiled_lib.collectives(program.as_text(), mesh))
    each = compiled_lib.compiled_seconds(program)
    programs.append(ProgramCompile(key, calls[key], memory,
                                   float(stats.temp_size_in_bytes) if stats else 0.0,
                                   each, found))
    seconds += math.nan if each is None else each * calls[key]
    for c in found:
      nbytes = c.nbytes * c.trips * calls[key]
      by_axes[(c.kind, c.axes)] += nbytes
      group = run_check.axis_group(c, mesh)
      if group is not None:
        groups[group] += nbytes
  data = run_check.predicted_data(step.plan, stage)
  busy = M * (stage.compute + stage.collectives + stage.zero_total) + stage.sync_total
  temp = max(p.temp for p in programs)
  return StageCompile(
      s, dict(mesh.shape), mesh.devices.flat[0].device_kind, hw, tuple(programs),
      dict(by_axes), data, (groups["tensor"], M * stage.comm_bytes),
      (groups["data"], sum(data.values())), (held, stage.memory),
      (held + temp, stage.memory), (seconds, busy))


__all__ = ["ProgramCompile", "StageCompile", "compile_stages"]
