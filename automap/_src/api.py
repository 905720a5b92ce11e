"""The public entry points: partition, search, evaluate, verify."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from automap._src.cost.hardware import Hardware, get_hardware, on_mesh
from automap._src.cost.model import Cost
from automap._src.cost.tracker import Tracker
from automap._src.plan import cache as cache_lib
from automap._src.plan import planner
from automap._src.plan.plan import Plan
from automap._src.run import verify as verify_lib
from automap._src.run.check import compile_plan_for
from automap._src.search.request import SearchOptions, with_keywords
from automap._src.sharding import annotations
from automap._src.sharding.mesh import MeshSpec
from automap._src.sharding.state import flat_specs

# A mesh to plan on: concrete, or abstract (no devices needed to plan).
AnyMesh = jax.sharding.Mesh | jax.sharding.AbstractMesh


def search(fn: Callable, *args: Any, mesh: AnyMesh | None = None, devices: int | None = None,
           hardware: str | Hardware | None = None, options: SearchOptions | None = None,
           cache: bool | str | os.PathLike = False, names: Any = None, layout: Any = None,
           layout_rules: Any = None, **search_options: Any) -> Plan:
  """Plans `fn(*args)` without running it.

  Args:
    fn: the step to plan.
    *args: its arguments; leaves may be `jax.ShapeDtypeStruct`s, so models
      larger than this machine can be planned.
    mesh: a `jax.sharding.Mesh` or `AbstractMesh` to plan on; or
    devices: a device count: every 1-3 axis mesh of it is tried (axes "x",
      "y", "z"; the budget shared between the shapes) and the best kept.
    hardware: a catalogue name (`automap.HARDWARE`) or a `Hardware`; None:
      the entry of the mesh's devices where the catalogue knows them (a TPU
      slice from `automap.tpu_mesh`), else "tpu-v4".
    options: how to search (`automap.SearchOptions`: hints, budget,
      memory_limit, seed, search "mcts" or "ilp", policy, constraints,
      start, time_tolerance, verify and verify_plans); each field may be
      given as a keyword instead (`budget=automap.Budget(episodes=50)`), not
      both ways.
    cache: reuse and store plans of `mesh=` searches as `partition` does
      (off by default here); True, False or a folder.
    names: what argument leaves are called where their paths do not say
      (keras keeps state in lists): a pytree prefix of the arguments with a
      string or None per leaf or subtree.
    layout: "your layout", the layout the arguments state, priced beside
      the plan (and refined with `start="your layout"`): a pytree prefix of
      PartitionSpecs as `jax.jit`'s in_shardings, a mapping of argument-path
      pattern -> spec, or a keras LayoutMap; by default the arguments' own
      annotations (flax partitioning metadata, NamedShardings); False: none.
    layout_rules: (logical, mesh axes) pairs for logical names in `layout`,
      else flax's rules active now.

    **search_options: `SearchOptions` fields, as keywords.

  Returns:
    The `automap.Plan`: argument and result PartitionSpecs, the predicted
    `Cost` on the clock the search minimised, yardsticks and statistics.

  Raises:
    TypeError: neither or both of `mesh` and `devices`, or an option of the
      wrong type.
    ValueError: `devices` not a positive integer, or an option out of range.
    automap.MeshError: a mesh or a stated layout that does not fit the program.
    automap.MemoryLimitError: no plan fits `memory_limit`.
  """
  if (mesh is None) == (devices is None):
    raise TypeError("search takes exactly one of mesh= (a jax.sharding.Mesh) "
                    "or devices= (a device count to choose a mesh for).")
  request = with_keywords(SearchOptions, options, search_options, "search")
  if mesh is not None:
    folder = cache_lib.resolve(cache)
    spec = MeshSpec.of(mesh)  # Checked before the trace uses it.
    traced = planner.trace(fn, args, mesh, names=names)
    return planner.plan(traced, spec, on_mesh(get_hardware(hardware, mesh), mesh), request,
                        None if folder is None else cache_lib.PlanCache(folder),
                        planner.read_layout(traced, args, spec, layout, layout_rules, request),
                        layout is not None and layout is not False,
                        compile_plan_for(traced, mesh, args)
                        if isinstance(mesh, jax.sharding.Mesh) else None)
  if (not isinstance(devices, (int, np.integer)) or isinstance(devices, bool)
      or devices < 1):
    raise ValueError(f"devices must be a positive integer, got {devices!r}.")
  traced = planner.trace(fn, args, names=names)
  return planner.plan_on_devices(traced, args, devices, get_hardware(hardware), request,
                                 layout, layout_rules)


def evaluate(fn: Callable, *args: Any, mesh: AnyMesh, in_shardings: Any = None,
             hardware: str | Hardware | None = None, constraints: str = "keep",
             names: Any = None, layout_rules: Any = None) -> Cost:
  """Cost of a hand-written strategy under the same cost model.

  Args:
    fn: the step.
    *args: its arguments (leaves may be ShapeDtypeStructs).
    mesh: the mesh the layout names axes of.
    in_shardings: a pytree (or prefix) of PartitionSpecs for the arguments;
      None takes the layout the arguments state, as `jax.jit` does (flax
      partitioning metadata through `layout_rules`, else flax's rules active
      now; an array's or ShapeDtypeStruct's NamedSharding), leaves that
      state none replicated.
    hardware: a catalogue name or a `Hardware`; None as for `search`.
    constraints: "keep" prices the program's own constraints as XLA
      compiles them (values they name laid out so, the rest propagated);
      "ignore" as if it had none.
    names: as for `search`.
    layout_rules: as for `search`.

  Returns:
    The `automap.Cost` of the layout, on the clock the searches minimise.

  Raises:
    ValueError: `constraints` neither "keep" nor "ignore".
    automap.MeshError: `in_shardings` or the stated layout does not fit
      the arguments or the mesh.
  """
  if constraints not in ("keep", "ignore"):
    raise ValueError(
        f"evaluate: constraints must be 'keep' (price the program as XLA compiles "
        f"it) or 'ignore' (as if it had no constraints), got {constraints!r}.")
  program = planner.build_program(fn, args, mesh, get_hardware(hardware, mesh),
                                  constraints=constraints,
                                  names=names)
  dynamic = program.traced.dynamic_args(args)  # Static leaves take no spec.
  if in_shardings is None:
    stated = annotations.read(dynamic, program.traced.in_paths, program.mesh,
                              rules=layout_rules)
    specs = [jax.sharding.PartitionSpec() if s is None else s for s in stated.specs]
  else:
    specs = flat_specs(in_shardings, dynamic)
  state = program.state_from_specs(specs)
  return Tracker(program.model, state).cost()


def verify(plan: Plan, fn: Callable, *args: Any, mesh: jax.sharding.Mesh | None = None,
           check_numerics: bool = True, names: Any = None) -> verify_lib.Report:
  """Compiles `plan` for `fn(*args)` and compares it with the prediction.

  Args:
    plan: an `automap.Plan` of `fn` for these arguments' signature.
    fn: the step.
    *args: its concrete arguments.
    mesh: the mesh to compile on (default: one of the plan's shape made of
      the local devices).
    check_numerics: also run the partitioned and the unpartitioned step and
      compare their outputs (not on a compile-only mesh, `automap.tpu_mesh`:
      its devices cannot run, and the report's errors are None).
    names: as for `search`.

  Returns:
    An `automap.Report`: compiled collectives (kind, bytes, mesh axes) and
    memory against the prediction re-priced for the platform compiled on
    (XLA:CPU never forms reduce-scatters), and the largest numeric errors.

  Raises:
    automap.PlanError: the plan was made for another signature or mesh shape.
  """
  return verify_lib.verify(plan, fn, args, mesh, check_numerics, names)
