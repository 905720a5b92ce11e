"""plan_cluster: a JAX training step planned over a whole cluster.

Layer costs come from the cost model at each tensor-parallel width (the
sharding search picks the intra-stage sharding), scaled to each candidate
microbatch size; the placement DP picks stages, widths, data parallelism,
ZeRO and recompute for each; the fastest wins.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from automap._src.cluster.errors import PlacementError
from automap._src.cluster.execute.executor import PipelineStep
from automap._src.cluster.execute.stage_compile import StageCompile
from automap._src.cluster.json_file import JsonFile
from automap._src.cluster.placement import configured, slices
from automap._src.cluster.placement.configured import ClusterConfig
from automap._src.cluster.placement.dp import place_any
from automap._src.cluster.placement.options import ClusterOptions, memory_limit
from automap._src.cluster.placement.placed import Placement
from automap._src.cluster.profile import layers as layers_lib
from automap._src.cluster.profile.twin import Twin
from automap._src.cluster.schedule import schedules
from automap._src.cluster.schedule.timetable import timetable
from automap._src.cost.hardware import Hardware
from automap._src.ir import graph as graph_lib
from automap._src.ir import stacks
from automap._src.plan import planner
from automap._src.plan.explain import format_bytes
from automap._src.plan.plan import spec_from_json, spec_to_json
from automap._src.search.request import with_keywords

SCHEMA = 2
# Plans of schema 1 hold each layout as the text of its tuple of entries
# ("(None, 'model')"); they still load.
TEXT_LAYOUTS = 1
# Share of the parameters' bytes left whole over a stated tensor group above
# which price_cluster says the plan priced is not the split stated.
REPLICATED = 0.5


class ReplicatedWeightsWarning(UserWarning):
  """The plan priced for a stated tensor width leaves most weights whole."""


@dataclasses.dataclass(frozen=True)
class ClusterPlan(JsonFile):
  """A cluster plan and its predicted time per batch.

  `plan_cluster` and `price_cluster` return one; `train_step` runs it,
  `explain` prints it, `save(path)` / `load(path)` keep it as JSON.

  Attributes:
    placement: stages, widths, data parallelism, ZeRO, recompute and
      schedule, with the time per batch (seconds).
    microbatch: samples per microbatch.
    global_batch: samples per batch.
    devices: devices in the cluster.
    hardware: the hardware's catalogue name.
    shardings: width -> argument path (parameters "0/...", batch "1/..."
      on) -> its PartitionSpec in the intra-stage sharding at that width,
      for the widths the placement uses.
    timings: seconds the planner spent, per phase ("profile", "placement").
    peak_flops: the device's peak FLOP/s (16-bit matmuls), for MFU.
    memory_limit: bytes per device the plan was held to.
  """

  placement: Placement
  microbatch: int
  global_batch: int
  devices: int
  hardware: str
  shardings: dict[int, dict[str, PartitionSpec]]
  timings: dict[str, float] = dataclasses.field(default_factory=dict, compare=False)
  peak_flops: float = 0.0
  memory_limit: float = math.inf

  @property
  def achieved_flops(self) -> float:
    """Model FLOP/s per device (forward and backward, recompute not counted)."""
    p = self.placement
    return p.flops / (p.time * p.devices)

  @property
  def mfu(self) -> float:
    """Model FLOPs utilisation: achieved_flops over the device's peak (nan
    when the peak is unknown)."""
    return self.achieved_flops / self.peak_flops if self.peak_flops else math.nan

  @property
  def memory(self) -> float:
    """Bytes per device on the fullest device."""
    return max(s.memory for s in self.placement.stages)

  @property
  def fits(self) -> bool:
    return self.memory <= self.memory_limit

  @property
  def time(self) -> float:
    """Seconds per batch."""
    return self.placement.time

  @property
  def throughput(self) -> float:
    """Samples per second."""
    return self.global_batch / self.placement.time

  def to_json(self) -> dict:
    """The plan as JSON-ready data (`save` writes it).

    Returns:
      A dict of the plan's fields and the schema version.
    """
    return {"schema": SCHEMA, "placement": self.placement.to_json(),
            "microbatch": self.microbatch, "global_batch": self.global_batch,
            "devices": self.devices, "hardware": self.hardware,
            "shardings": {str(t): {p: spec_to_json(spec) for p, spec in specs.items()}
                          for t, specs in sorted(self.shardings.items())},
            "peak_flops": self.peak_flops,
            "memory_limit": None if math.isinf(self.memory_limit) else self.memory_limit}

  @classmethod
  def from_json(cls, data: dict) -> ClusterPlan:
    """The plan `to_json` gave (`load` reads it).

    Args:
      data: what `to_json` returned.

    Returns:
      The `ClusterPlan`.

    Raises:
      PlacementError: data of a schema version this one does not read.
    """
    schema = data.get("schema")
    if schema not in (TEXT_LAYOUTS, SCHEMA):
      raise PlacementError(
          f"cluster plan schema {schema!r} is not {TEXT_LAYOUTS} or {SCHEMA}; plan it again.")
    spec_of = ((lambda text: PartitionSpec(*ast.literal_eval(text))) if schema == TEXT_LAYOUTS
               else spec_from_json)
    return cls(Placement.from_json(data["placement"]), int(data["microbatch"]),
               int(data["global_batch"]), int(data["devices"]), str(data["hardware"]),
               {int(t): {p: spec_of(spec) for p, spec in specs.items()}
                for t, specs in data["shardings"].items()},
               peak_flops=float(data.get("peak_flops", 0.0)),
               memory_limit=float(data.get("memory_limit") or math.inf))

  def schedule(self) -> tuple[str, int, int, int]:
    """The pipeline order priced and run.

    Returns:
      (schedule, stages, microbatches per replica, chunks per stage):
      `automap.cluster.timetable(*plan.schedule())` is its timetable.
    """
    p = self.placement
    return p.schedule, len(p.stages), p.microbatches, p.virtual_stages

  def train_step(self, loss_fn: Callable, optimizer: optax.GradientTransformation, params: Any,
                 *batch: Any, devices: slices.Cluster | None = None,
                 schedule: str | None = None) -> PipelineStep:
    """The plan as a training step: `step(state, *batch) -> (state, loss)`
    runs one global batch through the plan's stages, schedule, recompute
    modes and ZeRO stage, then updates the parameters once.

    Args:
      loss_fn: `loss_fn(params, *batch) -> scalar`, the mean loss of a batch
        (the one the plan was made for).
      optimizer: an `optax.GradientTransformation` updating each parameter
        from its own gradient and state.
      params: example parameters (arrays or `jax.ShapeDtypeStruct`s).
      *batch: example batch leaves (arrays or `jax.ShapeDtypeStruct`s),
        each with `global_batch` rows.
      devices: the devices to run on (default `jax.devices()`), or a mesh
        (its devices, row-major); the plan's replica r, stage s uses those
        at r * (devices per pipeline) + the stage's first device onwards.
        A TPU slice's name or `automap.tpu_mesh` gives compile-only
        devices: the step then compiles (`compile_stages`) but cannot run.
      schedule: a registered schedule's name ("gpipe", "1f1b",
        "interleaved", or one added with `register_schedule`) to run another
        order than the plan's (default: the one it priced); the run's memory
        is then not the plan's.

    Returns:
      A `PipelineStep`: `init(params)` places the parameters and initialises
      the optimizer, `step(state, *batch)` runs a batch, `params(state)`
      returns the parameters, `explain()` the schedule run.

    Raises:
      PlacementError: a plan the step cannot run as stated: a schedule
        that cannot run its chunks, devices that do not match its size, a
        loss that cannot be cut at its stages, batch leaves without
        `global_batch` rows, an optimizer that couples parameters, or an
        optimizer offload on devices without pinned host memory.
    """
    return PipelineStep(self, loss_fn, optimizer, params, batch, devices=devices,
                        schedule=schedule)

  def compile_stages(self, loss_fn: Callable, optimizer: optax.GradientTransformation,
                     params: Any, *batch: Any, devices: slices.Cluster | None = None,
                     schedule: str | None = None, hardware: str | Hardware | None = None
                     ) -> list[StageCompile]:
    """The plan's training step compiled stage by stage, nothing run: each
    stage's programs (every chunk's forward and backward, the update) for
    its own block of the devices, laid out as `train_step` lays them out.
    On a TPU slice (`devices="v5p-16"` or `automap.tpu_mesh(...)`) each is
    XLA:TPU's own compile, on any machine with libtpu installed.

    Args:
      loss_fn: as for `train_step`.
      optimizer: as for `train_step`.
      params: as for `train_step` (may be `jax.ShapeDtypeStruct`s).
      *batch: as for `train_step` (may be `jax.ShapeDtypeStruct`s).
      devices: a TPU slice's name, a mesh, or devices (default
        `jax.devices()`), as for `train_step`.
      schedule: as for `train_step`.
      hardware: the device spec each stage's memory is held against
        (default: the devices' catalogue entry, else the plan's hardware).

    Returns:
      Per stage, a `StageCompile`: compiled collectives by (kind, axes)
      beside the plan's tensor and data-parallel bytes, memory per device
      against the device's HBM (`fits`), and the compiler's time estimate
      (XLA:TPU's `optimal_seconds`) beside the plan's.

    Raises:
      PlacementError: what `train_step` refuses, and devices fewer than
        the plan uses (a slice too small for it).
      automap.MeshError: a slice's name without libtpu installed.
    """
    return self.train_step(loss_fn, optimizer, params, *batch, devices=devices,
                           schedule=schedule).compile_stages(hardware)

  def explain(self, against: ClusterPlan | None = None) -> str:
    """The plan, stage by stage, and its schedule's timetable.

    Args:
      against: another plan of the same step (the planner's beside a
        stated split), summarised after it with the throughputs' ratio.

    Returns:
      The text, one line per fact.
    """
    p = self.placement
    run = schedules.get(p.schedule)
    schedule = run.title + (f" x{p.virtual_stages}" if run.chunked else "")
    comm = p.communication
    mfu = "" if math.isnan(self.mfu) else f", MFU {self.mfu:.1%}"
    limit = "" if math.isinf(self.memory_limit) else (
        f" of {format_bytes(self.memory_limit)}" + ("" if self.fits else " (DOES NOT FIT)"))
    lines = [
        f"automap cluster plan: {self.devices} devices ({self.hardware}), global batch "
        f"{self.global_batch}",
        f"  {p.data_parallel} data-parallel x {len(p.stages)} pipeline stage(s) ({schedule}), "
        f"microbatch {self.microbatch} ({p.microbatches} per replica), ZeRO {p.zero}"
        + ("" if p.shard_group is None else
           f" within groups of {p.shard_group} replicas (hybrid)") + ", "
        f"{p.devices} devices used",
        f"  time per batch {_format_seconds(p.time)}, throughput {self.throughput:,.1f} samples/s,"
        f" {self.achieved_flops / 1e12:,.1f} TFLOP/s per device{mfu}",
        f"  memory per device {format_bytes(self.memory)}{limit}",
        "  breakdown per batch: " + ", ".join(
            f"{k.replace('_', ' ')} {_format_seconds(v)}" for k, v in p.breakdown.items()),
        f"  overlapped communication: ZeRO {_format_seconds(comm['zero_exposed'])} exposed of "
        f"{_format_seconds(comm['zero_total'])}, data-parallel sync "
        f"{_format_seconds(comm['sync_exposed'])} exposed of {_format_seconds(comm['sync_total'])}",
        "",
        f"  {'stage':<6}{'layers':<34}{'TP':>4}  {'recompute':<10}{'in flight':>9}"
        f"{'time/microbatch':>17}{'sync':>12}{'memory':>14}"]
    for i, s in enumerate(p.stages):
      names = s.layers[0] if len(s.layers) == 1 else (
          f"{s.layers[0]} .. {s.layers[-1]} ({len(s.layers)})")
      lines.append(
          f"  {i:<6}{names:<34}{s.width:>4}  {s.recompute_mode:<10}"
          f"{s.in_flight:>9.3g}{_format_seconds(s.time):>17}{_format_seconds(s.sync):>12}"
          f"{format_bytes(s.memory):>14}")
    table = timetable(*self.schedule())
    lines += ["", f"  schedule ({table.slots} slots; one per chunk's forward or backward of one "
              "microbatch, F3 / B3: microbatch 3; .k: the stage's k-th chunk):"]
    if table.slots <= 64:
      lines += ["  " + line for line in table.render().splitlines()]
    else:
      lines.append(f"  ({table.slots} slots: `timetable(*plan.schedule()).render()` prints them)")
    if against is not None:
      q = against.placement
      lines += ["", f"  against: {q.data_parallel} data-parallel x {len(q.stages)} stage(s), "
                f"widths {sorted({s.width for s in q.stages})}, microbatch {against.microbatch}: "
                f"{against.throughput:,.1f} samples/s; this plan is "
                f"{self.throughput / against.throughput:.2f}x its throughput"]
    return "\n".join(lines)


def _format_seconds(x: float) -> str:
  return f"{x:.3f} s" if x >= 1 else f"{x * 1e3:.3f} ms"


def plan_cluster(loss_fn: Callable, params: Any, *batch: Any, devices: slices.Cluster,
                 global_batch: int, hardware: str | Hardware | None = None,
                 options: ClusterOptions | None = None, **keywords: Any) -> ClusterPlan:
  """Plans training `loss_fn(params, *batch) -> scalar` on `devices` devices.

  Args:
    loss_fn: `loss_fn(params, *batch) -> scalar`, the loss of one microbatch.
    params: its parameters (arrays or `jax.ShapeDtypeStruct`s).
    *batch: its example batch leaves (arrays or `jax.ShapeDtypeStruct`s),
      of any size: their leading dimension is the batch, and costs are
      scaled to each microbatch size.
    devices: the cluster: how many devices, a TPU slice's name ("v5p-16":
      8 v5p chips), a mesh (`automap.tpu_mesh(...)`) or a sequence of
      devices.
    global_batch: samples per optimizer step over the whole cluster.
    hardware: a catalogue name or a `Hardware` (default: the slice's chip,
      or the catalogue's entry for the devices' kind, else "tpu-v4").
    options: an `automap.cluster.ClusterOptions` (memory_limit, optimizer,
      zero, recompute, widths, microbatches, budget, seed...).
    **keywords: `options`' fields given one by one instead
      (`plan_cluster(..., zero=0)`), not both ways.

  Returns:
    A `ClusterPlan`: stages, per-stage width and recompute, schedule, data
    parallelism, ZeRO, microbatch size, predicted time and throughput.

  Raises:
    PlacementError: devices or global_batch not a positive int, widths or
      microbatch sizes that do not fit them, or no placement that fits the
      memory limit.
    TypeError: a keyword that is no `ClusterOptions` field, or one given
      both ways.
  """
  options = with_keywords(ClusterOptions, options, keywords, "plan_cluster")
  t0 = time.perf_counter()
  hw = slices.hardware(devices, hardware)
  devices = slices.size(devices)
  if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
    raise PlacementError(f"global_batch must be a positive int, got {global_batch!r}.")
  widths = options.widths
  if widths is None:
    widths = [t for t in (1, 2, 4, 8) if t <= min(devices, hw.devices_per_node)]
  widths = sorted(set(widths))
  if any(t > devices for t in widths):
    raise PlacementError(f"widths must be ints in 1..devices={devices}, got {widths!r}.")
  microbatches = options.microbatches
  if microbatches is None:
    microbatches = [1 << k for k in range(global_batch.bit_length())
                    if global_batch % (1 << k) == 0 and global_batch >> k <= 512
                    ] or [global_batch]
  microbatches = sorted(set(microbatches))
  if any(global_batch % b for b in microbatches):
    raise PlacementError(
        f"microbatches must be sizes that divide global_batch={global_batch}, "
        f"got {microbatches!r}.")
  loss_fn, params, twin = layers_of(loss_fn, params, batch)
  profile = layers_lib.measure(loss_fn, params, batch, widths=widths, hardware=hw,
                               search=planner.searcher(options.budget, options.seed),
                               sizes=microbatches, fused_attention=options.fused_attention,
                               twin=twin)
  t1 = time.perf_counter()
  placement, i = place_any(
      [(profile.at(b), global_batch // b) for b in microbatches], devices=devices,
      hardware=hw, options=options.placement(widths))
  b = microbatches[i]
  used = {s.width for s in placement.stages}
  return ClusterPlan(placement, b, global_batch, devices, hw.name,
                     {t: profile.specs[t] for t in sorted(used)},
                     {"profile": t1 - t0, "placement": time.perf_counter() - t1},
                     peak_flops=hw.flops, memory_limit=memory_limit(options, hw))


def layers_of(loss_fn: Callable, params: Any,
              batch: Sequence[Any]) -> tuple[Callable, Any, Twin | None]:
  """The loss and (abstract) parameters the planner reads: a stack of layers
  scanned over stacked parameters as its layers (`stacks.unstack`), as
  `train_step` runs it; and the stack's shallow twin (`twin.Twin`), which
  `layers.measure` profiles in its stead where it can."""
  layers_lib.batch_size(batch)  # checked before anything traces
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
                        params)
  found = stacks.unstack(loss_fn, params, batch)
  if found is None:
    return loss_fn, params, None
  return found.loss_fn, found.split(params), Twin.of(found, params)


def held_itemsize(params) -> int | None:
  """Bytes per element of the dtype holding most of the floating parameters' bytes."""
  held: dict[int, int] = {}
  for x in jax.tree.leaves(params):
    if jnp.issubdtype(x.dtype, jnp.floating):
      size = graph_lib.itemsize(x.dtype)
      held[size] = held.get(size, 0) + size * math.prod(x.shape)
  return max(held, key=held.get) if held else None


def price_cluster(loss_fn: Callable, params: Any, *batch: Any, config: ClusterConfig,
                  global_batch: int, hardware: str | Hardware | None = None,
                  devices: slices.Cluster | None = None, options: ClusterOptions | None = None,
                  **keywords: Any) -> ClusterPlan:
  """Training `loss_fn(params, *batch) -> scalar` priced under a stated split.

  The step is profiled at `config.tensor` x `config.context` devices (the
  sharding search picks the intra-stage sharding, as for `plan_cluster`,
  the sequence pinned over the context group) and microbatches of
  `config.microbatch` samples, then run as `config` states
  (`configured.price`). Where the split has a tensor group it is also
  priced under Megatron-LM's layout at that width (with the same sequence
  or context pins: `stated_profiles`), and the faster of the two that fits
  the memory limit is returned (the leaner where neither does);
  `plan_cluster` on the same step gives the planner's plan to set beside it
  (`explain(against=...)`).

  Args:
    loss_fn: `loss_fn(params, *batch) -> scalar`, the loss of one microbatch.
    params: its parameters (arrays or `jax.ShapeDtypeStruct`s).
    *batch: its example batch leaves, of any size (as for `plan_cluster`).
    config: the split (`ClusterConfig`: tensor, pipeline, data, microbatch,
      recompute, schedule, virtual stages, ZeRO, shard group, weight and
      gradient dtypes, sequence and context parallelism, optimizer offload).
      Its weights recast the parameters before tracing; a split the traced
      layers cannot carry, or the hardware cannot price, is refused before
      any search.
    global_batch: samples per optimizer step.
    hardware: a catalogue name or a `Hardware` (default: the cluster's
      chip, as for `plan_cluster`, else "tpu-v4").
    devices: the cluster, as for `plan_cluster` (default: the devices
      `config` uses); a slice with fewer devices than `config` is refused.
    options: memory_limit, optimizer, mixed_precision, overlap, budget,
      seed, fused_attention as in `ClusterOptions` (the split's fields come
      from `config`).
    **keywords: `options`' fields given one by one instead, not both ways.

  Returns:
    A `ClusterPlan` with the breakdown, memory per device (`fits`),
    achieved FLOP/s and MFU.

  Raises:
    PlacementError: a split that does not divide global_batch, that the
      hardware cannot price, or that the traced layers cannot carry (too
      few blocks for its chunks, a width they are not priced at).
    TypeError: a config that is no `ClusterConfig`; a keyword the config
      states (recompute, zero, ...), no `ClusterOptions` field, or one given
      both ways.
  """
  configured.refuse_stated(keywords, "price_cluster")
  options = with_keywords(ClusterOptions, options, keywords, "price_cluster")
  t0 = time.perf_counter()
  hw = slices.hardware(devices, hardware)
  if not isinstance(config, ClusterConfig):
    raise TypeError(
        f"config must be an automap.cluster.ClusterConfig, got {type(config).__name__}.")
  if devices is not None:
    devices = slices.fitting(
        devices, config.devices, f"the config (tensor={config.tensor} x context="
        f"{config.context} x pipeline={config.pipeline} x data={config.data})")
  config.microbatches(global_batch)  # the split against the batch, before tracing
  configured.check_hardware(config, hw)
  if config.weights:
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, config.weights)
                          if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
  loss_fn, params, twin = layers_of(loss_fn, params, batch)
  # The traced step is the whole model at the tensor width, where a device
  # of the split holds 1/pipeline of its layers and, under ZeRO 3, a shard
  # of their parameters and gradients: the search has the memory for that.
  limit = memory_limit(options, hw)
  share = config.pipeline * ((config.shard_group or config.data) if config.zero == 3 else 1)
  search = planner.searcher(options.budget, options.seed,
                            None if math.isinf(limit) else limit * share)
  profiles = stated_profiles(loss_fn, params, batch, config, hw, search, options.fused_attention,
                             twin)
  t1 = time.perf_counter()
  width = config.width
  priced = {name: configured.price(profile.at(config.microbatch), config,
                                   global_batch=global_batch, hardware=hw, devices=devices,
                                   options=options.placement([width]),
                                   param_itemsize=held_itemsize(params))
            for name, profile in profiles.items()}
  name = kept(priced, limit)
  placement, profile = priced[name], profiles[name]
  whole = profile.replicated_share(config.microbatch, width)
  if config.tensor > 1 and whole > REPLICATED:
    warnings.warn(
        f"price_cluster: the plan priced at tensor={config.tensor} leaves {whole:.0%} of "
        "the parameters' bytes whole on every device of the tensor group, which the config "
        "states split; the price is that plan's (its tensor group runs as data or sequence "
        "parallelism), which was faster than Megatron-LM's layout, or fitted where it did "
        "not. Hold it to the memory the run had (memory_limit=) or give the search more "
        "budget; ClusterPlan.shardings shows the plan priced.", ReplicatedWeightsWarning,
        stacklevel=2)
  return ClusterPlan(placement, config.microbatch, global_batch, devices or config.devices,
                     hw.name, {width: profile.specs[width]},
                     {"profile": t1 - t0, "placement": time.perf_counter() - t1},
                     peak_flops=hw.flops, memory_limit=limit)


def stated_profiles(loss_fn: Callable, params: Any, batch: tuple, config: ClusterConfig,
                    hardware: Hardware, search: Callable, fused_attention: bool = False,
                    twin: Twin | None = None) -> dict[str, layers_lib.Profile]:
  """The layer costs `price_cluster` prices a stated split over, by layout:
  "searched", the sharding search's plan at the split's width (`search`,
  with its sequence or context pins), and where the split has a tensor
  group with sequence parallelism stated, or the searched plan leaves more
  than `REPLICATED` of the weights whole, "Megatron", Megatron-LM's layout
  there with the same pins
  (`planner.megatron`: column- then row-parallel weights, the pinned
  activations gathered and reduce-scattered at the pins), which a search
  under sequence-parallel pins does not reach on its own: the pins' split
  along the sequence reaches the weights first and leaves them whole.

  Args:
    loss_fn, params, batch: the step, as `price_cluster` takes it.
    config: the split: its width, microbatch, sequence and context
      parallelism.
    hardware: the `Hardware`.
    search: the sharding search (`planner.searcher`).
    fused_attention: as in `ClusterOptions`.
    twin: the loss's stack profiled through its shallow twin (`layers_of`).

  Returns:
    Layout name -> `Profile` at the config's width and microbatch.
  """
  def measured(search):
    return layers_lib.measure(loss_fn, params, batch, widths=[config.width], hardware=hardware,
                              search=search, sizes=[config.microbatch],
                              fused_attention=fused_attention,
                              check=lambda graph: configured.chunked(graph, config),
                              sequence_parallel=config.sequence_parallel,
                              context=config.context,
                              offload_names=config.offload_activations, twin=twin)

  profiles = {"searched": measured(search)}
  # Megatron's layout is a candidate where the search may have missed it:
  # under sequence-parallel pins, or where it left the weights whole; a
  # search that split them found a tensor-parallel layout of its own.
  whole = profiles["searched"].replicated_share(config.microbatch, config.width)
  if config.tensor > 1 and (config.sequence_parallel or whole > REPLICATED):
    profiles["Megatron"] = measured(planner.megatron)
  return profiles


def kept(priced: dict[str, Placement], limit: float) -> str:
  """Of placements by name, the fastest within `limit` bytes per device, or
  where none is, the one of least memory."""
  def key(name):
    memory = max(s.memory for s in priced[name].stages)
    return (0, priced[name].time) if memory <= limit else (1, memory)
  return min(priced, key=key)


__all__ = ["ClusterPlan", "ReplicatedWeightsWarning", "plan_cluster", "price_cluster"]
