"""The public entry points: partition, search, evaluate, verify."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from automap._src.cost.hardware import Hardware, get_hardware
from automap._src.cost.model import Cost
from automap._src.cost.tracker import Tracker
from automap._src.ir import trace as trace_lib
from automap._src.plan import build
from automap._src.plan import cache as cache_lib
from automap._src.plan.plan import Plan
from automap._src.run import apply as apply_lib
from automap._src.run import verify as verify_lib
from automap._src.search import driver
from automap._src.search.driver import mesh_shapes
from automap._src.search.program import Program
from automap._src.search.request import Budget, SearchOptions, with_keywords
from automap._src.sharding import annotations
from automap._src.sharding.annotations import Layout, LayoutWarning
from automap._src.sharding.mesh import MeshError, MeshSpec
from automap._src.sharding.state import flat_specs


def _layout(traced: trace_lib.Traced, args: tuple, mesh: MeshSpec, layout, rules,
            request: SearchOptions) -> Layout | None:
  """The layout `args` state on `mesh` (`sharding/annotations.py`), None if
  none or `layout=False`. One that cannot be read is an error where it was
  asked for (`layout=` given, or `start="your layout"`), else a
  LayoutWarning: it is then neither priced nor a start."""
  if layout is False:
    return None
  try:
    return annotations.read(traced.dynamic_args(args), traced.in_paths, mesh, layout, rules)
  except MeshError as e:
    _unread(e, layout is not None or request.start == "your layout")
    return None


def _unread(error: MeshError, asked: bool) -> None:
  """An unreadable layout: the error where it was asked for, else a warning."""
  if asked:
    raise error
  warnings.warn(LayoutWarning(
      f"the arguments' own layout is not priced beside the plan: {error} "
      "(layout=False stops automap reading it)"), stacklevel=5)


def _program(traced, mesh: MeshSpec, hardware: Hardware, request: SearchOptions,
             layout: Layout | None, explicit: bool) -> Program:
  """The program a search reads, with the arguments' layout where it fits
  the mesh (else as `_layout` says)."""
  program = Program.build(traced, mesh, hardware, request.hints.fixed,
                          constraints=request.constraints, layout=layout)
  try:
    program.check_layout()
  except MeshError as e:
    _unread(e, explicit or request.start == "your layout")
    program.layout = None
  return program


def _plan(traced: trace_lib.Traced, mesh: MeshSpec, hardware: Hardware,
          request: SearchOptions, store: cache_lib.PlanCache | None,
          layout: Layout | None = None, explicit: bool = False) -> Plan:
  """The plan `store` holds for this search (tied to the program's argument
  and result structure), else a fresh search, stored."""
  if store is not None:
    k = cache_lib.key(traced.fingerprint(), mesh, hardware, request,
                      traced.in_paths + traced.out_paths,
                      "" if layout is None or not layout.stated else layout.digest())
    plan = store.load(k, traced.fingerprint(), mesh)
    if plan is not None:
      return dataclasses.replace(plan, stats=dict(plan.stats, cached=True),
                                 in_tree=traced.in_tree, out_tree=traced.out_tree)
  request = request.resolved(hardware)
  program = _program(traced, mesh, hardware, request, layout, explicit)
  plan = build.plan_of(program, driver.run(program, request), request.memory_limit)
  if store is not None:
    store.store(k, plan)
  return plan


_AXIS_NAMES = ("x", "y", "z")


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
    return _plan(traced, spec, get_hardware(hardware), request,
                 None if folder is None else cache_lib.PlanCache(folder),
                 _layout(traced, args, spec, layout, layout_rules, request),
                 layout is not None and layout is not False)
  if (not isinstance(devices, (int, np.integer)) or isinstance(devices, bool)
      or devices < 1):
    raise ValueError(f"devices must be a positive integer, got {devices!r}.")
  traced = trace_lib.trace(fn, args, names=names)
  hw = get_hardware(hardware)
  request = request.resolved(hw)
  shapes = mesh_shapes(int(devices))
  b = request.budget
  share = dataclasses.replace(request, budget=Budget(
      max(1, b.episodes // len(shapes)), b.seconds / len(shapes), b.progress))
  best = None
  for shape in shapes:
    on = MeshSpec(_AXIS_NAMES[:len(shape)], shape)
    # A stated layout names the axes of some mesh: priced on the shapes it fits.
    try:
      stated = None if layout is False else annotations.read(
          traced.dynamic_args(args), traced.in_paths, on, layout, layout_rules)
    except MeshError:
      stated = None
    program = Program.build(traced, on, hw, request.hints.fixed,
                            constraints=request.constraints, layout=stated)
    try:
      program.check_layout()
    except MeshError:
      program.layout = None
    found = driver.run(program, share)
    if best is None or found.score < best[1].score:
      best = (program, found)
  return build.plan_of(*best, request.memory_limit)


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
  program = driver.build_program(fn, args, mesh, hardware, constraints=constraints,
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


@dataclasses.dataclass
class _Entry:
  plan: Plan
  traced: trace_lib.Traced
  jitted: Any  # takes and returns the dynamic (array) leaves
  in_shardings: Any  # NamedShardings on the Auto view of the mesh
  out_shardings: Any  # NamedShardings on the user's mesh


class Partitioned:
  """A function partitioned by automap; behaves like a jitted function.

  The first call with a new argument signature traces, searches and
  compiles; later calls with that signature reuse the plan. Results come
  back sharded on the user's mesh. Arguments in `donate_argnums` are donated
  as `jax.jit` donates them: their buffers may back the results.

  Non-array leaves of the arguments (an equinox model's functions, config
  objects, strings) are static, as under `eqx.filter_jit`: a new static
  value is a new signature. So are Python numbers where the program needs
  them concretely; elsewhere they are traced as `jax.jit` traces them.
  """

  def __init__(self, fn: Callable, *, mesh, hardware: str | Hardware = "tpu-v4",
               options: SearchOptions | None = None,
               cache: bool | str | os.PathLike = True,
               donate_argnums: int | tuple[int, ...] = (), names=None, layout=None,
               layout_rules=None, **search_options):
    self._mesh_spec = MeshSpec.of(mesh)
    if not isinstance(mesh, jax.sharding.Mesh):
      raise MeshError(
          f"partition runs the program, so mesh must be a concrete "
          f"jax.sharding.Mesh with devices, got {type(mesh).__name__}; plan on "
          "an AbstractMesh with automap.search instead.")
    self.fn, self.mesh, self.names = fn, mesh, names
    self.layout, self.layout_rules = layout, layout_rules
    self._auto = apply_lib.auto_mesh(mesh)
    self._signature = _signature_of(fn)
    self.request = with_keywords(SearchOptions, options, search_options, "partition")
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
    self._numbers = True  # Python numbers traced, until a trace needs them static
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

  def _key(self, args: tuple, fn: Callable) -> tuple[tuple, tuple]:
    """(signature key, dynamic arguments) of a call."""
    dynamic, static = trace_lib.split(args, numbers=self._numbers)
    _, tree, _, avals = trace_lib.flatten_args(dynamic)
    return (fn is self.fn, trace_lib.signature_of(tree, avals, static)), dynamic

  def _entry(self, args: tuple, fn: Callable) -> tuple[_Entry, tuple]:
    """The entry for this call's signature (planned if new) and the call's
    dynamic arguments."""
    key, dynamic = self._key(args, fn)
    entry = self._entries.get(key)
    if entry is None:
      t0 = time.perf_counter()
      # Once a trace needed numbers static, they are static for every call,
      # so a key and the program it finds agree on what the numbers are.
      traced = trace_lib.trace(fn, args, self.mesh, numbers=None if self._numbers else False,
                               names=self.names)
      if not traced.numbers_traced:  # The program reads its numbers concretely.
        self._numbers = False
        key, dynamic = self._key(args, fn)
      stated = _layout(traced, args, self._mesh_spec, self.layout, self.layout_rules,
                       self.request)
      plan = _plan(traced, self._mesh_spec, self.hardware, self.request, self._cache,
                   stated, self.layout is not None and self.layout is not False)
      plan.timings["plan"] = time.perf_counter() - t0
      if self.donate_argnums and max(self.donate_argnums) >= len(args):
        raise ValueError(
            f"donate_argnums={self.donate_argnums} names argument "
            f"{max(self.donate_argnums)}, but the call passes {len(args)} arguments.")
      jitted = apply_lib.jit_with_plan(traced, self.mesh, plan, self.donate_argnums)
      outs = jax.tree.unflatten(traced.out_tree, [
          NamedSharding(self.mesh, s) for s in plan.out_specs])
      entry = _Entry(plan, traced, jitted,
                     apply_lib.plan_shardings(self.mesh, plan.in_specs, traced.in_tree),
                     outs)
      self._entries[key] = entry
    self._last = entry
    return entry, dynamic

  def __call__(self, *args, **kwargs):
    args, fn = self._positional(args, kwargs)
    entry, dynamic = self._entry(args, fn)
    with jax.set_mesh(self._auto):
      out = entry.jitted(*jax.device_put(dynamic, entry.in_shardings))
    if self._auto is not self.mesh:
      out = jax.device_put(out, entry.out_shardings)  # Same devices: no copy.
    return entry.traced.results(out, dynamic)

  def lower(self, *args, **kwargs):
    """The partitioned program lowered for these arguments (their array
    leaves: the static ones are part of the program)."""
    args, fn = self._positional(args, kwargs)
    entry, dynamic = self._entry(args, fn)  # Traced outside the mesh context, like calls.
    with jax.set_mesh(self._auto):
      return entry.jitted.lower(*apply_lib.abstract_args(dynamic))

  def verify(self, *args, check_numerics: bool = True, **kwargs) -> verify_lib.Report:
    """`automap.verify` of the plan for these arguments (planned first if
    their signature is new): compiled collectives and memory against the
    prediction, and the numerics against the unpartitioned function."""
    args, fn = self._positional(args, kwargs)
    entry, _ = self._entry(args, fn)
    return verify_lib.verify(entry.plan, fn, args, self.mesh, check_numerics, self.names)

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


def partition(fn: Callable | None = None, *, mesh, hardware: str | Hardware = "tpu-v4",
              options: SearchOptions | None = None, cache: bool | str | os.PathLike = True,
              donate_argnums: int | tuple[int, ...] = (), names=None, layout=None,
              layout_rules=None, **search_options):
  """Partitions `fn` automatically over `mesh`.

  Use as `@automap.partition(mesh=mesh)` or `automap.partition(fn, mesh=mesh)`.
  `options` (or its fields as keywords: hints, budget, memory_limit, seed,
  search, policy, constraints) says how to search, as for `automap.search`;
  the program's own `with_sharding_constraint`s are kept by default (the
  plan respects them, as `jax.jit` would). Plans are
  cached on disk (`cache=True`: $AUTOMAP_CACHE_DIR, else ~/.cache/automap; a
  folder path; or False for none), keyed by the program, mesh, hardware,
  search options and versions. `donate_argnums` donates arguments as
  `jax.jit` does (a train step's params and optimizer state, so the update
  happens in place). `names` names argument leaves, and `layout` /
  `layout_rules` say what "your layout" is, as for `automap.search`: by
  default the layout the first call's arguments state.
  """
  # Checked now, not at the first call, so a decorator fails where it is written.
  request = with_keywords(SearchOptions, options, search_options, "partition")
  make = functools.partial(Partitioned, mesh=mesh, hardware=hardware, options=request,
                           cache=cache, donate_argnums=donate_argnums, names=names,
                           layout=layout, layout_rules=layout_rules)
  if fn is None:
    return make
  if not callable(fn):
    raise TypeError(f"partition expects a callable, got {type(fn).__name__}.")
  return make(fn)
