"""Verify: what XLA actually compiled, next to what the cost model predicted.

Compiles a plan, reads its collectives and `memory_analysis()`
(`run/compiled.py`), prices the plan again for the platform compiled on,
and runs the partitioned and unpartitioned functions to compare numerics.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from automap._src.cost.compiler import PLATFORMS, XLA_TPU, Compiler, compiler_for
from automap._src.cost.model import KINDS, Cost
from automap._src.cost.program import Program
from automap._src.cost.tracker import Tracker
from automap._src.plan import build, planner
from automap._src.plan.errors import PlanError
from automap._src.plan.plan import Plan
from automap._src.run import apply as apply_lib
from automap._src.run.compiled import (
  Collective,
  collectives,
  compiled_host_memory,
  compiled_memory,
  compiled_seconds,
  compiled_traffic,
  summarize,
)
from automap._src.sharding.mesh import MeshError, MeshSpec
from automap._src.sharding.topology import compile_only


@dataclasses.dataclass(frozen=True)
class Report:
  """Predicted vs compiled, and numerics vs the unpartitioned function.

  Attributes:
    predicted: the cost model's prediction, re-priced for the platform
      compiled on.
    compiled_comm_bytes: {(kind, axes): bytes per device} compiled.
    collectives: each compiled collective.
    compiled_memory: argument + output + temp bytes per device
      (`memory_analysis()`), against `predicted.peak_memory`.
    memory_stats: the compiled program's `memory_analysis()` itself.
    max_abs_error: the largest absolute error over every output leaf, None
      if not run.
    max_rel_error: the largest relative error likewise.
    worst_leaf: the path of the leaf with the largest relative error.
    compiled_traffic: XLA's bytes accessed per device
      (`cost_analysis()["bytes accessed"]`).
    compiled_host_memory: bytes per device held in host memory, apart from
      `compiled_memory`.
    compiled_seconds: the backend's own estimate of a step's time
      (XLA:TPU's `cost_analysis()["optimal_seconds"]`), beside
      `predicted.step_time`; None where the backend gives none.
    platform: the platform compiled for ("tpu", "cpu", "gpu").
  """

  predicted: Cost
  compiled_comm_bytes: dict[tuple[str, tuple[str, ...]], float]
  collectives: tuple[Collective, ...]
  compiled_memory: float
  memory_stats: Any
  max_abs_error: float | None
  max_rel_error: float | None
  worst_leaf: str | None = None
  compiled_traffic: float = 0.0
  compiled_host_memory: float = 0.0
  compiled_seconds: float | None = None
  platform: str = ""

  @property
  def traffic_error(self) -> float:
    """Relative error of the predicted memory traffic against XLA's
    `cost_analysis()["bytes accessed"]`."""
    return abs(self.predicted.memory_traffic - self.compiled_traffic) / max(
        self.compiled_traffic, 1.0)

  @property
  def predicted_comm_bytes(self) -> float:
    return self.predicted.total_comm_bytes

  @property
  def compiled_total_comm_bytes(self) -> float:
    return float(sum(v for (k, _), v in self.compiled_comm_bytes.items()
                     if k in KINDS))

  @property
  def comm_error(self) -> float:
    """Relative error of the predicted total collective bytes."""
    c, p = self.compiled_total_comm_bytes, self.predicted_comm_bytes
    return abs(p - c) / max(c, 1.0)

  @property
  def memory_error(self) -> float:
    return abs(self.predicted.peak_memory - self.compiled_memory) / max(
        self.compiled_memory, 1.0)

  def table(self) -> str:
    keys = sorted(set(self.compiled_comm_bytes) | set(self.predicted.comm_bytes))
    rows = [f"{'collective':<16}{'axes':<18}{'predicted':>14}{'compiled':>14}"]
    for k in keys:
      rows.append(f"{k[0]:<16}{','.join(k[1]) or '-':<18}"
                  f"{self.predicted.comm_bytes.get(k, 0):>14,.0f}"
                  f"{self.compiled_comm_bytes.get(k, 0):>14,.0f}")
    rows.append(f"{'peak memory':<34}{self.predicted.peak_memory:>14,.0f}"
                f"{self.compiled_memory:>14,.0f}")
    rows.append(f"{'memory traffic':<34}{self.predicted.memory_traffic:>14,.0f}"
                f"{self.compiled_traffic:>14,.0f}")
    if self.compiled_host_memory:
      rows.append(f"{'host memory':<34}{'':>14}{self.compiled_host_memory:>14,.0f}")
    if self.compiled_seconds is not None:
      rows.append(f"{'step time (s), XLA estimate':<34}{self.predicted.step_time:>14.3e}"
                  f"{self.compiled_seconds:>14.3e}")
    if self.max_rel_error is not None:
      rows.append(f"numerics: max abs error {self.max_abs_error:.3g}, "
                  f"max rel error {self.max_rel_error:.3g}"
                  + (f" (at {self.worst_leaf})" if self.max_rel_error and self.worst_leaf
                     else ""))
    return "\n".join(rows)


def leaf_errors(expected, actual) -> list[tuple[str, float, float]]:
  """(path, max abs error, relative error) of each output leaf.

  Relative to the leaf's scale, floored at rounding of the largest result.
  Integer, boolean and PRNG-key leaves must match exactly; a mismatch (or a
  NaN on one side only) counts as an infinite error.
  """
  e_leaves, e_tree = jax.tree_util.tree_flatten_with_path(expected)
  a_leaves, a_tree = jax.tree.flatten(actual)
  if e_tree != a_tree:
    raise ValueError(f"output structures differ: {e_tree} vs {a_tree}")
  pairs = []
  for (path, e), a in zip(e_leaves, a_leaves):
    name = jax.tree_util.keystr(path) or "(the output)"
    if jax.dtypes.issubdtype(getattr(e, "dtype", np.float64), jax.dtypes.prng_key):
      e, a = jax.random.key_data(e), jax.random.key_data(a)
    e, a = np.asarray(e), np.asarray(a)
    if e.size == 0:
      continue
    if not jnp.issubdtype(e.dtype, jnp.inexact):  # exact leaves: no error or all of it
      pairs.append((name, 0.0 if np.array_equal(e, a) else math.inf))
      continue
    eps = float(jnp.finfo(e.dtype).eps)
    e, a = e.astype(np.float64), a.astype(np.float64)
    if not np.array_equal(np.isnan(e), np.isnan(a)):
      pairs.append((name, math.inf))  # a NaN one side only
      continue
    pairs.append((name, (np.nan_to_num(e, nan=0.0), np.nan_to_num(a, nan=0.0), eps)))
  # Relative to each leaf's scale (elementwise ratios explode near zero),
  # but no finer than rounding (64 ulps) at the scale of the largest result:
  # a leaf that is pure rounding noise (a gradient that is zero in exact
  # arithmetic, like an attention key bias's) differs between any two
  # summation orders.
  overall = max((float(np.abs(x[0]).max()) for _, x in pairs if isinstance(x, tuple)),
                default=0.0)
  out = []
  for name, x in pairs:
    if not isinstance(x, tuple):  # already an error
      out.append((name, x, x))
      continue
    e, a, eps = x
    diff = float(np.abs(e - a).max())
    scale = max(float(np.abs(e).max()), 64 * overall * eps, 1e-30)
    out.append((name, diff, diff / scale))
  return out


def worst_error(errors: list[tuple[str, float, float]]) -> tuple[float, float, str | None]:
  """(max abs error, max relative error, the leaf it is in) of `leaf_errors`."""
  worst, _, max_rel = max(errors, key=lambda e: e[2], default=(None, 0.0, 0.0))
  return max((d for _, d, _ in errors), default=0.0), max_rel, worst


def compare_numerics(expected, actual) -> tuple[float, float]:
  """Max abs and relative error over the output leaves (`leaf_errors`)."""
  return worst_error(leaf_errors(expected, actual))[:2]


def verify(plan: Plan, fn: Callable, args: tuple, mesh=None,
           check_numerics: bool = True, names=None) -> Report:
  """Compiles `plan` for `fn(*args)`; compares collectives, memory, numerics.

  The prediction is re-priced for the platform compiled on (XLA:CPU, for one,
  never forms reduce-scatters), so it is comparable with what XLA emitted.
  """
  mesh = mesh if mesh is not None else jax.make_mesh(
      plan.mesh.axis_sizes, plan.mesh.axis_names)
  if MeshSpec.of(mesh) != plan.mesh:
    raise MeshError(f"mesh {MeshSpec.of(mesh)} differs from the plan's {plan.mesh}.")
  traced = planner.trace(fn, args, mesh, names=names)
  check_fingerprint(plan, traced)
  # Priced for the backend that compiles it (XLA:CPU forms no reduce-scatter).
  program = Program.build(traced, plan.mesh, plan.hardware, compiler=compiler_of(mesh),
                          constraints=plan.program_constraints)
  predicted = Tracker(program.model, build.state_of(program, plan)).cost()
  dynamic = traced.dynamic_args(args)  # The static leaves are in the program.
  compiled = apply_lib.compile_with_plan(traced, mesh, plan, args)
  report = read_compiled(compiled, mesh, predicted)
  max_abs = max_rel = worst = None
  concrete = all(isinstance(x, (jax.Array, np.ndarray, np.generic, int, float,
                                complex)) for x in jax.tree.leaves(dynamic))
  # Compile-only devices (a TPU topology from libtpu) cannot run a program.
  if check_numerics and concrete and not compile_only(mesh):
    with jax.set_mesh(apply_lib.auto_mesh(mesh)):  # The program's constraints resolve.
      # Finished before the next starts: a step's host callbacks (equinox's
      # checks) wait for the interpreter, which tracing would hold.
      expected = jax.block_until_ready(jax.jit(traced.dynamic_fn())(*dynamic))
      placed = jax.device_put(
          dynamic, apply_lib.plan_shardings(mesh, plan.in_specs, traced.in_tree))
      actual = compiled(*placed)  # The program compiled above, not traced again.
    if not all(x.is_fully_addressable for x in jax.tree.leaves(actual)):
      # The mesh spans processes: every process compares the whole result.
      actual = multihost_utils.process_allgather(actual, tiled=True)
    max_abs, max_rel, worst = worst_error(leaf_errors(expected, actual))
  return dataclasses.replace(report, max_abs_error=max_abs, max_rel_error=max_rel,
                             worst_leaf=worst)


def check_fingerprint(plan: Plan, traced) -> None:
  """Raises `automap.PlanError` where `plan` was made for another program."""
  if traced.fingerprint() != plan.fingerprint:
    raise PlanError(
        "the plan was made for a different program (fingerprint "
        f"{plan.fingerprint}, this one {traced.fingerprint()}); search again.")


def compiler_of(mesh) -> Compiler:
  """The XLA backend that compiles for a concrete mesh's devices; a
  platform XLA names otherwise (a plugin's) is priced as TPU is."""
  platform = mesh.devices.flat[0].platform
  return compiler_for(platform) if platform.lower() in PLATFORMS else XLA_TPU


def read_compiled(compiled: jax.stages.Compiled, mesh, predicted: Cost) -> Report:
  """A compiled program read beside a prediction (numerics not run).

  Args:
    compiled: the compiled program.
    mesh: the concrete mesh it was compiled on.
    predicted: the cost model's price of the same layout, for the platform
      compiled on.

  Returns:
    The `Report`, its numeric errors None.
  """
  found = collectives(compiled.as_text(), mesh)
  memory, stats = compiled_memory(compiled)
  return Report(
      predicted=predicted, compiled_comm_bytes=summarize(found),
      collectives=tuple(found), compiled_memory=memory, memory_stats=stats,
      max_abs_error=None, max_rel_error=None, compiled_traffic=compiled_traffic(compiled),
      compiled_host_memory=compiled_host_memory(stats),
      compiled_seconds=compiled_seconds(compiled),
      platform=mesh.devices.flat[0].platform)
