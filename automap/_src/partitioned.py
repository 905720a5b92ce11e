"""`automap.partition`: a function planned on its first call, then jitted."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from automap._src.cost.hardware import Hardware, get_hardware, on_mesh
from automap._src.ir import trace as trace_lib
from automap._src.plan import cache as cache_lib
from automap._src.plan import planner
from automap._src.plan.plan import Plan
from automap._src.run import apply as apply_lib
from automap._src.run import verify as verify_lib
from automap._src.run.check import compile_plan_for
from automap._src.search.request import SearchOptions, with_keywords
from automap._src.sharding.mesh import MeshError, MeshSpec
from automap._src.sharding.topology import compile_only

# INFO: each partitioned function's first call per signature, profiled.
_log = logging.getLogger("automap")


@dataclasses.dataclass
class _Entry:
  plan: Plan
  traced: trace_lib.Traced
  jitted: Any  # takes and returns the dynamic (array) leaves
  in_shardings: Any  # NamedShardings on the Auto view of the mesh
  out_shardings: Any  # NamedShardings on the user's mesh
  called: bool = False  # its first call (compile and first run) is done


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

  Args:
    fn: the step.
    mesh: a concrete `jax.sharding.Mesh`.
    hardware: a catalogue name or a `Hardware`; None as for `partition`.
    options: how to search (`SearchOptions`).
    cache: plans on disk, as `automap.partition` takes it.
    donate_argnums: arguments donated as `jax.jit` donates them.
    names: as for `automap.search`.
    layout: as for `automap.search`.
    layout_rules: as for `automap.search`.
    **search_options: `SearchOptions` fields, as keywords.

  Raises:
    automap.MeshError: `mesh` is abstract, or a pinned layout names an axis
      it lacks.
  """

  def __init__(self, fn: Callable, *, mesh: jax.sharding.Mesh,
               hardware: str | Hardware | None = None,
               options: SearchOptions | None = None,
               cache: bool | str | os.PathLike = True,
               donate_argnums: int | tuple[int, ...] = (), names: Any = None,
               layout: Any = None, layout_rules: Any = None, **search_options: Any):
    self._mesh_spec = MeshSpec.of(mesh)
    if not isinstance(mesh, jax.sharding.Mesh):
      raise MeshError(
          f"partition runs the program, so mesh must be a concrete "
          f"jax.sharding.Mesh with devices, got {type(mesh).__name__}; plan on "
          "an AbstractMesh with automap.search instead.")
    self.fn, self.mesh, self.names = fn, mesh, names
    self.layout, self.layout_rules = layout, layout_rules
    self._auto = apply_lib.auto_mesh(mesh)
    # Read once: a mesh's devices do not change, and calls are the hot path.
    self._compile_only = compile_only(mesh)
    self._signature = _signature_of(fn)
    self.request = with_keywords(SearchOptions, options, search_options, "partition")
    for pattern, spec in self.request.hints.fixed.items():
      for entry in spec:
        for name in entry if isinstance(entry, tuple) else (entry,):
          if name is not None:
            self._mesh_spec.axis_index(name, f"Hints.fixed[{pattern!r}]")
    self.hardware = on_mesh(get_hardware(hardware, mesh), mesh)
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
      # Checked before the search, so a wrong index costs no plan.
      if self.donate_argnums and max(self.donate_argnums) >= len(args):
        raise ValueError(
            f"donate_argnums={self.donate_argnums} names argument "
            f"{max(self.donate_argnums)}, but the call passes {len(args)} arguments.")
      t0 = time.perf_counter()
      # Once a trace needed numbers static, they are static for every call,
      # so a key and the program it finds agree on what the numbers are.
      traced = planner.trace(fn, args, self.mesh, numbers=None if self._numbers else False,
                               names=self.names)
      tracing = time.perf_counter() - t0
      if not traced.numbers_traced:  # The program reads its numbers concretely.
        self._numbers = False
        key, dynamic = self._key(args, fn)
      stated = planner.read_layout(traced, args, self._mesh_spec, self.layout,
                                   self.layout_rules,
                       self.request)
      plan = planner.plan(traced, self._mesh_spec, self.hardware, self.request, self._cache,
                          stated, self.layout is not None and self.layout is not False,
                          compile_plan_for(traced, self.mesh, args))
      plan.timings["plan"] = time.perf_counter() - t0
      plan.timings["trace"] = tracing
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
    if self._compile_only:
      raise MeshError(
          "partition: the mesh's devices are compile-only (a TPU topology from libtpu, "
          "automap.tpu_mesh): they compile a program but cannot run it. Plan and compile "
          "with step.lower(*args).compile(), or compare with automap.verify(..., "
          "check_numerics=False); run on a mesh of this machine's devices.")
    args, fn = self._positional(args, kwargs)
    entry, dynamic = self._entry(args, fn)
    t0 = time.perf_counter()
    with jax.set_mesh(self._auto):
      out = entry.jitted(*jax.device_put(dynamic, entry.in_shardings))
    if not entry.called:
      entry.called = True
      if _log.isEnabledFor(logging.INFO):
        # Waits for the first run only where the profile is asked for.
        jax.block_until_ready(out)
        entry.plan.timings["first_call"] = time.perf_counter() - t0
        _log.info("%s", first_call_profile(_name(self.fn), self.mesh, entry.plan))
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


def first_call_profile(name: str, mesh, plan: Plan) -> str:
  """One line of where a partitioned function's first call spent its
  seconds (`plan.timings`): tracing, the search (its refinement apart) or
  the plan cache, the rest of planning (the program's graph and prices,
  the checks), and the compile with the first run."""
  timings = plan.timings
  planning, trace = timings.get("plan", 0.0), timings.get("trace", 0.0)
  search = timings.get("search", 0.0)
  parts = [f"trace {trace:.2f} s"]
  if plan.stats.get("cached"):
    parts.append(f"plan read from the cache {planning - trace:.2f} s")
  else:
    parts += [f"search {search:.2f} s (refinement {timings.get('refine', 0.0):.2f} s)",
              f"the rest of planning {planning - trace - search:.2f} s"]
  if "first_call" in timings:
    parts.append(f"compile and first run {timings['first_call']:.2f} s")
  shape = "x".join(str(n) for n in dict(mesh.shape).values())
  return f"automap: {name} on a {shape} mesh, first call: " + ", ".join(parts)


def _name(fn: Callable) -> str:
  return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


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


def partition(fn: Callable | None = None, *, mesh: jax.sharding.Mesh,
              hardware: str | Hardware | None = None, options: SearchOptions | None = None,
              cache: bool | str | os.PathLike = True,
              donate_argnums: int | tuple[int, ...] = (), names: Any = None,
              layout: Any = None, layout_rules: Any = None,
              **search_options: Any) -> Partitioned | Callable[[Callable], Partitioned]:
  """Partitions `fn` automatically over `mesh`.

  Use as `@automap.partition(mesh=mesh)` or `automap.partition(fn, mesh=mesh)`.
  The first call with a new argument signature plans (or loads a cached
  plan) and compiles; later calls only run. Non-array leaves come back as
  they went in, as under `eqx.filter_jit`.

  Args:
    fn: the step (None when used as a decorator with arguments).
    mesh: a concrete `jax.sharding.Mesh` (Explicit or Auto axes).
    hardware: a catalogue name or a `Hardware`: the clock plans are ranked on;
      None: the entry of the mesh's devices where the catalogue knows them
      (a TPU slice from `automap.tpu_mesh`), else "tpu-v4".
    options: how to search, as for `automap.search` (each field also a
      keyword); the program's own `with_sharding_constraint`s are kept by
      default, as `jax.jit` keeps them.
    cache: plans on disk (True: $AUTOMAP_CACHE_DIR, else ~/.cache/automap;
      a folder; False: none), keyed by the program, mesh, hardware, search
      options and versions.
    donate_argnums: arguments donated as `jax.jit` donates them (a train
      step's params and optimizer state, updated in place).
    names: as for `automap.search`.
    layout: as for `automap.search`; by default "your layout" is what the
      first call's arguments state.
    layout_rules: as for `automap.search`.
    **search_options: `SearchOptions` fields, as keywords.

  Returns:
    A `Partitioned` function (a decorator when `fn` is None); `.plan` is the
    plan of its last call's signature.

  Raises:
    TypeError: `fn` is not callable, or an option of the wrong type.
    ValueError: an option out of range.
    automap.MeshError: at the first call, a mesh or a stated layout that
      does not fit the program.
    automap.MemoryLimitError: at the first call, no plan fits `memory_limit`.
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
