"""Options of `automap.cluster.search_accelerator`: the architecture grid and
the placement search run at each of its points."""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
from collections.abc import Mapping

from automap._src.cluster.accelerator.chip import Accelerator
from automap._src.cluster.errors import PlacementError
from automap._src.cluster.placement.options import (
  ZERO_STAGES,
  check_budget,
  check_optimizer,
  check_seed,
  check_zero,
  positive_ints,
)
from automap._src.search.request import Budget


@dataclasses.dataclass(frozen=True)
class CoSearchOptions:
  """How `automap.cluster.search_accelerator` may search architectures and placements.

  Attributes:
    baseline: the architecture scores are relative to (None: TPU_V4_LIKE);
      its area is the default area budget.
    space: Accelerator field -> candidate values (None: cosearch.SPACE); other
      fields as `baseline`.
    widths: tensor-parallel widths to profile and place.
    microbatches: microbatch sizes to profile and place (each must divide
      every workload's global_batch).
    optimizer: as in PlacementOptions.
    zero: as in PlacementOptions.
    schedule_seconds: CP-SAT time limit per distinct layer pass.
    bucket: width of the area buckets, as a share of the area budget; the
      search stops at the first bucket (below the largest) that improves nothing.
    gap: stop once no bound beats the best list-scheduled score by more than
      this share (0: every point that might win is list-scheduled).
    finalists: how many of the best list-scheduled points CP-SAT schedules.
    budget: the sharding search's budget per width (None: 20 episodes, 30 s).
    progress: show a progress bar (None: only when stderr is a terminal).
    seed: the sharding search's seed.
  """

  baseline: Accelerator | None = None
  space: Mapping[str, tuple] | None = None
  widths: tuple[int, ...] = (1, 2, 4, 8)
  microbatches: tuple[int, ...] = (1, 2, 4, 8)
  optimizer: str | float = "adam"
  zero: tuple[int, ...] = ZERO_STAGES
  schedule_seconds: float = 2.0
  bucket: float = 0.1
  gap: float = 0.01
  finalists: int = 3
  budget: Budget | None = None
  progress: bool | None = None
  seed: int = 0

  def __post_init__(self):
    owner = type(self).__name__
    if self.baseline is not None and not isinstance(self.baseline, Accelerator):
      raise TypeError(
          f"{owner}.baseline must be an automap.cluster.Accelerator or None (TPU_V4_LIKE), got "
          f"{type(self.baseline).__name__}.")
    # An empty space has always meant the default grid.
    object.__setattr__(self, "space", _space(owner, self.space) if self.space else None)
    for name in ("widths", "microbatches"):
      object.__setattr__(self, name,
                         positive_ints(owner, name, getattr(self, name), numbers.Integral))
    check_optimizer(owner, self.optimizer)
    object.__setattr__(self, "zero", check_zero(owner, self.zero))
    for name, least, strict in (("schedule_seconds", 0.0, False), ("bucket", 0.0, True),
                                ("gap", 0.0, False)):
      value = getattr(self, name)
      if (isinstance(value, bool) or not isinstance(value, numbers.Real)
          or not math.isfinite(value) or value < least or (strict and value == least)):
        raise PlacementError(
            f"{owner}.{name} must be a finite number {'>' if strict else '>='} {least:g}, "
            f"got {value!r}; the default is "
            f"{getattr(CoSearchOptions, name)!r}.")
    if (isinstance(self.finalists, bool) or not isinstance(self.finalists, int)
        or self.finalists < 0):
      raise PlacementError(
          f"{owner}.finalists must be an int >= 0 (points CP-SAT schedules), got "
          f"{self.finalists!r}; the default is 3.")
    if self.progress not in (None, True, False):
      raise PlacementError(
          f"{owner}.progress must be True, False or None (when stderr is a terminal), "
          f"got {self.progress!r}.")
    check_budget(owner, self.budget)
    check_seed(owner, self.seed)


def _space(owner: str, space) -> Mapping[str, tuple]:
  """The grid as a read-only mapping of field -> tuple of values."""
  fields = [f.name for f in dataclasses.fields(Accelerator)]
  if not isinstance(space, Mapping):
    raise PlacementError(
        f"{owner}.space must map Accelerator fields to candidate values, got "
        f"{type(space).__name__}; e.g. {{'tensor_units': (4, 8), 'array': (64, 128)}}.")
  out = {}
  for name, values in space.items():
    if name not in fields:
      raise PlacementError(
          f"{owner}.space: {name!r} is not an Accelerator field; the fields are {fields}.")
    try:
      values = () if isinstance(values, str) else tuple(values)
    except TypeError:
      values = ()
    if not values:
      raise PlacementError(
          f"{owner}.space[{name!r}] must be a non-empty sequence of candidate values, got "
          f"{space[name]!r}.")
    out[name] = values
  return types.MappingProxyType(out)


__all__ = ["CoSearchOptions"]
