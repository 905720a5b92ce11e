"""The public entry points: partition, search, evaluate, verify."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import sys
import time
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from rich import progress as progress_lib

from automap._src.cost.hardware import Hardware, get_hardware
from automap._src.cost.model import Cost
from automap._src.cost.tracker import Tracker
from automap._src.ir import trace as trace_lib
from automap._src.plan import build
from automap._src.plan import cache as cache_lib
from automap._src.plan.plan import Plan
from automap._src.run import apply as apply_lib
from automap._src.run import verify as verify_lib
from automap._src.search import ilp, mcts, refine
from automap._src.search.actions import ActionSpace
from automap._src.search.program import Program
from automap._src.sharding import kernels
from automap._src.sharding.mesh import MeshError, MeshSpec
from automap._src.sharding.state import State


class MemoryLimitError(ValueError):
  """No plan can fit the requested memory limit."""


@dataclasses.dataclass(frozen=True)
class Hints:
  """What the user knows.

  groups: name-scope patterns (fnmatch, e.g. "block_*") of repeated layers
    that should share one decision.
  fixed: argument-path pattern (fnmatch, e.g. "*/embed/*") -> PartitionSpec
    the plan must keep.
  """

  groups: tuple[str, ...] = ()
  fixed: Mapping[str, PartitionSpec] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    groups = (self.groups,) if isinstance(self.groups, str) else tuple(self.groups)
    for g in groups:
      if not isinstance(g, str) or not g:
        raise TypeError(f"Hints.groups must be non-empty strings, got {g!r}.")
    if not isinstance(self.fixed, Mapping):
      raise TypeError(f"Hints.fixed must be a mapping, got {self.fixed!r}.")
    for k, v in self.fixed.items():
      if not isinstance(k, str) or not isinstance(v, PartitionSpec):
        raise TypeError(
            f"Hints.fixed maps argument-path patterns (str) to PartitionSpec, "
            f"got {k!r}: {v!r}.")
    object.__setattr__(self, "groups", groups)
    # Read-only, so a Hints stays immutable and hashable.
    object.__setattr__(self, "fixed", types.MappingProxyType(dict(self.fixed)))

  def __hash__(self):
    return hash((self.groups, tuple(self.fixed.items())))


@dataclasses.dataclass(frozen=True)
class Budget:
  """How much search to spend: MCTS episodes and wall seconds, whichever
  runs out first. progress: show a live display of the best plan so far
  (None: only when stderr is a terminal)."""

  episodes: int = 200
  seconds: float = 60.0
  progress: bool | None = None

  def __post_init__(self):
    if (not isinstance(self.episodes, (int, np.integer)) or isinstance(self.episodes, bool)
        or self.episodes <= 0):
      raise ValueError(
          f"Budget.episodes must be a positive integer, got {self.episodes!r}.")
    if (not isinstance(self.seconds, (int, float, np.integer, np.floating))
        or isinstance(self.seconds, bool) or not self.seconds > 0):
      raise ValueError(
          f"Budget.seconds must be a positive number, got {self.seconds!r}.")
    if self.progress not in (None, True, False):
      raise ValueError(f"Budget.progress must be True, False or None, got {self.progress!r}.")


def _program(fn, args, mesh, hardware, hints: Hints | None) -> Program:
  traced = trace_lib.trace(fn, args)
  return Program.build(traced, MeshSpec.of(mesh), get_hardware(hardware),
                       (hints or Hints()).fixed)


SEARCHES = ("mcts", "ilp")


class SearchWarning(UserWarning):
  """A search fell short of what was asked and says what it did instead."""


@dataclasses.dataclass(frozen=True)
class _Request:
  """What a search is asked for, everything but the program."""

  hints: Hints
  budget: Budget
  memory_limit: float | None
  seed: int
  method: str
  policy: str = "uniform"  # "uniform", "learned", or a weights file path

  @classmethod
  def of(cls, hints, budget, memory_limit, seed, method, policy="uniform") -> _Request:
    hints = hints if hints is not None else Hints()
    if not isinstance(hints, Hints):
      raise TypeError(f"hints must be an automap.Hints, got {hints!r}.")
    budget = budget if budget is not None else Budget()
    if not isinstance(budget, Budget):
      raise TypeError(f"budget must be an automap.Budget, got {budget!r}.")
    if method not in SEARCHES:
      raise ValueError(
          f"search must be one of {SEARCHES}, got {method!r}: 'mcts' (tree "
          "search over layer-group tilings and tactics) or 'ilp' (Alpa's "
          "per-op integer program, solved by CP-SAT within the budget's seconds).")
    if (not isinstance(seed, (int, np.integer)) or isinstance(seed, bool)
        or seed < 0):
      raise TypeError(f"seed must be a non-negative integer, got {seed!r}.")
    if memory_limit is not None and (
        not isinstance(memory_limit, (int, float, np.integer, np.floating))
        or isinstance(memory_limit, bool)):
      raise TypeError(
          f"memory_limit must be a number of bytes per device (or None for "
          f"no limit), got {memory_limit!r}.")
    if isinstance(policy, os.PathLike):
      policy = os.fspath(policy)
    if not isinstance(policy, str) or not policy:
      raise TypeError(
          f"policy must be 'uniform' (no learned priors), 'learned' (the "
          f"shipped weights) or the path of a weights file, got {policy!r}.")
    if policy not in ("learned", "uniform"):
      policy = os.path.abspath(policy)
    return cls(hints, budget, memory_limit, int(seed), method, policy)

  def policy_id(self) -> str:
    """What the policy's priors depend on: none, or its weights' digest."""
    if self.policy == "uniform":
      return "uniform"
    from automap._src.search.policy import learned

    return learned.digest(None if self.policy == "learned" else self.policy)


@dataclasses.dataclass
class _Found:
  state: State
  score: mcts.Score  # (bytes over the memory limit, step seconds)
  stats: dict  # what the inputs determine: saved with the plan
  timings: dict[str, float]  # wall seconds of this run: kept on the Plan only


def _check_memory_limit(program: Program, memory_limit: float | None) -> None:
  if memory_limit is None:
    return
  if not memory_limit > 0:
    raise MemoryLimitError(
        f"memory_limit must be a positive number of bytes, got {memory_limit!r}.")
  bound = program.memory_lower_bound()
  if memory_limit < bound:
    raise MemoryLimitError(
        f"memory_limit={memory_limit:,.0f} bytes per device is below the "
        f"lower bound of {bound:,.0f} bytes (arguments and results spread "
        f"evenly over {program.mesh.num_devices} devices). Raise the limit "
        "or use more devices.")


def _run_search(program: Program, request: _Request) -> _Found:
  _check_memory_limit(program, request.memory_limit)
  space = ActionSpace(program, request.hints.groups)
  try:
    if request.method == "ilp":
      return _run_ilp(program, space, request)
    return _run_mcts(program, space, request, request.budget.seconds)
  except SystemError as e:
    # Ctrl-C landing inside a compiled kernel's call (while numba compiles,
    # loads or boxes) surfaces as a SystemError around it.
    if kernels.interrupted(e):
      raise KeyboardInterrupt from None
    raise


# Share of the seconds MCTS leaves to refining its best plans, and the
# moves refinement may try per episode of the budget: bounded by tries, not
# by the clock, a search is reproducible. It ends sooner when no move helps.
_REFINE_SHARE = 0.2
_REFINE_TRIES = 10


def _run_mcts(program: Program, space: ActionSpace, request: _Request,
              seconds: float) -> _Found:
  """MCTS, then refinement of its best plans (`search/refine.py`)."""
  t0 = time.perf_counter()
  budget = request.budget
  policy = None
  if request.policy != "uniform":
    from automap._src.search.policy import learned

    policy = learned.cached(None if request.policy == "learned" else request.policy)
  run = mcts.Search(program, space, request.memory_limit, request.seed, policy=policy)
  show = budget.progress if budget.progress is not None else sys.stderr.isatty()
  searching = seconds * (1 - _REFINE_SHARE)
  if not show:
    result = run.run(budget.episodes, searching)
  else:
    with progress_lib.Progress(
        *progress_lib.Progress.get_default_columns(),
        progress_lib.TextColumn("{task.fields[best]}"), transient=True) as bar:
      task = bar.add_task(f"automap: searching {program.mesh}",
                          total=budget.episodes, best="")
      result = run.run(budget.episodes, searching, lambda s: bar.update(
          task, completed=s.episodes,
          best=f"best {s.best.score[1] * 1e3:.3f} ms, {s.best.score[0]:,.0f} B over"))
  stats = {"strategy": "mcts", "policy": "uniform" if policy is None else "learned",
           "episodes": result.episodes,
           "episode_of_best": result.episode_of_best,
           "evaluations": result.evaluations, "states": result.nodes,
           "actions": [space.describe(a) for a in result.path],
           "groups": len(space.groups)}
  start = time.perf_counter()
  state, score, moves = refine.refine_best(
      program, space.colour, [(n.state, n.score) for n in run.table.values()],
      request.memory_limit, seconds - (start - t0), _REFINE_TRIES * budget.episodes)
  stats["refine_moves"] = moves
  return _Found(state, score, stats,
                {"search": time.perf_counter() - t0, "to_best": result.seconds_to_best,
                 "refine": time.perf_counter() - start})


# Share of Budget.seconds the ILP's warm start (MCTS) may take.
_WARM_SHARE = 0.25


def _run_ilp(program: Program, space: ActionSpace, request: _Request) -> _Found:
  """Solves the ILP from MCTS's best plan (a warm start within a quarter of
  the budget's seconds) and keeps the better of the two; on a timeout
  without a solution, the warm start, with a warning."""
  t0 = time.perf_counter()
  limit, budget = request.memory_limit, request.budget
  warm = _run_mcts(program, space, request, budget.seconds * _WARM_SHARE)
  result = ilp.solve(program, ilp.SolverSettings(
      seconds=budget.seconds - (time.perf_counter() - t0), memory_limit=limit,
      seed=request.seed), hint=warm.state)
  timings = {"search": time.perf_counter() - t0, "warm_start": warm.timings["search"]}
  stats = {"strategy": "ilp", "status": result.status, "memory_rounds": result.rounds,
           "choices": result.ops, "variables": result.variables,
           "objective": result.objective, "bound": result.bound,
           "warm_start": {k: warm.stats[k] for k in ("episodes", "actions")}
           | {"step_time": warm.score[1]}}
  if result.status == "infeasible":
    least, at = result.least_memory
    g = program.graph
    raise MemoryLimitError(
        f"no strategy meets memory_limit={limit:,.0f} bytes per device: the "
        f"least peak any choice of per-op strategies reaches is {least:,.0f} "
        f"bytes, at op {at} ({g.prims[at]} in {g.scopes[at] or 'the top level'!r}). "
        "Raise the limit or use more devices.")
  if result.state is None:
    warnings.warn(SearchWarning(
        f"search='ilp' found no solution within {budget.seconds:g} s "
        f"({result.variables:,} variables); using its warm start, MCTS's best "
        "plan, instead. Give a larger Budget(seconds=...) or use search='mcts'."),
        stacklevel=4)
    return _Found(warm.state, warm.score, dict(stats, kept="warm start"), timings)
  score = mcts.score_of(Tracker(program.model, result.state), limit)
  if warm.score < score:  # the solver's classes could not express the start
    return _Found(warm.state, warm.score, dict(stats, kept="warm start"), timings)
  return _Found(result.state, score, stats, timings)


def _plan_of(program: Program, found: _Found, memory_limit: float | None) -> Plan:
  if found.score[0] > 0:
    raise MemoryLimitError(
        f"no plan found within memory_limit={memory_limit:,.0f} bytes per "
        f"device: the best found needs "
        f"{memory_limit + found.score[0]:,.0f} bytes (lower bound "
        f"{program.memory_lower_bound():,.0f}). Raise the limit, use more "
        "devices, or give a larger search budget.")
  stats = dict(found.stats, graph_values=program.graph.num_values,
               graph_ops=program.graph.num_ops)
  plan = build.make_plan(program, found.state, stats, memory_limit)
  plan.timings.update(found.timings)
  return plan


def _plan(traced: trace_lib.Traced, mesh: MeshSpec, hardware: Hardware,
          request: _Request, store: cache_lib.PlanCache | None) -> Plan:
  """The plan `store` holds for this search (tied to the program's argument
  and result structure), else a fresh search, stored."""
  if store is not None:
    k = cache_lib.key(traced.fingerprint(), mesh, hardware, request)
    plan = store.load(k, traced.fingerprint(), mesh)
    if plan is not None:
      return dataclasses.replace(plan, stats=dict(plan.stats, cached=True),
                                 in_tree=traced.in_tree, out_tree=traced.out_tree)
  program = Program.build(traced, mesh, hardware, request.hints.fixed)
  plan = _plan_of(program, _run_search(program, request), request.memory_limit)
  if store is not None:
    store.store(k, plan)
  return plan


def mesh_shapes(devices: int) -> list[tuple[int, ...]]:
  """The ways to lay `devices` out as a mesh of 1 to 3 axes, each of size
  at least 2 (one axis of 1 for a single device)."""
  if devices == 1:
    return [(1,)]
  out = [(devices,)]
  for a in range(2, devices):
    if devices % a == 0:
      out.append((a, devices // a))
      for b in range(2, devices // a):
        if (devices // a) % b == 0 and devices // a // b > 1:
          out.append((a, b, devices // a // b))
  return sorted(out, key=len)


_AXIS_NAMES = ("x", "y", "z")


def search(fn: Callable, *args, mesh=None, devices: int | None = None,
           hints: Hints | None = None, hardware: str | Hardware = "tpu-v4",
           budget: Budget | None = None, memory_limit: float | None = None,
           seed: int = 0, cache: bool | str | os.PathLike = False,
           search: str = "mcts", policy: str | os.PathLike = "uniform") -> Plan:
  """Plans `fn(*args)` without running it, on `mesh`, or on the best mesh
  of `devices` devices (axes named "x", "y", "z"; the budget is shared by
  the mesh shapes tried).

  Argument leaves may be `jax.ShapeDtypeStruct`s. `cache` (off by default
  here, on for `partition`) reuses and stores plans of `mesh=` searches as
  `partition` does. `search` picks the backend: "mcts" (default) or "ilp"
  (exact per-op strategies; for small programs and as a yardstick).
  `policy` guides MCTS: "uniform" (default: every action alike, admitted in
  the action space's order), "learned" (the shipped network's priors), or
  the path of weights trained with `python -m automap.policy.train`.
  """
  if (mesh is None) == (devices is None):
    raise TypeError("search takes exactly one of mesh= (a jax.sharding.Mesh) "
                    "or devices= (a device count to choose a mesh for).")
  request = _Request.of(hints, budget, memory_limit, seed, search, policy)
  if mesh is not None:
    folder = cache_lib.resolve(cache)
    return _plan(trace_lib.trace(fn, args), MeshSpec.of(mesh), get_hardware(hardware),
                 request, None if folder is None else cache_lib.PlanCache(folder))
  if (not isinstance(devices, (int, np.integer)) or isinstance(devices, bool)
      or devices < 1):
    raise ValueError(f"devices must be a positive integer, got {devices!r}.")
  traced = trace_lib.trace(fn, args)
  hw = get_hardware(hardware)
  shapes = mesh_shapes(int(devices))
  b = request.budget
  share = dataclasses.replace(request, budget=Budget(
      max(1, b.episodes // len(shapes)), b.seconds / len(shapes), b.progress))
  best = None
  for shape in shapes:
    program = Program.build(traced, MeshSpec(_AXIS_NAMES[:len(shape)], shape), hw,
                            request.hints.fixed)
    found = _run_search(program, share)
    if best is None or found.score < best[1].score:
      best = (program, found)
  return _plan_of(*best, request.memory_limit)


def _is_spec_leaf(x) -> bool:
  return x is None or isinstance(x, (PartitionSpec, NamedSharding))


def flat_specs(in_shardings, args: tuple, what: str = "in_shardings") -> list:
  """Flat PartitionSpecs for `args` from a (prefix) pytree of specs."""
  try:
    full = jax.tree_util.tree_map(
        lambda s, sub: jax.tree.map(lambda _: s, sub), in_shardings, args,
        is_leaf=_is_spec_leaf)
  except (ValueError, TypeError) as e:
    raise MeshError(
        f"{what} must be a pytree of PartitionSpecs matching the arguments "
        f"(or a prefix of them): {e}") from None
  leaves = jax.tree.leaves(full, is_leaf=_is_spec_leaf)
  return [s.spec if isinstance(s, NamedSharding) else
          (PartitionSpec() if s is None else s) for s in leaves]


def evaluate(fn: Callable, *args, mesh, in_shardings,
             hardware: str | Hardware = "tpu-v4") -> Cost:
  """Cost of a hand-written strategy under the same cost model.

  `in_shardings` is a pytree of PartitionSpecs (a prefix of the arguments
  works); intermediates follow by propagation, as XLA's would.
  """
  program = _program(fn, args, mesh, hardware, None)
  state = program.state_from_specs(flat_specs(in_shardings, args))
  return Tracker(program.model, state).cost()


def verify(plan: Plan, fn: Callable, *args, mesh=None,
           check_numerics: bool = True) -> verify_lib.Report:
  """Compiles `plan` for `fn(*args)`; compares collectives, memory, numerics.

  The prediction is re-priced for the platform compiled on (XLA:CPU, for one,
  never forms reduce-scatters), so it is comparable with what XLA emitted.
  """
  return verify_lib.verify(plan, fn, args, mesh, check_numerics)


@dataclasses.dataclass
class _Entry:
  plan: Plan
  jitted: Any
  in_shardings: Any  # NamedShardings on the Auto view of the mesh
  out_shardings: Any  # NamedShardings on the user's mesh


class Partitioned:
  """A function partitioned by automap; behaves like a jitted function.

  The first call with a new argument signature traces, searches and
  compiles; later calls with that signature reuse the plan. Results come
  back sharded on the user's mesh. Arguments in `donate_argnums` are donated
  as `jax.jit` donates them: their buffers may back the results.
  """

  def __init__(self, fn: Callable, *, mesh, hints: Hints | None = None,
               hardware: str | Hardware = "tpu-v4", budget: Budget | None = None,
               memory_limit: float | None = None, seed: int = 0,
               cache: bool | str | os.PathLike = True, search: str = "mcts",
               policy: str | os.PathLike = "uniform",
               donate_argnums: int | tuple[int, ...] = ()):
    self._mesh_spec = MeshSpec.of(mesh)
    if not isinstance(mesh, jax.sharding.Mesh):
      raise MeshError(
          f"partition runs the program, so mesh must be a concrete "
          f"jax.sharding.Mesh with devices, got {type(mesh).__name__}; plan on "
          "an AbstractMesh with automap.search instead.")
    self.fn, self.mesh = fn, mesh
    self._auto = apply_lib.auto_mesh(mesh)
    self._signature = _signature_of(fn)
    self.request = _Request.of(hints, budget, memory_limit, seed, search, policy)
    for pattern, spec in self.request.hints.fixed.items():
      for entry in spec:
        for name in entry if isinstance(entry, tuple) else (entry,):
          if name is not None:
            self._mesh_spec.axis_index(name, f"Hints.fixed[{pattern!r}]")
    self.hardware = get_hardware(hardware)
    self.donate_argnums = _argnums(donate_argnums)
    self.cache = cache
    folder = cache_lib.resolve(cache)
    self._cache = None if folder is None else cache_lib.PlanCache(folder)
    self._entries: dict[tuple, _Entry] = {}
    self._last: _Entry | None = None
    functools.update_wrapper(self, fn)

  def _positional(self, args: tuple, kwargs: dict) -> tuple[tuple, Callable]:
    """The call's arguments as positional ones, and the function taking them:
    keyword-only arguments travel as one trailing dict (its entries are
    arguments like any other, planned and sharded)."""
    if not kwargs:
      return args, self.fn
    if self._signature is None:
      raise TypeError(f"{self.fn!r} takes no keyword arguments automap can bind.")
    bound = self._signature.bind(*args, **kwargs)
    bound.apply_defaults()
    if not bound.kwargs:
      return bound.args, self.fn
    return bound.args + (dict(bound.kwargs),), self._keywords_last

  def _keywords_last(self, *args):
    *positional, keywords = args
    return self.fn(*positional, **keywords)

  def _entry(self, args: tuple, fn: Callable) -> _Entry:
    _, tree, _, avals = trace_lib.flatten_args(args)
    key = (fn is self.fn, trace_lib.signature_of(tree, avals))
    entry = self._entries.get(key)
    if entry is None:
      t0 = time.perf_counter()
      traced = trace_lib.trace(fn, args)
      plan = _plan(traced, self._mesh_spec, self.hardware, self.request, self._cache)
      plan.timings["plan"] = time.perf_counter() - t0
      if self.donate_argnums and max(self.donate_argnums) >= len(args):
        raise ValueError(
            f"donate_argnums={self.donate_argnums} names argument "
            f"{max(self.donate_argnums)}, but the call passes {len(args)} arguments.")
      jitted = apply_lib.jit_with_plan(traced, self.mesh, plan, self.donate_argnums)
      outs = jax.tree.unflatten(traced.out_tree, [
          NamedSharding(self.mesh, s) for s in plan.out_specs])
      entry = _Entry(plan, jitted,
                     apply_lib.plan_shardings(self.mesh, plan.in_specs, traced.in_tree),
                     outs)
      self._entries[key] = entry
    self._last = entry
    return entry

  def __call__(self, *args, **kwargs):
    args, fn = self._positional(args, kwargs)
    entry = self._entry(args, fn)
    with jax.set_mesh(self._auto):
      out = entry.jitted(*jax.device_put(args, entry.in_shardings))
    if self._auto is self.mesh:
      return out
    return jax.device_put(out, entry.out_shardings)  # Same devices: no copy.

  def lower(self, *args, **kwargs):
    """The partitioned program lowered for these arguments."""
    args, fn = self._positional(args, kwargs)
    entry = self._entry(args, fn)  # Traced outside the mesh context, like calls.
    with jax.set_mesh(self._auto):
      return entry.jitted.lower(*apply_lib.abstract_args(args))

  def verify(self, *args, check_numerics: bool = True, **kwargs) -> verify_lib.Report:
    """`automap.verify` of the plan for these arguments (planned first if
    their signature is new): compiled collectives and memory against the
    prediction, and the numerics against the unpartitioned function."""
    args, fn = self._positional(args, kwargs)
    entry = self._entry(args, fn)
    return verify(entry.plan, fn, *args, mesh=self.mesh, check_numerics=check_numerics)

  @property
  def plan(self) -> Plan | None:
    """The plan of the most recent call's signature."""
    return None if self._last is None else self._last.plan


def _argnums(donate_argnums) -> tuple[int, ...]:
  nums = (donate_argnums,) if isinstance(donate_argnums, (int, np.integer)) else donate_argnums
  try:
    nums = tuple(sorted(set(nums)))
  except TypeError:
    nums = None
  if nums is None or not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool)
                             and n >= 0 for n in nums):
    raise TypeError(
        f"donate_argnums must be a non-negative argument index or a tuple of them, "
        f"got {donate_argnums!r}.")
  return tuple(int(n) for n in nums)


def _signature_of(fn) -> inspect.Signature | None:
  try:
    return inspect.signature(fn)
  except (TypeError, ValueError):
    return None


def partition(fn: Callable | None = None, *, mesh, hints: Hints | None = None,
              hardware: str | Hardware = "tpu-v4", budget: Budget | None = None,
              memory_limit: float | None = None, seed: int = 0,
              cache: bool | str | os.PathLike = True, search: str = "mcts",
              policy: str | os.PathLike = "uniform",
              donate_argnums: int | tuple[int, ...] = ()):
  """Partitions `fn` automatically over `mesh`.

  Use as `@automap.partition(mesh=mesh)` or `automap.partition(fn, mesh=mesh)`.
  Plans are cached on disk (`cache=True`: $AUTOMAP_CACHE_DIR, else
  ~/.cache/automap; a folder path; or False for none), keyed by the
  program, mesh, hardware, hints, budget, memory limit, seed, search
  policy and versions. `search` and `policy` are as for `automap.search`.
  `donate_argnums` donates arguments as `jax.jit` does (a train step's
  params and optimizer state, so the update happens in place).
  """
  make = functools.partial(Partitioned, mesh=mesh, hints=hints, hardware=hardware,
                           budget=budget, memory_limit=memory_limit, seed=seed,
                           cache=cache, search=search, policy=policy,
                           donate_argnums=donate_argnums)
  if fn is None:
    return make
  if not callable(fn):
    raise TypeError(f"partition expects a callable, got {type(fn).__name__}.")
  return make(fn)
