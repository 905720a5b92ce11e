"""Options objects of the cluster planners: `place` and `plan_cluster`.

Each planner takes its few essential arguments (the model, the devices, the
hardware) directly and its tuning knobs in one frozen dataclass that
validates itself, so a bad value fails before any tracing or search, with a
message naming the field. The planners still take every field as a keyword,
as they did before the options objects existed (`with_keywords`).
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping, Sequence

import numpy as np

from automap._src.cluster.errors import PlacementError
from automap._src.cluster.profile.layer_graph import RECOMPUTE_MODES
from automap._src.search.request import DEVICE, Budget, bytes_per_device

# Optimizer state per parameter byte, in the parameters' dtype.
OPTIMIZERS: Mapping[str, float] = types.MappingProxyType(
    {"sgd": 0.0, "momentum": 1.0, "adam": 2.0, "adamw": 2.0})
ZERO_STAGES = (0, 1, 2, 3)


def _memory_limit(owner: str, value) -> None:
  if value is not None and value != DEVICE and (
      isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
    raise PlacementError(
        f"{owner}.memory_limit must be a positive number of bytes per device, got {value!r}; "
        "or 'device' for the hardware's hbm_capacity, None for no limit.")


def check_optimizer(owner: str, value) -> None:
  if isinstance(value, str):
    if value.lower() not in OPTIMIZERS:
      raise PlacementError(
          f"{owner}.optimizer must be one of {sorted(OPTIMIZERS)} or bytes of state per "
          f"parameter byte, got {value!r}; for another optimizer give its factor (Adam: 2.0).")
  elif isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
    raise PlacementError(
        f"{owner}.optimizer state factor must be a number >= 0 (bytes of optimizer state "
        f"per parameter byte) or a name in {sorted(OPTIMIZERS)}, got {value!r}.")


def check_zero(owner: str, value) -> tuple:
  """The ZeRO stages as a tuple (an int is one stage)."""
  try:
    stages = (value,) if isinstance(value, int) else tuple(value)
  except TypeError:
    stages = ()
  if not stages or any(isinstance(z, bool) or z not in ZERO_STAGES for z in stages):
    raise PlacementError(
        f"{owner}.zero must be a stage in 0..3 or a sequence of them, got {value!r}; e.g. "
        "zero=1 (optimizer state sharded) or zero=(0, 1, 2, 3) to let the planner choose.")
  return stages


def recompute_modes(owner: str, value) -> tuple[str, ...]:
  """The recompute modes `value` allows: True is "full", False "none", None
  every mode (chosen per stage), a mode name or a sequence of them as given."""
  if value is None:
    return RECOMPUTE_MODES
  if isinstance(value, bool):
    return ("full",) if value else ("none",)
  modes = (value,) if isinstance(value, str) else value
  try:
    modes = tuple(modes)
  except TypeError:
    modes = ()
  if not modes or any(m not in RECOMPUTE_MODES for m in modes):
    raise PlacementError(
        f"{owner}.recompute must be True (always), False (never) or None (chosen per "
        f"stage), or a mode in {RECOMPUTE_MODES} or a sequence of them, got {value!r}; "
        "e.g. recompute='selective' (attention scores and softmax only).")
  return tuple(dict.fromkeys(modes))


def memory_limit(options, hw) -> float:
  """Bytes per device a planner holds plans to: the options' memory_limit as
  `SearchOptions` reads it (`bytes_per_device`), unbounded (inf) for None."""
  limit = bytes_per_device(options.memory_limit, hw)
  return math.inf if limit is None else limit


def _flag(owner: str, name: str, value) -> None:
  if not isinstance(value, bool):
    raise PlacementError(f"{owner}.{name} must be True or False, got {value!r}.")


def _virtual_stages(owner: str, value) -> None:
  if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
    raise PlacementError(
        f"{owner}.virtual_stages must be a positive int (chunks per pipeline stage under "
        f"the interleaved 1F1B schedule; 1: plain 1F1B) or None (searched where legal), got "
        f"{value!r}.")


def positive_ints(owner: str, name: str, value, integral: type = int) -> tuple[int, ...]:
  """`value` as a non-empty tuple of ints >= 1 (instances of `integral`, not bools)."""
  try:
    items = tuple(value)
  except TypeError:
    items = ()
  if not items or any(isinstance(t, bool) or not isinstance(t, integral) or t < 1
                      for t in items):
    raise PlacementError(
        f"{owner}.{name} must be positive ints, got {value!r}; e.g. {name}=(1, 2, 4).")
  return tuple(int(t) for t in items) if integral is not int else items


def _optional_count(owner: str, name: str, value) -> None:
  if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
    raise PlacementError(
        f"{owner}.{name} must be None (searched) or a positive int, got {value!r}.")


def check_budget(owner: str, value) -> None:
  # TypeError, as the sharding search itself raises for a bad budget.
  if value is not None and not isinstance(value, Budget):
    raise TypeError(
        f"{owner}.budget must be an automap.Budget (the sharding search's per width), got "
        f"{value!r}; e.g. automap.Budget(episodes=20, seconds=30).")


def check_seed(owner: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
    raise TypeError(f"{owner}.seed must be a non-negative integer, got {value!r}.")


def _check_placement_fields(options) -> None:
  """Checks the fields PlacementOptions and ClusterOptions share; stores
  `zero` as a tuple."""
  owner = type(options).__name__
  _memory_limit(owner, options.memory_limit)
  check_optimizer(owner, options.optimizer)
  object.__setattr__(options, "zero", check_zero(owner, options.zero))
  recompute_modes(owner, options.recompute)
  _flag(owner, "mixed_precision", options.mixed_precision)
  _flag(owner, "overlap", options.overlap)
  _flag(owner, "overlap_tensor", options.overlap_tensor)
  _virtual_stages(owner, options.virtual_stages)


@dataclasses.dataclass(frozen=True)
class PlacementOptions:
  """How `automap.cluster.place` may place a layer graph.

  Attributes:
    memory_limit: bytes per device; "device" (the default): the hardware's
      `hbm_capacity`; None: no limit (as for `automap.SearchOptions`).
    optimizer: a name in OPTIMIZERS or bytes of optimizer state per parameter byte.
    zero: ZeRO stage(s) to consider (an int is one): 1 shards optimizer state
      over data parallelism, 2 also gradients (reduce-scattered every
      microbatch), 3 also parameters (gathered for every use).
    recompute: "full" (True: every layer's input kept, the layer rebuilt in
      its backward), "selective" (only the attention scores and softmax
      rebuilt), "dots" (every layer's input and weight-matmul outputs kept,
      the rest rebuilt; layers traced from a program only), "none" (False:
      everything stashed), a sequence of them, or None: every mode the
      layers price, chosen per stage.
    widths: tensor-parallel widths allowed (None: every width the layers price).
    data_parallel: fix the data-parallel degree (to price a hand-written split
      such as Megatron's p x d x t); None searches.
    stages: fix the stage count likewise; None searches.
    mixed_precision: parameters are 16-bit and training keeps float32 master
      weights, float32 gradient accumulators and float32 optimizer state (the
      `optimizer` factor counts moments in the parameters' dtype and doubles).
    overlap: the data-parallel sync and ZeRO collectives run beside compute
      (XLA's latency-hiding scheduler, Megatron's overlapped gradient
      reduction); False: after it.
    virtual_stages: chunks per stage under the interleaved 1F1B schedule (1:
      plain 1F1B); None also tries interleaving where it is legal (a chain of
      equal blocks that splits evenly).
    overlap_tensor: tensor-parallel collectives run beside the matmuls they
      feed or follow (Megatron-LM's --tp-comm-overlap, collective matmuls);
      False: on the critical path, as XLA's partitioner emits them.
    hybrid: where the replicas span several slices or nodes
      (`Hardware.devices_per_node`), also try ZeRO within each slice's
      replicas and plain data parallelism across slices (HSDP), and keep
      it where the cluster model prices it faster. `ClusterPlan.train_step`
      runs such a plan (ZeRO over a group's replicas, each gradient shard
      all-reduced across the groups); False: ZeRO over every replica.
  """

  memory_limit: float | str | None = DEVICE
  optimizer: str | float = "adam"
  zero: tuple[int, ...] = ZERO_STAGES
  recompute: bool | str | tuple[str, ...] | None = None
  widths: tuple[int, ...] | None = None
  data_parallel: int | None = None
  stages: int | None = None
  mixed_precision: bool = False
  overlap: bool = True
  virtual_stages: int | None = 1
  overlap_tensor: bool = False
  hybrid: bool = True

  def __post_init__(self):
    owner = type(self).__name__
    _check_placement_fields(self)
    if self.widths is not None:
      object.__setattr__(self, "widths", positive_ints(owner, "widths", self.widths))
    _optional_count(owner, "data_parallel", self.data_parallel)
    _optional_count(owner, "stages", self.stages)
    _flag(owner, "hybrid", self.hybrid)

  @property
  def optimizer_state(self) -> float:
    """Bytes of optimizer state per parameter byte (float32 master weights
    included under mixed precision)."""
    factor = (float(OPTIMIZERS[self.optimizer.lower()]) if isinstance(self.optimizer, str)
              else float(self.optimizer))
    return 2 * factor + 2 if self.mixed_precision else factor

  @property
  def gradient_state(self) -> float:
    """Bytes of gradient per parameter byte (float32 accumulators under mixed
    precision)."""
    return 2.0 if self.mixed_precision else 1.0


@dataclasses.dataclass(frozen=True)
class ClusterOptions:
  """How `automap.cluster.plan_cluster` may plan a training step.

  Attributes:
    memory_limit: bytes per device, as in PlacementOptions.
    optimizer: as in PlacementOptions.
    zero: ZeRO stages to consider, as in PlacementOptions.
    recompute: recompute modes to consider, as in PlacementOptions.
    widths: tensor-parallel widths to consider (None: powers of two up to a
      node, at most 8).
    microbatches: microbatch sizes to consider (None: the powers of two that
      divide global_batch and leave at most 512 microbatches); the step is
      traced and priced at each.
    budget: the sharding search's budget for each width (None: Budget()).
    seed: the sharding search's seed.
    fused_attention: attention runs as one fused kernel (flash attention:
      cuDNN, Pallas or Triton), so its scores never reach device memory;
      False prices the ops as traced.
    mixed_precision: as in PlacementOptions.
    overlap: as in PlacementOptions.
    overlap_tensor: as in PlacementOptions.
    virtual_stages: as in PlacementOptions, but None here: the interleaved
      schedule is tried where legal.
    hybrid: as in PlacementOptions.
  """

  memory_limit: float | str | None = DEVICE
  optimizer: str | float = "adam"
  zero: tuple[int, ...] = ZERO_STAGES
  recompute: bool | str | tuple[str, ...] | None = None
  widths: tuple[int, ...] | None = None
  microbatches: tuple[int, ...] | None = None
  budget: Budget | None = None
  seed: int = 0
  mixed_precision: bool = False
  overlap: bool = True
  virtual_stages: int | None = None
  fused_attention: bool = False
  overlap_tensor: bool = False
  hybrid: bool = True

  def __post_init__(self):
    owner = type(self).__name__
    _check_placement_fields(self)
    _flag(owner, "fused_attention", self.fused_attention)
    _flag(owner, "hybrid", self.hybrid)
    for name in ("widths", "microbatches"):
      if getattr(self, name) is not None:
        object.__setattr__(self, name, positive_ints(owner, name, getattr(self, name)))
    check_budget(owner, self.budget)
    check_seed(owner, self.seed)

  def placement(self, widths: Sequence[int]) -> PlacementOptions:
    """The placement's options, over the `widths` the step was profiled at."""
    return PlacementOptions(memory_limit=self.memory_limit, optimizer=self.optimizer,
                            zero=self.zero, recompute=self.recompute, widths=tuple(widths),
                            mixed_precision=self.mixed_precision, overlap=self.overlap,
                            virtual_stages=self.virtual_stages,
                            overlap_tensor=self.overlap_tensor, hybrid=self.hybrid)


__all__ = ["OPTIMIZERS", "ZERO_STAGES", "ClusterOptions", "PlacementOptions", "check_budget",
           "check_optimizer", "check_seed", "check_zero", "positive_ints",
           "memory_limit", "recompute_modes"]
