"""A stated training split priced as it runs: Megatron-style p x d x t.

`ClusterConfig` is what a user of a hand-tuned split already knows: tensor,
pipeline and data-parallel widths, microbatch size, recompute mode,
schedule (GPipe, plain or interleaved 1F1B) and ZeRO stage. `price` runs it over a
layer graph exactly as stated: the repeated block split over the
pipeline's chunks as evenly as it divides (`placement.chunks`), each stage on `tensor` devices,
nothing searched; the result is a `Placement` with the breakdown the
planner's plans carry, memory included even where it does not fit.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from automap._src.cluster.errors import PlacementError
from automap._src.cluster.placement import dp as placement_lib
from automap._src.cluster.placement import stage_costs
from automap._src.cluster.placement.options import PlacementOptions
from automap._src.cluster.placement.placed import Placement
from automap._src.cluster.profile.layer_graph import RECOMPUTE_MODES, LayerGraph
from automap._src.cluster.schedule import schedules
from automap._src.cost.hardware import Hardware, get_hardware
from automap._src.ir import graph as graph_lib
from automap._src.search.request import with_keywords

# Options of the planners (PlacementOptions, ClusterOptions) a ClusterConfig fixes.
CONFIG_OWNED = ("recompute", "zero", "widths", "data_parallel", "stages", "virtual_stages",
                "microbatches")
# Where the optimizer state lives between steps (`ClusterConfig.offload`).
OFFLOADS = ("none", "optimizer")


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
  """A training split as it runs: Megatron-style tensor x pipeline x data widths.

  Priced over a layer graph by `price_placement` and over a traced step by
  `price_cluster`; every field is checked when the config is made.

  Args:
    tensor: devices per tensor-parallel group.
    pipeline: pipeline stages.
    data: data-parallel replicas (tensor x context x pipeline x data devices
      in all).
    microbatch: samples per microbatch per replica.
    recompute: "none", "full" (each layer's input kept, the layer rebuilt in
      its backward), "selective" (attention scores and softmax rebuilt) or
      "dots" (each layer's input and weight-matmul outputs kept, the rest
      rebuilt: JAX's `checkpoint_dots_with_no_batch_dims`); True and False
      stand for "full" and "none".
    schedule: a registered schedule's name (`schedule_names()`): "1f1b",
      "interleaved" (1F1B over `virtual_stages` chunks per stage, Narayanan
      et al. 2021), "gpipe" (every forward before the backwards: 1F1B's
      time, every microbatch's activations held), or one added with
      `register_schedule`.
    virtual_stages: chunks per stage; at least 2 for a schedule that runs
      several (interleaved), else 1.
    zero: ZeRO stage 0-3 over the data-parallel replicas (1: optimizer state
      sharded, the distributed optimizer; 2: gradients too; 3: parameters too).
    shard_group: hybrid sharding (HSDP; MaxText's FSDP within a slice and data
      parallelism across slices): ZeRO shards over groups of this many
      consecutive replicas (a slice's or node's), and the groups are plain
      data-parallel replicas of each other, their shards' gradients
      all-reduced across groups once per batch. None: over all `data`.
    weights: the dtype floating-point parameters are held in between steps
      ("float32", as MaxText keeps them; "bfloat16"). `price_cluster` casts
      them to it before tracing, so the step computes as the model's own
      settings make it (flax's `dtype` against `param_dtype`); a graph's
      parameter bytes are taken as held in it. None: as given. Float32
      weights keep no float32 master copy: they contradict mixed_precision.
    gradients: the dtype gradients are accumulated and reduced in
      ("float32", "bfloat16"). None: float32 under mixed_precision (as
      Megatron-LM reduces 16-bit models'), else the parameters' own.
    sequence_parallel: Megatron-LM's sequence parallelism: activations
      between the tensor-parallel matmuls (norms, dropout, residual adds)
      split along the sequence over the tensor group, which the per-width
      sharding search then keeps (`price_cluster`; needs tensor > 1).
    recompute_every: the recompute mode applies to every k-th layer of a
      stage, the others keeping everything (1: every layer); priced as that
      share of the stage's layers.
    context: context parallelism: each sample's sequence split over this many
      devices of every stage (a stage is tensor x context devices), the
      batch's sequence dim pinned over them and the rest laid out by the
      sharding search (attention then gathers keys and values, as XLA
      partitions it). The weight gradients' partial sums are reduced once
      per batch over data x context with the sync, as Megatron-LM and
      Llama 3 run it (`cluster/profile/context.py`), not per microbatch.
    offload: "optimizer" keeps the optimizer state (moments and any float32
      master copy) in host memory between steps, as MaxText's
      `optimizer_memory_host_offload` places it in JAX's pinned host memory:
      it leaves each device's memory and crosses the host link twice per
      step (read for the update, written back) after the last backward, at
      the hardware's `host_bandwidth`. "none": on the device.
    offload_activations: with recompute="offload", the names
      (`jax.ad_checkpoint.checkpoint_name`, as MaxText names
      "decoder_layer_input", "query_proj", "out_proj", "mlpwo"...) of the
      activations each layer's forward sends to host memory and its
      backward brings back; the rest is rebuilt, each layer's input kept:
      `jax.checkpoint_policies.save_and_offload_only_these_names`, MaxText's
      `remat_policy: custom` with those names at "offload". Priced over the
      hardware's `host_bandwidth`, the copies beside the layers' compute.

  Raises:
    PlacementError: a field out of its range, or fields that contradict
      each other; the message names the field and how to fix it.
  """

  tensor: int = 1
  pipeline: int = 1
  data: int = 1
  microbatch: int = 1
  recompute: str | bool = "none"
  schedule: str = schedules.DEFAULT
  virtual_stages: int = 1
  zero: int = 0
  shard_group: int | None = None
  weights: str | None = None
  gradients: str | None = None
  sequence_parallel: bool = False
  recompute_every: int = 1
  context: int = 1
  offload: str = "none"
  offload_activations: tuple[str, ...] = ()

  def __post_init__(self):
    for name in ("tensor", "pipeline", "data", "microbatch", "virtual_stages", "recompute_every",
                 "context"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlacementError(f"ClusterConfig.{name} must be a positive int, got {value!r}.")
    if isinstance(self.recompute, bool):
      object.__setattr__(self, "recompute", "full" if self.recompute else "none")
    if self.recompute not in RECOMPUTE_MODES:
      raise PlacementError(
          f"ClusterConfig.recompute must be one of {RECOMPUTE_MODES} (or True / False), got "
          f"{self.recompute!r}.")
    if self.recompute_every > 1 and self.recompute == "none":
      raise PlacementError(
          f"ClusterConfig.recompute_every={self.recompute_every} recomputes every k-th layer, "
          "but recompute='none' recomputes nothing; set recompute='full', 'selective' or "
          "'dots'.")
    chunked = schedules.get(self.schedule, "ClusterConfig.schedule").chunked
    if not chunked and self.virtual_stages != 1:
      raise PlacementError(
          f"ClusterConfig.virtual_stages={self.virtual_stages} needs schedule="
          f"{schedules.spelt(schedules.names(chunked=True))}; {self.schedule!r} runs one chunk "
          "per stage.")
    if chunked and (self.virtual_stages < 2 or self.pipeline < 2):
      raise PlacementError(
          f"ClusterConfig.schedule={self.schedule!r} needs virtual_stages >= 2 and pipeline >= 2, "
          f"got virtual_stages={self.virtual_stages}, pipeline={self.pipeline}; use "
          f"schedule={schedules.DEFAULT!r} for one chunk per stage.")
    if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
      raise PlacementError(f"ClusterConfig.zero must be a ZeRO stage 0-3, got {self.zero!r}.")
    g = self.shard_group
    if g is not None:
      if isinstance(g, bool) or not isinstance(g, int) or g < 1 or self.data % g:
        raise PlacementError(
            f"ClusterConfig.shard_group must be a positive int dividing data={self.data} "
            f"(replicas per ZeRO shard group), got {g!r}.")
      if g == 1 and self.data > 1:
        raise PlacementError(
            "ClusterConfig.shard_group=1: ZeRO within groups of one replica shards nothing; "
            "use zero=0 for plain data parallelism, or a group of 2 or more replicas.")
      if g < self.data and not self.zero:
        raise PlacementError(
            f"ClusterConfig.shard_group={g} shards ZeRO's state within groups, but zero=0 "
            "shards nothing; set zero=1, 2 or 3 (3: FSDP within the group).")
    if not isinstance(self.sequence_parallel, bool):
      raise PlacementError(
          f"ClusterConfig.sequence_parallel must be True or False, got "
          f"{self.sequence_parallel!r}.")
    if self.sequence_parallel and self.tensor == 1:
      raise PlacementError(
          "ClusterConfig.sequence_parallel splits activations over the tensor group, but "
          "tensor=1 has none; set tensor >= 2 or drop sequence_parallel.")
    for name in ("weights", "gradients"):
      object.__setattr__(self, name, _float_dtype(name, getattr(self, name)))
    if self.offload not in OFFLOADS:
      raise PlacementError(
          f"ClusterConfig.offload must be one of {OFFLOADS}, got {self.offload!r}: "
          "'optimizer' keeps the optimizer state in host memory, 'none' on the device.")
    names = self.offload_activations
    if isinstance(names, str) or not all(isinstance(n, str) and n for n in names):
      raise PlacementError(
          f"ClusterConfig.offload_activations must be a tuple of checkpoint_name names, got "
          f"{names!r}; e.g. offload_activations=('query_proj', 'out_proj').")
    object.__setattr__(self, "offload_activations", tuple(names))
    if bool(names) != (self.recompute == "offload"):
      raise PlacementError(
          "ClusterConfig.offload_activations names what recompute='offload' sends to host "
          f"memory: state both or neither (got recompute={self.recompute!r}, "
          f"offload_activations={names!r}).")

  @property
  def devices(self) -> int:
    """Devices the split uses: tensor x context x pipeline x data."""
    return self.width * self.pipeline * self.data

  @property
  def width(self) -> int:
    """Devices of one stage: tensor x context."""
    return self.tensor * self.context

  def microbatches(self, global_batch: int) -> int:
    """Microbatches per batch over all replicas.

    Args:
      global_batch: samples per optimizer step.

    Returns:
      global_batch / microbatch: data x the microbatches per replica.

    Raises:
      PlacementError: microbatch x data does not divide global_batch, or
        the microbatches per replica do not suit the schedule.
    """
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
      raise PlacementError(f"global_batch must be a positive int, got {global_batch!r}.")
    per_step = self.data * self.microbatch
    if global_batch % per_step:
      raise PlacementError(
          f"ClusterConfig.microbatch={self.microbatch} x data={self.data} = {per_step} samples "
          f"per microbatch step does not divide global_batch={global_batch}; choose a "
          f"microbatch and data width whose product divides it.")
    count = global_batch // per_step
    missing = schedules.get(self.schedule).unmet(self.pipeline, count, self.virtual_stages)
    if missing:
      raise PlacementError(
          f"ClusterConfig: with {count} microbatches per replica and pipeline={self.pipeline} "
          f"stages, the {self.schedule} schedule needs {missing}; change microbatch, data or "
          "global_batch.")
    return count * self.data


def check_hardware(config: ClusterConfig, hardware: str | Hardware) -> None:
  """A PlacementError where `config` states what `hardware` cannot price."""
  hw = get_hardware(hardware)
  if config.offload != "none" and hw.host_bandwidth is None:
    raise PlacementError(
        f"ClusterConfig.offload={config.offload!r}: hardware {hw.name!r} states no host "
        "link bandwidth to price the offloaded state's transfers; give "
        "Hardware(host_bandwidth=bytes/s per direction) or offload='none'.")
  if config.offload_activations and hw.host_bandwidth is None:
    raise PlacementError(
        f"ClusterConfig.offload_activations: hardware {hw.name!r} states no host link "
        "bandwidth to price the offloaded activations' transfers; give "
        "Hardware(host_bandwidth=bytes/s per direction), or another recompute mode.")


def _float_dtype(name: str, value) -> str | None:
  """A floating dtype's name ("float32", "bfloat16"), from a name or a dtype."""
  if value is None:
    return None
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise PlacementError(
        f"ClusterConfig.{name} must be a floating dtype ('float32', 'bfloat16', "
        f"'float16') or None, got {value!r}.")
  return dtype.name


def refuse_stated(keywords, function: str) -> None:
  """A TypeError for a keyword of `function` that the ClusterConfig states."""
  owned = [k for k in keywords if k in CONFIG_OWNED]
  if owned:
    raise TypeError(
        f"{function}() got {owned[0]}=, which the ClusterConfig states; set it there "
        f"(ClusterConfig fields: {', '.join(f.name for f in dataclasses.fields(ClusterConfig))}).")


def chunked(graph: LayerGraph, config: ClusterConfig) -> list[int]:
  """The layers of each of the config's pipeline x virtual_stages chunks
  (bitmasks, `placement.chunks`), or a PlacementError saying why the graph
  cannot be cut so."""
  count = config.pipeline * config.virtual_stages
  masks = placement_lib.chunks(graph, count)
  if masks is None:
    raise PlacementError(
        f"ClusterConfig: the layer graph's repeated block has fewer blocks than "
        f"pipeline={config.pipeline} x virtual_stages={config.virtual_stages} = {count} "
        "chunks (or an edge skips a chunk); choose fewer stages or chunks.")
  return masks


def price(graph: LayerGraph, config: ClusterConfig, *, global_batch: int,
          hardware: str | Hardware, devices: int | None = None,
          options: PlacementOptions | None = None, param_itemsize: int | None = None,
          **keywords: Any) -> Placement:
  """`config` run over `graph`, as stated: nothing searched.

  The repeated block is split over pipeline x virtual_stages chunks as
  evenly as it divides, every stage `config.width` wide (tensor x context;
  the graph's layers priced at that width), each stage holding what the
  config's schedule keeps in flight. A stage that does not fit in memory is
  priced anyway: compare `Stage.memory` with the limit.

  Args:
    graph: the layer graph, its costs per microbatch of `config.microbatch`
      samples.
    config: the split (`ClusterConfig`).
    global_batch: samples per optimizer step.
    hardware: a catalogue name or a `Hardware`: its links price the
      collectives and transfers.
    devices: the cluster's size, which the split must fit (None: exactly
      the split's).
    options: memory_limit, optimizer, mixed_precision, overlap as in
      `PlacementOptions` (their recompute, zero, widths, data_parallel,
      stages and virtual_stages are the config's).
    param_itemsize: bytes per parameter as the graph counts them, which
      `config.gradients` is a share of (None: the config's weights, else 2
      under mixed precision, 4 without).
    **keywords: `options`' fields given one by one instead, not both ways.

  Returns:
    The `Placement`: its stages, time per batch and breakdown, memory per
    stage.

  Raises:
    PlacementError: a split that does not fit `devices` or divide
      global_batch, a graph whose repeated block cannot be cut into its
      chunks or whose layers are not priced at its width, a hardware that
      cannot price it, weights that contradict mixed_precision.
    TypeError: a config or graph of another type; a keyword the config
      states, no `PlacementOptions` field, or one given both ways.
  """
  refuse_stated(keywords, "price_placement")
  base = with_keywords(PlacementOptions, options, keywords, "price_placement")
  if not isinstance(config, ClusterConfig):
    raise TypeError(
        f"config must be an automap.cluster.ClusterConfig, got {type(config).__name__}.")
  if not isinstance(graph, LayerGraph):
    raise TypeError(f"graph must be an automap.cluster.LayerGraph, got {type(graph).__name__}.")
  hw = get_hardware(hardware)
  check_hardware(config, hw)
  devices = config.devices if devices is None else devices
  if isinstance(devices, bool) or not isinstance(devices, int) or devices < config.devices:
    raise PlacementError(
        f"ClusterConfig: tensor={config.tensor} x context={config.context} x "
        f"pipeline={config.pipeline} x data={config.data} = {config.devices} devices do not "
        f"fit devices={devices!r}; "
        "shrink a width or give the cluster's size.")
  options = dataclasses.replace(
      base, recompute=config.recompute, zero=config.zero, widths=(config.width,),
      data_parallel=config.data, stages=config.pipeline, virtual_stages=config.virtual_stages)
  problem = stage_costs.problem(devices, config.microbatches(global_batch), hw, options)
  held = (graph_lib.itemsize(config.weights) if config.weights else param_itemsize
          or (2 if options.mixed_precision else 4))
  if config.weights and held >= 4 and options.mixed_precision:
    raise PlacementError(
        f"ClusterConfig.weights={config.weights!r} keeps no float32 master copy, which "
        "mixed_precision=True counts; drop mixed_precision (Adam's moments then count in "
        "float32, as the weights).")
  if config.gradients:
    gradients = graph_lib.itemsize(config.gradients) / held
    problem = dataclasses.replace(problem, gradients=gradients)
  problem = dataclasses.replace(problem, recompute_share=1 / config.recompute_every,
                                context=config.context, offload=config.offload != "none")
  if config.shard_group is not None and config.shard_group < config.data:
    problem = dataclasses.replace(problem, shard_group=config.shard_group)
  costs = stage_costs.StageCosts(graph, problem)
  missing = [layer for layer in graph.layers if config.width not in layer.widths]
  if missing:
    stage = (f"tensor={config.tensor}" if config.context == 1 else
             f"tensor={config.tensor} x context={config.context} = {config.width} devices")
    raise PlacementError(
        f"ClusterConfig.{stage}: layers {[m.name for m in missing[:3]]} are not priced at "
        f"that width (theirs: {sorted(missing[0].widths)}); profile them at it.")
  masks = chunked(graph, config)
  plan = placement_lib.uniform(costs, masks, data_parallel=config.data, stages=config.pipeline,
                               virtual=config.virtual_stages, width=config.width,
                               zero=config.zero, fits=False, schedule=config.schedule)
  if plan is None or not math.isfinite(plan.time):
    raise PlacementError(f"ClusterConfig {config} could not be priced over this layer graph.")
  return dataclasses.replace(plan, recompute_every=config.recompute_every,
                             context=config.context, offload=config.offload,
                             offload_activations=config.offload_activations)


__all__ = ["OFFLOADS", "ClusterConfig", "check_hardware", "price"]
