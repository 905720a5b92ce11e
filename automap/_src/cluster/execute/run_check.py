"""A running cluster plan against its price: per stage, what its compiled
programs communicate, what crosses between stages, and the memory it holds.

Bytes are per device and per global batch, in the convention of compiled
collectives (each collective's result: an all-reduce's whole array, a
reduce-scatter's shard, an all-gather's gathered array), so the compiled
programs and the plan are read alike:
- tensor: the collectives over the stage's tensor axis, every forward and
  backward program times the microbatches it runs; predicted, the plan's
  `Stage.comm_bytes` per microbatch (the cost model's collectives of the
  stage's layers under the searched plan) times the microbatches.
- data: over the replicas' axes (the data-parallel sync, ZeRO's gathers and
  reduce-scatters, the optimizer step's gather of updated shards); predicted
  from the stage's parameter bytes P as the cluster model counts them, ZeRO
  sharding over g replicas (all d, or a hybrid plan's group): ZeRO 0
  all-reduces the gradients once (P), 1 reduce-scatters them (P / g) and
  gathers the updated shards (P), 2 reduce-scatters every microbatch, 3 also
  gathers the parameters for each forward and backward (and, priced as
  DeepSpeed runs it, again for a full recompute, where XLA's rebuilt forward
  shares the backward's gather) instead of gathering after the update. Under
  hybrid sharding (g < d) each shard is then all-reduced across the d / g
  groups once (P / g).
- received: bytes a device of the stage receives from other stages
  (activations forward, their cotangents backward); predicted, the plan's
  `Stage.bytes_in + bytes_out` per microbatch.
- held: the most bytes live on a device of the stage between its programs
  (parameters, optimizer state, gradients, the stashes the schedule keeps,
  values in flight); an optimizer state offloaded to host memory is not the
  device's, as the plan prices it; predicted, `Stage.memory`.
- memory: held plus the largest temporary of its programs
  (`memory_analysis`: the backward's working set as the backend schedules
  it, which the plan counts only as the one layer a recompute rebuilds);
  predicted, `Stage.memory`.
"""

from __future__ import annotations

import dataclasses
import gc
from collections import Counter

import jax
import numpy as np

from automap._src.cluster.execute.stage_layouts import CONTEXT, HOST, TENSOR, data_axes
from automap._src.run import compiled as compiled_lib


@dataclasses.dataclass(frozen=True)
class StageCheck:
  """One stage: (measured, predicted) bytes per device per global batch."""

  stage: int
  tensor: tuple[float, float]
  data: tuple[float, float]
  received: tuple[float, float]
  memory: tuple[float, float]
  held: tuple[float, float]

  def ratios(self) -> dict[str, float]:
    """measured / predicted per quantity (1 where both are 0)."""
    return {name: ratio(*getattr(self, name))
            for name in ("tensor", "data", "received", "held", "memory")}


def ratio(got: float, want: float) -> float:
  """got / want: 1 where both are 0, inf where only want is."""
  return got / want if want else (1.0 if not got else float("inf"))


def check(step, state, *batch) -> tuple[list[StageCheck], object]:
  """Runs one global batch, watching memory, and reads every program's
  compiled collectives; returns the per-stage checks and the new state."""
  # Arrays nothing refers to but a reference cycle would count as held.
  gc.collect()
  peaks = [0.0] * step.S
  received = [0.0] * step.S
  meshes = step.meshes

  def observe(work, moved):
    s = work.stage
    received[s] += moved
    for t in range(step.S):
      peaks[t] = max(peaks[t], _resident(meshes[t]))

  state, _ = step.run(state, *batch, observe=observe)
  calls = program_calls(step, step.executed)
  tensor, data, temp = [0.0] * step.S, [0.0] * step.S, [0.0] * step.S
  for key in step.programs:
    s = program_stage(step, key)
    compiled = step.compiled[key].executable
    stats = compiled.memory_analysis()
    if stats is not None:
      temp[s] = max(temp[s], float(stats.temp_size_in_bytes))
    for c in compiled_lib.collectives(compiled.as_text(), meshes[s]):
      nbytes = c.nbytes * c.trips * calls[key]
      group = axis_group(c, meshes[s])
      if group == "tensor":
        tensor[s] += nbytes
      elif group == "data":
        data[s] += nbytes
  checks = []
  M = step.M
  for s, stage in enumerate(step.plan.placement.stages):
    want_data = sum(predicted_data(step.plan, stage).values())
    checks.append(StageCheck(
        s, (tensor[s], M * stage.comm_bytes), (data[s], want_data),
        (received[s], M * (stage.bytes_in + stage.bytes_out)),
        (peaks[s] + temp[s], stage.memory), (peaks[s], stage.memory)))
  return checks, state


def program_calls(step, works) -> Counter:
  """How often a step runs each program in one global batch, by the keys
  of `PipelineStep.programs`: the timetable's `works` (each stage's last
  backward the final one), and each stage's update once."""
  calls = Counter()
  for work in works:
    final = work.phase == "backward" and work == step.last_work[work.stage]
    key = ("forward", work.chunk) if work.phase == "forward" else ("backward", work.chunk, final)
    calls[key] += 1
  for s in range(step.S):
    calls[("update", s)] = 1
  return calls


def program_stage(step, key: tuple) -> int:
  """The stage a program (a `PipelineStep.programs` key) runs on."""
  return key[1] if key[0] == "update" else step.cut.chunks[key[1]].stage


def axis_group(collective: compiled_lib.Collective, mesh) -> str | None:
  """"tensor" for a collective within a stage's tensor (and context)
  group, "data" for one over its replicas, None for any other."""
  axes = set(collective.axes)
  if axes and axes <= {TENSOR, CONTEXT}:
    return "tensor"
  if axes and axes <= set(data_axes(mesh)):
    return "data"
  return None


def predicted_data(plan, stage) -> dict[str, float]:
  """The plan's collectives over a stage's replicas, bytes per device per
  global batch by kind, from the stage's parameter bytes (the module's
  docstring says how each ZeRO stage counts them).

  Args:
    plan: the `ClusterPlan` (its replicas, microbatches, ZeRO stage and
      shard group).
    stage: one of its `Stage`s.

  Returns:
    {"all-reduce" | "reduce-scatter" | "all-gather": bytes}; empty without
    data parallelism.
  """
  p = plan.placement
  M, d, zero = p.microbatches, p.data_parallel, p.zero
  g = p.shard_group or d
  P = stage.param_bytes
  if d == 1:
    return {}
  if zero == 0:
    return {"all-reduce": P}
  gathers = (M * (3 if stage.recompute_mode == "full" else 2) * P if zero == 3 else P)
  out = {"reduce-scatter": (M if zero >= 2 else 1) * P / g, "all-gather": gathers}
  if g < d:
    out["all-reduce"] = P / g
  return out


def _resident(mesh) -> float:
  """The most bytes any one device of `mesh` holds in arrays laid out on it."""
  per_device = np.zeros(mesh.devices.size)
  index = {dev: k for k, dev in enumerate(mesh.devices.flat)}
  for a in jax.live_arrays():
    sharding = a.sharding
    # An offloaded optimizer state lies in host memory, which the plan does
    # not count in a device's.
    if getattr(sharding, "mesh", None) != mesh or sharding.memory_kind == HOST:
      continue
    shard = int(np.prod(sharding.shard_shape(a.shape))) * a.dtype.itemsize
    for dev in sharding.device_set:
      per_device[index[dev]] += shard
  return float(per_device.max())


__all__ = ["StageCheck", "axis_group", "check", "predicted_data", "program_calls", "program_stage",
           "ratio"]
