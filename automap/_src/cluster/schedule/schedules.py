"""Pipeline schedules as objects, and the registry the cluster planner reads them from.

A `Schedule` is one pipeline order: per stage, which chunk's forward or
backward of which microbatch it runs next (`Schedule.order`), how many
microbatches' activations a stage holds at its peak (`Schedule.in_flight`),
whether it runs several chunks per stage, and what it needs of the counts
(`Schedule.check`). Every part of the planner reads a schedule by its name
from here: the timetable list-schedules its orders into slots
(`timetable.py`), the cluster model prices what it holds
(`placement.dp.uniform`), `ClusterConfig` and `Placement` check against it,
the executor runs its timetable, and `ClusterPlan.explain` shows its title.

Shape letters: S stages, M microbatches per pipeline replica, v chunks per
stage; model chunk c = k * S + s runs on stage s as its k-th chunk. The three
built in:
- "gpipe": every forward, then every backward.
- "1f1b" (PipeDream-Flush): stage s runs min(S - s - 1, M) forwards, then
  alternates one forward and one backward, then the remaining backwards.
- "interleaved" (Narayanan et al. 2021, Megatron-LM's order): forwards go
  through S microbatches of chunk 0, then the same S of chunk 1, ..., before
  the next S microbatches; backwards likewise from the last chunk; stage s
  warms up with (S - s - 1) * 2 + (v - 1) * S forwards (all of them when
  M == S).

Adding a schedule is one `register(Schedule(...))`; from then on
`ClusterConfig(schedule=name)` prices it and `ClusterPlan.train_step(...,
schedule=name)` runs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

from automap._src.cluster.errors import PlacementError

# One piece of a stage's work: (phase "forward" or "backward", model chunk, microbatch).
Step = tuple[str, int, int]
# (stage, S, M, v) -> the stage's work in the order it runs it.
Order = Callable[[int, int, int, int], list[Step]]
# (stage, S, M, v) -> microbatches held at the peak, in stage shares.
Held = Callable[[int, int, int, int], float]
# (S, M, v) -> what the schedule needs that these counts lack (a phrase
# following "needs"), or None.
Needs = Callable[[int, int, int], "str | None"]

# The schedules a placement takes when none is named: with one chunk per
# stage, and with several.
DEFAULT = "1f1b"
DEFAULT_CHUNKED = "interleaved"


@dataclasses.dataclass(frozen=True)
class Schedule:
  """One pipeline schedule: its name, its order per stage, what it holds.

  Attributes:
    name: the name every part of the planner takes ("gpipe").
    title: how a plan's explanation shows it ("GPipe").
    order: `order(stage, S, M, v)`: the stage's work in the order it runs
      it, as (phase, chunk, microbatch) with phase "forward" or "backward"
      and chunk the model chunk k * S + stage of the stage's k-th chunk.
      Every forward and backward of every microbatch of the stage's chunks
      appears once; a forward runs after the previous chunk's forward of its
      microbatch, a backward after its forward and the next chunk's backward.
    chunked: whether it runs several chunks per stage (v >= 2 on 2 or more
      stages); one that is not runs exactly one.
    held: `held(stage, S, M, v)`: microbatches whose activations the stage
      holds at its peak, in stage shares (a chunk is 1 / v of the stage), in
      closed form. None: counted from `order` (the most forwards run whose
      backward has not, as `Timetable.in_flight` counts them).
    needs: `needs(S, M, v)`: what the schedule needs of the counts beyond
      one chunk per stage where it is not chunked, as a phrase following
      "needs" ("microbatches (6) to be a multiple of stages (4)"), or None
      when they have it. None: nothing more.
  """

  name: str
  title: str
  order: Order
  chunked: bool = False
  held: Held | None = None
  needs: Needs | None = None

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise PlacementError(f"Schedule.name must be a non-empty str, got {self.name!r}.")
    for field in ("order", "held", "needs"):
      value = getattr(self, field)
      if not callable(value) and not (value is None and field != "order"):
        raise PlacementError(f"Schedule.{field} must be a function, got {value!r}.")

  def orders(self, stages: int, microbatches: int, virtual: int = 1) -> list[list[Step]]:
    """Per stage, its (phase, chunk, microbatch) in the order it runs them.

    Args:
      stages: S, pipeline stages.
      microbatches: M, microbatches per pipeline replica.
      virtual: v, chunks per stage.

    Returns:
      S lists, stage s's `order(s, S, M, v)`.

    Raises:
      PlacementError: where the counts do not suit the schedule (`check`).
    """
    self.check(stages, microbatches, virtual)
    return [list(self.order(s, stages, microbatches, virtual)) for s in range(stages)]

  def in_flight(self, stage: int, stages: int, microbatches: int, virtual: int = 1) -> float:
    """Microbatches whose activations stage `stage` holds at its peak.

    Args:
      stage: the stage, 0-based.
      stages: S.
      microbatches: M per pipeline replica.
      virtual: v, chunks per stage.

    Returns:
      The peak in stage shares (a chunk-microbatch is 1 / v): `held`'s
      closed form, or counted from the stage's order.
    """
    if self.held is not None:
      return self.held(stage, stages, microbatches, virtual)
    return peak_held((p for p, _, _ in self.order(stage, stages, microbatches, virtual)),
                     virtual)

  def unmet(self, stages: int, microbatches: int, virtual: int = 1) -> str | None:
    """What the schedule needs that the counts lack (after "needs"), or None.

    Args:
      stages: S.
      microbatches: M per pipeline replica.
      virtual: v, chunks per stage.

    Returns:
      `needs`' phrase, or None where the counts suit the schedule.
    """
    return None if self.needs is None else self.needs(stages, microbatches, virtual)

  def check(self, stages: int, microbatches: int, virtual: int = 1) -> None:
    """Refuses counts the schedule cannot order.

    Args:
      stages: S.
      microbatches: M per pipeline replica.
      virtual: v, chunks per stage.

    Returns:
      None.

    Raises:
      PlacementError: a count that is not a positive int, several chunks per
        stage on a schedule that runs one, or what `needs` says is missing.
    """
    for name, value in (("stages", stages), ("microbatches", microbatches),
                        ("virtual", virtual)):
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlacementError(f"{name} must be a positive int, got {value!r}.")
    if not self.chunked and virtual != 1:
      raise PlacementError(
          f"schedule {self.name!r} runs one chunk per stage, got virtual={virtual}.")
    missing = self.unmet(stages, microbatches, virtual)
    if missing:
      raise PlacementError(f"the {self.name} schedule needs {missing}.")


def peak_held(phases: Iterable[str], virtual: int) -> float:
  """The most chunk-microbatches held between a forward and its backward by
  a stage running `phases` in order, in stage shares (each 1 / `virtual`)."""
  held = most = 0
  for phase in phases:
    held += 1 if phase == "forward" else -1
    most = max(most, held)
  return most / virtual


_REGISTRY: dict[str, Schedule] = {}


def register(schedule: Schedule) -> Schedule:
  """Adds `schedule` under its name: every part of the planner takes it from then on.

  Args:
    schedule: the `Schedule`; its name must not be registered yet.

  Returns:
    `schedule`, so a module may register as it defines it.

  Raises:
    PlacementError: not a `Schedule`, or its name is taken (`unregister` it first).
  """
  if not isinstance(schedule, Schedule):
    raise PlacementError(
        f"register takes an automap.cluster.Schedule, got {type(schedule).__name__}.")
  if schedule.name in _REGISTRY:
    raise PlacementError(
        f"a schedule named {schedule.name!r} is registered already; unregister it first or "
        "choose another name.")
  _REGISTRY[schedule.name] = schedule
  return schedule


def unregister(name: str) -> None:
  """Removes the schedule registered under `name`.

  Args:
    name: a schedule `register` added.

  Returns:
    None.

  Raises:
    PlacementError: no such schedule, or one of the built-in three, which
      the planner's defaults name.
  """
  if name in BUILT_IN:
    raise PlacementError(f"the built-in schedule {name!r} stays registered.")
  if name not in _REGISTRY:
    raise PlacementError(f"no schedule named {name!r} is registered; registered: {names()}.")
  del _REGISTRY[name]


def get(name: str, field: str = "schedule") -> Schedule:
  """The schedule registered under `name`.

  Args:
    name: its name ("1f1b").
    field: what the caller calls the name, for the error ("ClusterConfig.schedule").

  Returns:
    The `Schedule`.

  Raises:
    PlacementError: no schedule has that name; the message lists those that do.
  """
  if not isinstance(name, str) or name not in _REGISTRY:
    raise PlacementError(f"{field} must be one of {names()}, got {name!r}.")
  return _REGISTRY[name]


def names(chunked: bool | None = None) -> tuple[str, ...]:
  """The registered schedules' names, in the order they were registered.

  Args:
    chunked: None for all; True or False for only those that do or do not
      run several chunks per stage.

  Returns:
    The names, the built-in three first.

  Raises:
    PlacementError: `chunked` neither None nor a bool.
  """
  if chunked is not None and not isinstance(chunked, bool):
    raise PlacementError(f"chunked must be None, True or False, got {chunked!r}.")
  return tuple(n for n, s in _REGISTRY.items() if chunked is None or s.chunked == chunked)


def default(virtual: int) -> str:
  """The schedule a placement with `virtual` chunks per stage runs when none is named."""
  return DEFAULT if virtual == 1 else DEFAULT_CHUNKED


def spelt(choices: Sequence[str]) -> str:
  """Names as a message lists them: "'gpipe' or '1f1b'", "'a', 'b' or 'c'"."""
  quoted = [repr(c) for c in choices]
  return " or ".join(quoted) if len(quoted) < 3 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


# The built-in schedules.


def _gpipe_order(stage: int, stages: int, microbatches: int, virtual: int) -> list[Step]:
  return ([("forward", stage, m) for m in range(microbatches)]
          + [("backward", stage, m) for m in range(microbatches)])


def _every_microbatch(stage: int, stages: int, microbatches: int, virtual: int) -> float:
  """GPipe holds every microbatch: all forwards run before the backwards."""
  return float(microbatches)


def _one_f_one_b_order(stage: int, stages: int, microbatches: int, virtual: int) -> list[Step]:
  """1F1B over v chunks a stage (v = 1: PipeDream-Flush; else Megatron-LM's interleaving)."""
  S, M, v, s = stages, microbatches, virtual, stage
  total = M * v

  def at(k: int, phase: str) -> Step:
    group = k % (S * v)
    local = group // S if phase == "forward" else v - 1 - group // S
    return phase, local * S + s, (k // (S * v)) * S + k % S

  if v == 1:
    warm = min(S - s - 1, M)
  else:
    warm = total if M == S else min((S - s - 1) * 2 + (v - 1) * S, total)
  order = [at(k, "forward") for k in range(warm)]
  f, b = warm, 0
  while f < total:
    order += [at(f, "forward"), at(b, "backward")]
    f, b = f + 1, b + 1
  order += [at(k, "backward") for k in range(b, total)]
  return order


def _one_f_one_b_held(stage: int, stages: int, microbatches: int, virtual: int) -> float:
  """min(S - i, M) plainly; interleaved, Megatron-LM's warm-up of
  (S - i - 1) * 2 + (v - 1) * S chunk-microbatches plus the one in its
  backward, each 1/v of the stage; every forward first where there are as
  many microbatches as stages (Megatron-LM's
  `forward_backward_pipelining_with_interleaving`: all warm-up when
  num_microbatches == pipeline_parallel_size)."""
  if virtual == 1:
    return float(min(stages - stage, microbatches))
  if microbatches == stages:
    return float(microbatches)
  held = (stages - stage - 1) * 2 + (virtual - 1) * stages + 1
  return min(microbatches * virtual, held) / virtual


def _whole_rounds(stages: int, microbatches: int, virtual: int) -> str | None:
  """Megatron-LM's rule: the chunks go round in groups of S microbatches."""
  if microbatches % stages:
    return f"microbatches ({microbatches}) to be a multiple of stages ({stages})"
  return None


GPIPE = register(Schedule("gpipe", "GPipe", _gpipe_order, held=_every_microbatch))
ONE_F_ONE_B = register(Schedule("1f1b", "1F1B", _one_f_one_b_order, held=_one_f_one_b_held))
INTERLEAVED = register(Schedule("interleaved", "interleaved 1F1B", _one_f_one_b_order,
                                chunked=True, held=_one_f_one_b_held, needs=_whole_rounds))
BUILT_IN = names()


__all__ = ["BUILT_IN", "DEFAULT", "DEFAULT_CHUNKED", "GPIPE", "INTERLEAVED", "ONE_F_ONE_B",
           "Schedule", "default", "get", "names", "peak_held", "register", "spelt",
           "unregister"]
