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

import numpy as np

from automap._src.cost import kernels
from automap._src.cost.analysis import Dependencies, dependencies


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


def schedule(deps: Dependencies, compute: np.ndarray, before: np.ndarray,
             after: np.ndarray, num_values: int) -> float:
  """Seconds the two-stream list schedule of the module docstring takes
  over the ops of `deps` (`analysis.dependencies`).

  The compute stream runs, of the ops whose producers have all run, the one
  whose operands arrived first (program order on ties), so compute that
  does not need a collective's result runs while the collective is in
  flight (`kernels.list_schedule`).
  compute, before, after: [O] seconds per op (`op_seconds_split`).
  """
  return float(kernels.list_schedule(deps.operands, deps.results, deps.succ_ptr,
                                     deps.succ_idx, deps.preds, compute, before, after,
                                     num_values))


def makespan(operands, results, compute: np.ndarray, before: np.ndarray,
             after: np.ndarray, num_values: int) -> float:
  """`schedule` of ops reading `operands` and making `results` (per op,
  value ids, -1: none)."""
  return schedule(dependencies(operands, results, num_values), compute, before, after,
                  num_values)


def exposed(deps: Dependencies, compute: np.ndarray, before: np.ndarray,
            after: np.ndarray, num_values: int) -> float:
  """Seconds of `before` and `after` that the schedule leaves exposed: its
  makespan less compute, within [0, all of them]."""
  total = float(before.sum() + after.sum())
  if total == 0:
    return 0.0
  span = schedule(deps, compute, before, after, num_values)
  return float(min(total, max(0.0, span - compute.sum())))


def exposed_communication(model, state) -> float:
  """Seconds of the step's communication that compute does not hide when
  collectives run asynchronously: the schedule's makespan less compute
  (never more than all of it, never less than none)."""
  compute, before, after = op_seconds_split(model, state)
  return exposed(model.analysis.dependencies, compute, before, after, model.graph.num_values)


__all__ = ["exposed", "exposed_communication", "makespan", "op_seconds_split", "schedule"]
