"""What placement returns: a `Placement` of pipeline `Stage`s and its time per batch.

A placement splits a layer graph (`profile/layer_graph.py`) into pipeline
stages, each a set of layers on a tensor-parallel group, replicated
data-parallel, and runs them in a registered schedule's order
(`schedule/schedules.py`). The DP (`dp.py`) and a stated config
(`configured.py`) both return one. Units: seconds, bytes (per device).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from automap._src.cluster.errors import PlacementError
from automap._src.cluster.profile.layer_graph import RECOMPUTE_MODES
from automap._src.cluster.schedule import schedules


@dataclasses.dataclass(frozen=True)
class Stage:
  """One pipeline stage of a placement (costs per microbatch, per device).

  Under an interleaved schedule a stage is one device group's chunks: its
  layers are every chunk's, its times per microbatch cover all of them.

  Attributes:
    layers: the names of its layers, in the graph's order.
    width: tensor-parallel devices.
    recompute: any recompute (recompute_mode != "none").
    first_device: offset within a pipeline replica.
    in_flight: microbatches stashed at the peak (interleaved: in chunk shares).
    time: seconds per microbatch, T_i.
    compute: of which forward + backward (+ recompute).
    collectives: of which tensor-parallel collectives.
    transfers: of which sends and receives to other stages.
    zero: of which ZeRO gathers / reduce-scatters left exposed.
    sync: seconds of data-parallel sync once per batch left exposed, Y_i.
    memory: bytes per device.
    recompute_mode: one of RECOMPUTE_MODES ("": from `recompute`).
    sync_total: the whole sync, exposed or overlapped (-1: `sync`).
    zero_total: the whole ZeRO collectives per microbatch (-1: `zero`).
    flops: model FLOPs per microbatch per device.
    param_bytes: its parameters' bytes per device.
    comm_bytes: tensor-parallel collectives' result bytes per microbatch.
    bytes_in: per microbatch per device, on edges from other stages.
    bytes_out: per microbatch per device, on edges to other stages.

  Raises:
    PlacementError: a recompute_mode not in RECOMPUTE_MODES, or one that
      contradicts `recompute`.
  """

  layers: tuple[str, ...]
  width: int
  recompute: bool
  first_device: int
  in_flight: float
  time: float
  compute: float
  collectives: float
  transfers: float
  zero: float
  sync: float
  memory: float
  recompute_mode: str = ""
  sync_total: float = -1.0
  zero_total: float = -1.0
  flops: float = 0.0
  param_bytes: float = 0.0
  comm_bytes: float = 0.0
  bytes_in: float = 0.0
  bytes_out: float = 0.0

  def __post_init__(self):
    if not self.recompute_mode:
      object.__setattr__(self, "recompute_mode", "full" if self.recompute else "none")
    if self.recompute_mode not in RECOMPUTE_MODES or self.recompute != (
        self.recompute_mode != "none"):
      raise PlacementError(
          f"Stage.recompute_mode must be one of {RECOMPUTE_MODES} and agree with "
          f"recompute={self.recompute!r}, got {self.recompute_mode!r}.")
    if self.sync_total < 0:
      object.__setattr__(self, "sync_total", self.sync)
    if self.zero_total < 0:
      object.__setattr__(self, "zero_total", self.zero)


@dataclasses.dataclass(frozen=True)
class Placement:
  """A cluster plan over a layer graph, with its predicted time per batch.

  Attributes:
    data_parallel: pipeline replicas.
    microbatches: per pipeline replica (the batch has data_parallel x this).
    zero: the ZeRO stage, 0-3.
    stages: the pipeline stages, in order.
    devices: devices the plan uses (<= the cluster's).
    time: seconds per batch.
    virtual_stages: chunks per stage (1: one, as in plain 1F1B).
    schedule: a registered schedule's name (None: "1f1b", or "interleaved"
      where virtual_stages > 1).
    shard_group: hybrid sharding: ZeRO within groups of this many replicas
      (None: over all of them).
    recompute_every: the stages' recompute modes apply to every k-th layer.
    context: of each stage's devices, how many split the sequence.
    offload: "optimizer": its state in host memory between steps; "none".
    offload_activations: the `checkpoint_name`s of the activations a stage
      in the "offload" recompute mode sends to host memory.

  Raises:
    PlacementError: virtual_stages not a positive int, or a schedule that
      is not registered or does not run that many chunks per stage.
  """

  data_parallel: int
  microbatches: int
  zero: int
  stages: tuple[Stage, ...]
  devices: int
  time: float
  virtual_stages: int = 1
  schedule: str | None = None
  shard_group: int | None = None
  recompute_every: int = 1
  context: int = 1
  offload: str = "none"
  offload_activations: tuple[str, ...] = ()

  def __post_init__(self):
    if isinstance(self.virtual_stages, bool) or not isinstance(self.virtual_stages, int) or (
        self.virtual_stages < 1):
      raise PlacementError(
          f"Placement.virtual_stages must be a positive int, got {self.virtual_stages!r}.")
    if self.schedule is None:
      object.__setattr__(self, "schedule", schedules.default(self.virtual_stages))
    if self.schedule not in schedules.names() or (
        schedules.get(self.schedule).chunked != (self.virtual_stages > 1)):
      raise PlacementError(
          f"Placement.schedule={self.schedule!r} with virtual_stages={self.virtual_stages}: "
          f"expected {schedules.spelt(schedules.names(chunked=True))} with several chunks per "
          f"stage, else {schedules.spelt(schedules.names(chunked=False))}.")

  @property
  def bubble(self) -> float:
    """Seconds per batch the slowest stage idles: (S - 1) / v of its time
    per microbatch."""
    return (len(self.stages) - 1) / self.virtual_stages * max(s.time for s in self.stages)

  @property
  def breakdown(self) -> dict[str, float]:
    """Seconds per batch: the bottleneck stage's parts over the batch, bubble,
    the exposed data-parallel sync (they sum to `time`)."""
    slow = max(self.stages, key=lambda s: s.time)
    m = self.microbatches
    return {"compute": m * (slow.compute - slow.collectives),
            "tensor_parallel": m * slow.collectives,
            "transfers": m * slow.transfers,
            "zero": m * slow.zero,
            "bubble": self.bubble,
            "data_parallel_sync": max(s.sync for s in self.stages)}

  @property
  def communication(self) -> dict[str, float]:
    """Seconds per batch of the slowest stage's collectives that overlap
    could hide, exposed and in all: ZeRO gathers / reduce-scatters and the
    data-parallel sync."""
    slow = max(self.stages, key=lambda s: s.time)
    synced = max(self.stages, key=lambda s: s.sync)
    m = self.microbatches
    return {"zero_exposed": m * slow.zero, "zero_total": m * slow.zero_total,
            "sync_exposed": synced.sync, "sync_total": max(s.sync_total for s in self.stages)}

  @property
  def flops(self) -> float:
    """Model FLOPs per batch over every device the plan uses."""
    return self.data_parallel * self.microbatches * sum(s.flops * s.width for s in self.stages)

  def mfu(self, peak_flops: float) -> float:
    """Model FLOPs utilisation: model FLOPs per second per device over
    `peak_flops` (the device's peak, FLOP/s)."""
    return self.flops / (self.time * self.devices * peak_flops)

  def to_json(self) -> dict:
    return {"data_parallel": self.data_parallel, "microbatches": self.microbatches,
            "zero": self.zero, "devices": self.devices, "time": self.time,
            "virtual_stages": self.virtual_stages, "schedule": self.schedule,
            "shard_group": self.shard_group, "recompute_every": self.recompute_every,
            "context": self.context, "offload": self.offload,
            "offload_activations": list(self.offload_activations),
            "stages": [dataclasses.asdict(s) | {"layers": list(s.layers)} for s in self.stages]}

  @classmethod
  def from_json(cls, data: Mapping) -> Placement:
    stages = tuple(Stage(**(dict(s) | {"layers": tuple(s["layers"])})) for s in data["stages"])
    return cls(int(data["data_parallel"]), int(data["microbatches"]), int(data["zero"]),
               stages, int(data["devices"]), float(data["time"]),
               int(data.get("virtual_stages", 1)), data.get("schedule"),
               data.get("shard_group"), int(data.get("recompute_every", 1)),
               int(data.get("context", 1)), data.get("offload", "none"),
               tuple(data.get("offload_activations", ())))


__all__ = ["Placement", "Stage"]
