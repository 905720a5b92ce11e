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


def schedule(deps: Dependencies, compute: np.ndarray, before: np.ndarray,
             after: np.ndarray, num_values: int) -> float:
  """Seconds the two-stream list schedule of the module docstring takes
  over the ops of `deps` (`analysis.dependencies`).

  The compute stream runs, of the ops whose producers have all run, the one
  whose operands arrived first (program order on ties), so compute that
  does not need a collective's result runs while the collective is in
  flight (`kernels.list_schedule`).
  compute, before, after: [O] seconds per op (`Tracker.op_seconds_split`).
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


__all__ = ["exposed", "makespan", "schedule"]
