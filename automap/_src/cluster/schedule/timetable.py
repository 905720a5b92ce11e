"""The timetable: a pipeline schedule's orders list-scheduled into slots.

A schedule (`schedules.Schedule`) gives each stage an order, what it runs one
piece of work after another; the list schedule gives every piece of work one
slot, the first after its stage is free and its inputs are made (a chunk's
forward after the previous chunk's forward of that microbatch, its backward
after the next chunk's backward and its own forward). The cluster model
prices exactly these orders: a stage's peak of microbatches in flight
(`Schedule.in_flight`) is the most forwards it has run whose backward it has
not, and the bubble (S - 1) / v of a stage's time per microbatch is the idle
slots of this timetable on equal stages. The executor issues the work in
the timetable's order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from automap._src.cluster.errors import PlacementError
from automap._src.cluster.schedule import schedules


@dataclasses.dataclass(frozen=True, order=True)
class Work:
  """One piece of a stage's work: `phase` ("forward" or "backward") of model
  chunk `chunk` (0 .. S * v - 1) on `microbatch`, in timetable slot `slot`."""

  slot: int
  stage: int
  chunk: int
  microbatch: int
  phase: str

  @property
  def label(self) -> str:
    """"F3" / "B3" (microbatch 3), with the chunk where a stage has several: "F3.1"."""
    return f"{self.phase[0].upper()}{self.microbatch}"


@dataclasses.dataclass(frozen=True)
class Timetable:
  """A pipeline schedule list-scheduled: per stage its work in order, each with its slot.

  `timetable` makes one; the executor issues its work `in_order`, the
  cluster model prices what it holds (`in_flight`) and its bubble (`idle`).

  Attributes:
    schedule: the registered schedule's name.
    stages: S, pipeline stages.
    microbatches: M, microbatches per pipeline replica.
    virtual: v, chunks per stage.
    work: per stage, its `Work` in the order it runs it.
  """

  schedule: str
  stages: int
  microbatches: int
  virtual: int
  work: tuple[tuple[Work, ...], ...]  # per stage, in the order it runs

  @property
  def slots(self) -> int:
    """Slots from the first piece of work to the last."""
    return 1 + max(w.slot for stage in self.work for w in stage)

  def in_order(self) -> list[Work]:
    """Every piece of work by slot, then stage: an order to issue them in
    that respects every dependency."""
    return sorted(w for stage in self.work for w in stage)

  def in_flight(self, stage: int) -> float:
    """The most chunk-microbatches stage `stage` holds between a forward and
    its backward, in stage shares (a chunk is 1 / v of the stage)."""
    return schedules.peak_held((w.phase for w in self.work[stage]), self.virtual)

  def idle(self, stage: int) -> int:
    """Slots stage `stage` waits between its first and last piece of work,
    plus before its first: its share of the bubble, in slots."""
    return self.slots - len(self.work[stage])

  def render(self) -> str:
    """One line per stage, one column per slot: "F3" a forward of microbatch 3,
    "B3" its backward, "." idle; interleaved chunks carry ".k" (the stage's
    k-th chunk)."""
    width = 3 + (2 if self.virtual > 1 else 0)
    lines = []
    for s, stage in enumerate(self.work):
      cells = ["."] * self.slots
      for w in stage:
        k = w.chunk // self.stages
        cells[w.slot] = w.label + (f".{k}" if self.virtual > 1 else "")
      lines.append(f"stage {s}: " + " ".join(c.ljust(width) for c in cells).rstrip())
    return "\n".join(lines)


def orders(schedule: str, stages: int, microbatches: int,
           virtual: int = 1) -> list[list[tuple[str, int, int]]]:
  """Per stage, its (phase, chunk, microbatch) in the order it runs them:
  the registered schedule's (`Schedule.orders`)."""
  return schedules.get(schedule).orders(stages, microbatches, virtual)


def timetable(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> Timetable:
  """A registered schedule's orders list-scheduled into slots.

  Every piece of work takes one slot, the first after its stage is free and
  its inputs are made (see the module doc): on equal stages the slots are
  the schedule's time, and the idle ones its bubble.

  Args:
    schedule: a registered schedule's name ("gpipe", "1f1b",
      "interleaved", or one added with `register_schedule`).
    stages: S, pipeline stages.
    microbatches: M, microbatches per pipeline replica.
    virtual: v, chunks per stage (model chunk k * S + s on stage s).

  Returns:
    The `Timetable`; `render()` draws it.

  Raises:
    PlacementError: an unregistered schedule, counts that are not positive
      ints or do not suit the schedule, or an order that deadlocks (a
      piece of work waiting on one its stage runs later).
  """
  per_stage = orders(schedule, stages, microbatches, virtual)
  chunks = stages * virtual
  done: dict[tuple[str, int, int], int] = {}  # (phase, chunk, microbatch) -> slot it ran in
  free = [0] * stages
  nxt = [0] * stages
  placed: list[list[Work]] = [[] for _ in range(stages)]
  remaining = sum(len(o) for o in per_stage)
  while remaining:
    progressed = False
    for s in range(stages):
      if nxt[s] == len(per_stage[s]):
        continue
      phase, c, m = per_stage[s][nxt[s]]
      needs = _needs(phase, c, m, chunks)
      if any(n not in done for n in needs):
        continue
      slot = max([free[s]] + [done[n] + 1 for n in needs])
      done[(phase, c, m)] = slot
      placed[s].append(Work(slot, s, c, m, phase))
      free[s], nxt[s] = slot + 1, nxt[s] + 1
      remaining -= 1
      progressed = True
    if not progressed:
      raise PlacementError(f"schedule {schedule!r} deadlocks with {stages} stages, "
                           f"{microbatches} microbatches, {virtual} chunks per stage.")
  return Timetable(schedule, stages, microbatches, virtual, tuple(map(tuple, placed)))


def _needs(phase: str, chunk: int, microbatch: int, chunks: int) -> Sequence[tuple]:
  if phase == "forward":
    return [("forward", chunk - 1, microbatch)] if chunk else []
  needs = [("forward", chunk, microbatch)]
  if chunk < chunks - 1:
    needs.append(("backward", chunk + 1, microbatch))
  return needs


__all__ = ["Timetable", "Work", "orders", "timetable"]
