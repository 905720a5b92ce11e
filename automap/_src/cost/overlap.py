"""Communication a step leaves exposed when XLA runs collectives asynchronously.

On TPU and GPU, XLA makes collectives asynchronous (start / done pairs) and
its latency-hiding scheduler moves compute that does not depend on one
between its start and its done; XLA:CPU runs each in place
(`Compiler.async_collectives`). The model is a list schedule on two
streams, compute and communication:

- the collectives that reshard an op's operand start once that operand is
  ready (and the communication stream is free), and the op waits for them;
- the collectives that finish an op's result (partial sums reduced, the
  result resharded to its stored layout) start when the op ends, and the
  result's readers wait for them;
- an op computes once the compute stream is free and its operands are ready;
  of the ops ready to run, the one whose operands arrived first goes next
  (the scheduler's freedom to run independent compute in a collective's
  shadow).

The step's makespan less its compute is the exposed communication: a
tensor-parallel all-reduce whose result the next op reads stays exposed in
full, a data-parallel gradient reduction hides behind the backward of the
layers before it. Units: seconds per device.
"""

from __future__ import annotations

import heapq

import numpy as np


def op_seconds_split(model, state) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Per op, (compute, communication before it, after it) seconds as the
  Tracker counts them: a resharded copy paid by its first reader, combined
  reductions' latency once (on the last op of the combination)."""
  g = model.graph
  compute = np.zeros(g.num_ops)
  before, after = np.zeros(g.num_ops), np.zeros(g.num_ops)
  copies: set[tuple] = set()
  combined: dict[tuple[int, int], int] = {}  # (kind, mask) -> last op combined
  for o in range(g.num_ops):
    c = model.op_cost(state, o)
    compute[o] = c.time
    for kind, mask, nbytes, secs, position, target, relaid in c.comms:
      if position >= 0:  # one resharded copy serves every reader: the first pays
        key = model.copy_key(o, position, kind, mask, target, nbytes)
        if key in copies:
          continue
        copies.add(key)
        before[o] += secs
        compute[o] += model.relayout_time(relaid) * int(g.trips[o])
        continue
      if model.combined(o, kind):
        secs -= model.latency[kind, mask]
        combined[(kind, mask)] = o
      after[o] += secs
  for (kind, mask), o in combined.items():
    after[o] += model.latency[kind, mask]
  return compute, before, after


def makespan(operands, results, compute: np.ndarray, before: np.ndarray,
             after: np.ndarray, num_values: int) -> float:
  """Seconds the two-stream list schedule of the module docstring takes.

  The compute stream runs, of the ops whose producers have all run, the one
  whose operands arrived first (program order on ties), so compute that
  does not need a collective's result runs while the collective is in
  flight.
  operands, results: per op, the value ids it reads and makes (-1: none).
  compute, before, after: per op, seconds (`op_seconds_split`).
  """
  n = len(compute)
  producer = np.full(num_values, -1)
  for o in range(n):
    for v in results[o]:
      if v >= 0:
        producer[v] = o
  succs: list[list[int]] = [[] for _ in range(n)]
  waiting = np.zeros(n, np.int64)
  for o in range(n):
    for p in {int(producer[v]) for v in operands[o] if v >= 0 and producer[v] >= 0}:
      if p != o:
        succs[p].append(o)
        waiting[o] += 1
  ready = np.zeros(num_values)
  arrived = lambda o: max((ready[v] for v in operands[o] if v >= 0), default=0.0)  # noqa: E731
  heap = [(0.0, o) for o in range(n) if not waiting[o]]
  heapq.heapify(heap)
  compute_free = comm_free = end = 0.0
  while heap:
    at, o = heapq.heappop(heap)
    if before[o] > 0:
      comm_free = max(comm_free, at) + before[o]
      at = comm_free
    done = max(compute_free, at) + compute[o]
    compute_free = done
    if after[o] > 0:
      comm_free = max(comm_free, done) + after[o]
      done = comm_free
    for v in results[o]:
      if v >= 0:
        ready[v] = done
    end = max(end, done)
    for s in succs[o]:
      waiting[s] -= 1
      if not waiting[s]:
        heapq.heappush(heap, (arrived(s), s))
  return max(end, compute_free, comm_free)


def exposed_communication(model, state) -> float:
  """Seconds of the step's communication that compute does not hide when
  collectives run asynchronously: the schedule's makespan less compute
  (never more than all of it, never less than none)."""
  compute, before, after = op_seconds_split(model, state)
  total = float(before.sum() + after.sum())
  if total == 0:
    return 0.0
  g = model.graph
  span = makespan(g.operands, g.results, compute, before, after, g.num_values)
  return float(min(total, max(0.0, span - compute.sum())))


__all__ = ["exposed_communication", "makespan", "op_seconds_split"]
