"""The public entry points: partition, search, evaluate, verify."""

from __future__ import annotations

import os
from collections.abc import Callable

import jax
import numpy as np

from automap._src.cost.hardware import Hardware, get_hardware
from automap._src.cost.model import Cost
from automap._src.cost.tracker import Tracker
from automap._src.ir import trace as trace_lib
from automap._src.plan import cache as cache_lib
from automap._src.plan import planner
from automap._src.plan.plan import Plan
from automap._src.run import verify as verify_lib
from automap._src.search.request import SearchOptions, with_keywords
from automap._src.sharding import annotations
from automap._src.sharding.mesh import MeshSpec
from automap._src.sharding.state import flat_specs


def search(fn: Callable, *args, mesh=None, devices: int | None = None,
           hardware: str | Hardware = "tpu-v4", options: SearchOptions | None = None,
           cache: bool | str | os.PathLike = False, names=None, layout=None,
           layout_rules=None, **search_options) -> Plan:
  """Plans `fn(*args)` without running it, on `mesh`, or on the best mesh
  of `devices` devices (axes named "x", "y", "z"; the budget is shared by
  the mesh shapes tried).

  Argument leaves may be `jax.ShapeDtypeStruct`s. `options` says how to
  search (`automap.SearchOptions`: hints, budget, memory_limit, seed, search
  backend "mcts" or "ilp", policy "uniform", "learned" or a weights file,
  constraints: what to do with the program's own `with_sharding_constraint`s,
  "keep", "hints" or "ignore");
  each of its fields may be given as a keyword instead
  (`automap.search(fn, *args, mesh=mesh, budget=automap.Budget(episodes=50))`).
  `cache` (off by default here, on for `partition`) reuses and stores plans
  of `mesh=` searches as `partition` does. `names` says what argument
  leaves are called where their paths do not (keras keeps state in lists):
  a pytree prefix of the arguments with a string or None per leaf or
  subtree (`names=([v.path for v in model.trainable_variables], None)`);
  plans, explain, export, hints and errors use those names.

  "your layout" in the plan's yardsticks is the layout the arguments state:
  `layout` (a pytree prefix of the arguments with PartitionSpecs, as
  `jax.jit`'s in_shardings; a mapping of argument-path pattern -> spec; or a
  keras LayoutMap), else their own annotations (flax `with_partitioning` /
  logical partitioning metadata, arrays or ShapeDtypeStructs placed with a
  NamedSharding); `layout=False` reads none. Logical axis names resolve
  through `layout_rules` ((logical, mesh axes) pairs), else flax's rules
  active now. `start="your layout"` also refines it and keeps the better.
  """
  if (mesh is None) == (devices is None):
    raise TypeError("search takes exactly one of mesh= (a jax.sharding.Mesh) "
                    "or devices= (a device count to choose a mesh for).")
  request = with_keywords(SearchOptions, options, search_options, "search")
  if mesh is not None:
    folder = cache_lib.resolve(cache)
    spec = MeshSpec.of(mesh)  # Checked before the trace uses it.
    traced = trace_lib.trace(fn, args, mesh, names=names)
    return planner.plan(traced, spec, get_hardware(hardware), request,
                        None if folder is None else cache_lib.PlanCache(folder),
                        planner.read_layout(traced, args, spec, layout, layout_rules, request),
                        layout is not None and layout is not False)
  if (not isinstance(devices, (int, np.integer)) or isinstance(devices, bool)
      or devices < 1):
    raise ValueError(f"devices must be a positive integer, got {devices!r}.")
  traced = trace_lib.trace(fn, args, names=names)
  return planner.plan_on_devices(traced, args, devices, get_hardware(hardware), request,
                                 layout, layout_rules)


def evaluate(fn: Callable, *args, mesh, in_shardings=None,
             hardware: str | Hardware = "tpu-v4", constraints: str = "keep",
             names=None, layout_rules=None) -> Cost:
  """Cost of a hand-written strategy under the same cost model.

  `in_shardings` is a pytree of PartitionSpecs (a prefix of the arguments
  works). None (the default) takes the layout the arguments state, as
  `jax.jit` takes unspecified shardings from its arguments: flax
  partitioning metadata (logical names through `layout_rules`, else flax's
  rules active now) or the NamedSharding an array or ShapeDtypeStruct is
  placed with; leaves that state none are replicated. The program's own
  constraints (`with_sharding_constraint`, flax logical constraints under
  the rules active now; traced with `mesh` in context) lay out the values
  they name, and everything else follows by propagation, as XLA compiles
  the program under `jax.jit(in_shardings=...)`. `constraints="ignore"`
  prices the layout as if the program had none.
  """
  if constraints not in ("keep", "ignore"):
    raise ValueError(
        f"evaluate: constraints must be 'keep' (price the program as XLA compiles "
        f"it) or 'ignore' (as if it had no constraints), got {constraints!r}.")
  program = planner.build_program(fn, args, mesh, hardware, constraints=constraints,
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


def verify(plan: Plan, fn: Callable, *args, mesh=None,
           check_numerics: bool = True, names=None) -> verify_lib.Report:
  """Compiles `plan` for `fn(*args)`; compares collectives, memory, numerics.

  The prediction is re-priced for the platform compiled on (XLA:CPU, for one,
  never forms reduce-scatters), so it is comparable with what XLA emitted.
  """
  return verify_lib.verify(plan, fn, args, mesh, check_numerics, names)
