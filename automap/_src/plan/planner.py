"""The planning sequence: a traced step -> `Program` -> search -> `Plan`.

Every caller that turns a step into a plan goes through here: the public
API (`search`, `partition`, the `devices=` mesh choice), evaluation of a
stated layout, cluster planning's per-width searches (`searcher`,
`state_on`), policy training and the benchmarks. `run` is the library's one
call of the search driver.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from automap._src.cost.hardware import Hardware, get_hardware, on_mesh
from automap._src.cost.program import Program
from automap._src.ir import constraints as constraints_lib
from automap._src.ir import graph as graph_lib
from automap._src.ir import trace as trace_lib
from automap._src.plan import build, guard
from automap._src.plan import cache as cache_lib
from automap._src.plan.plan import Plan
from automap._src.search import driver, tactics
from automap._src.search.request import Budget, Hints, SearchOptions, bytes_per_device
from automap._src.sharding import annotations
from automap._src.sharding.annotations import Layout, LayoutWarning
from automap._src.sharding.mesh import MeshError, MeshSpec

# Axis names of the meshes `plan_on_devices` tries.
AXIS_NAMES = ("x", "y", "z")


def build_program(fn: Callable, args: tuple, mesh, hardware: str | Hardware,
                  hints: Hints | None = None, constraints: str = constraints_lib.KEEP,
                  names=None) -> Program:
  """The program a search reads: `fn(*args)` traced on `mesh`.

  Args:
    fn, args: the step and its arguments (arrays or ShapeDtypeStructs).
    mesh: a `jax.sharding.Mesh`, an `AbstractMesh` or a `MeshSpec`.
    hardware: a catalogue name or a `Hardware`.
    hints: pinned layouts (`Hints.fixed`) the search keeps.
    constraints: what to do with the program's own constraints.
    names: argument leaf names where their paths do not say (`search`).

  Returns:
    The `Program`: its graph, cost model and pins.
  """
  spec = MeshSpec.of(mesh)  # Checked before the trace uses it.
  traced = trace(fn, args, mesh, names=names)
  return Program.build(traced, spec, on_mesh(get_hardware(hardware), mesh),
                       (hints or Hints()).fixed,
                       constraints=constraints)


def read_layout(traced: trace_lib.Traced, args: tuple, mesh: MeshSpec, layout, rules,
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


def program_for(traced: trace_lib.Traced, mesh: MeshSpec, hardware: Hardware,
                request: SearchOptions, layout: Layout | None = None,
                explicit: bool = False) -> Program:
  """The program a search reads, with the arguments' stated `layout` where
  it fits the mesh; where it does not, an error if the user gave it
  (`explicit`) or asked to start from it, else a LayoutWarning and none."""
  program = Program.build(traced, mesh, hardware, request.hints.fixed,
                          constraints=request.constraints, layout=layout)
  try:
    program.check_layout()
  except MeshError as e:
    _unread(e, explicit or request.start == "your layout")
    return program.without_layout()
  return program


def plan(traced: trace_lib.Traced, mesh: MeshSpec, hardware: Hardware,
         request: SearchOptions, store: cache_lib.PlanCache | None = None,
         layout: Layout | None = None, explicit: bool = False,
         compile_plan: guard.CompilePlan | None = None) -> Plan:
  """The plan of `traced` on `mesh`.

  Args:
    traced: the traced step.
    mesh, hardware: where it runs.
    request: how to search (`SearchOptions`).
    store: a plan cache: its plan for this search if it holds one (tied to
      the program's argument and result structure), else a fresh search,
      stored there.
    layout, explicit: the layout the arguments state, and whether the user
      gave it (`program_for`).
    compile_plan: compiles a plan for the concrete mesh, where
      `request.verify` is "compile" (`guard.fit_by_compile`).

  Returns:
    The `Plan`.

  Raises:
    automap.MeshError: verify="compile" without a concrete mesh to compile on.
  """
  if request.verify == "compile" and compile_plan is None:
    raise MeshError("verify='compile' compiles the plan, so it needs a concrete mesh: "
                    "a jax.sharding.Mesh of devices, or automap.tpu_mesh('v5p-256', ...) "
                    "for a TPU slice on any machine.")
  if store is not None:
    k = cache_lib.key(traced.fingerprint(), mesh, hardware, request,
                      traced.in_paths + traced.out_paths,
                      "" if layout is None or not layout.stated else layout.digest())
    cached = store.load(k, traced.fingerprint(), mesh)
    if cached is not None:
      return dataclasses.replace(cached, stats=dict(cached.stats, cached=True),
                                 in_tree=traced.in_tree, out_tree=traced.out_tree)
  request = request.resolved(hardware)
  program = program_for(traced, mesh, hardware, request, layout, explicit)
  searched = run(program, request)
  found = build.plan_of(program, searched, request.memory_limit)
  if request.verify == "compile":
    limit = request.memory_limit if request.memory_limit is not None else hardware.hbm_capacity
    found = guard.fit_by_compile(program, searched, found, limit, request.verify_plans,
                                 compile_plan)
  if store is not None:
    store.store(k, found)
  return found


def plan_on_devices(traced: trace_lib.Traced, args: tuple, devices: int,
                    hardware: Hardware, request: SearchOptions, layout=None,
                    layout_rules=None) -> Plan:
  """The best plan over the 1-3 axis meshes of `devices` devices
  (`driver.mesh_shapes`: every one up to 64 devices, the shapes practice
  uses above; axes `AXIS_NAMES`), the budget shared between the shapes; a
  stated `layout` is priced on the shapes whose axes it names."""
  request = request.resolved(hardware)
  shapes = driver.mesh_shapes(int(devices), hardware)
  b = request.budget
  share = dataclasses.replace(request, budget=dataclasses.replace(
      b, episodes=max(1, b.episodes // len(shapes)), seconds=b.seconds / len(shapes)))
  best = None
  for shape in shapes:
    on = MeshSpec(AXIS_NAMES[:len(shape)], shape)
    try:
      stated = None if layout is False else annotations.read(
          traced.dynamic_args(args), traced.in_paths, on, layout, layout_rules)
    except MeshError:
      stated = None
    program = Program.build(traced, on, hardware, request.hints.fixed,
                            constraints=request.constraints, layout=stated)
    try:
      program.check_layout()
    except MeshError:
      program = program.without_layout()
    found = run(program, share)
    if best is None or found.score < best[1].score:
      best = (program, found)
  return build.plan_of(*best, request.memory_limit)


def run(program: Program, request: SearchOptions, policy=None) -> driver.Found:
  """The search `request` asks for on `program` (`driver.run`, which
  resolves its memory_limit against the program's hardware)."""
  return driver.run(program, request, policy)


def trace(fn: Callable, args: tuple, mesh=None, **options) -> trace_lib.Traced:
  """`fn(*args)` traced (on `mesh` where given): the first step of every
  plan. `options` as `ir.trace.trace` takes them (`names`, `numbers`)."""
  return trace_lib.trace(fn, args, mesh, **options)


def searcher(budget: Budget | None, seed: int = 0,
             memory_limit: float | str | None = "device") -> Callable[[Program], np.ndarray]:
  """`search(program) -> state`: the sharding search's plan under `budget`
  and `memory_limit` (bytes per device for the whole traced step, as
  `SearchOptions` reads it), or everything whole on one device. Its `key`
  says what `state_on`'s cache keys the search by."""
  request = SearchOptions(budget=budget, seed=seed, memory_limit=memory_limit)

  def search(program: Program) -> np.ndarray:
    if program.mesh.num_devices == 1:
      return program.initial_state()
    return run(program, request).state

  def scaled(share: float, hardware: Hardware) -> Callable[[Program], np.ndarray]:
    """The same search for a part of the step holding `share` of its
    bytes: its memory limit (on `hardware`) scaled by `share`."""
    limit = bytes_per_device(memory_limit, hardware)
    return searcher(budget, seed, None if limit is None else limit * share)

  search.key = (budget, seed, memory_limit)
  search.scaled = scaled
  return search


def megatron(program: Program) -> np.ndarray:
  """Megatron-LM's layout of `program` over its mesh's last axis
  (`tactics.megatron_layout`, with the program's pins), as a search
  callable (`program -> state`, for `state_on`): what an expert states for
  a tensor-parallel width, priced beside the search's plan."""
  return tactics.megatron_layout(program)


# Searched states by (program digest, mesh, hardware, search, pins):
# pricing several splits of one model (price_cluster per config,
# plan_cluster beside it) searches each width once, and alike (a wall-clock
# budget would not). Only states are kept: the program is built from each
# call's trace, whose name scopes the digest does not cover.
SEARCHED: OrderedDict[tuple, np.ndarray] = OrderedDict()
SEARCHED_MAX = 16


def state_on(traced: trace_lib.Traced, mesh: MeshSpec, hardware: Hardware,
             search: Callable[[Program], np.ndarray], *, graph: graph_lib.Graph | None = None,
             pins: Sequence = (), pinned_by: str = "", reuse: np.ndarray | None = None,
             key: tuple = ()) -> tuple[Program, np.ndarray]:
  """(program, state) of `traced` on `mesh`: `search`'s state, or `reuse`
  (a state searched at another batch size) where it divides the shapes.

  Args:
    traced, graph: the traced step and its graph (`trace`; built if None).
    mesh, hardware: where it runs.
    search: `searcher`'s callable, or any program -> state; one with a
      `key` is cached in `SEARCHED` under it, `key` and the mesh.
    pins: (value, PartitionSpec) the search keeps, `pinned_by` naming why.
    reuse: a state to take instead of searching where it fits.
    key: what else the state depends on (the caller's choices).

  Returns:
    The program (with `pins`) and its state.
  """
  program = Program.build(traced, mesh, hardware, graph=graph)
  if pins:
    program = program.with_pins(list(pins), pinned_by)
  cache = None
  if getattr(search, "key", None) is not None:
    cache = (traced.fingerprint(), mesh, hardware, search.key, *key)
    try:
      hash(cache)
    except TypeError:  # an unhashable hardware: no cache
      cache = None
  if cache is not None and cache in SEARCHED:
    SEARCHED.move_to_end(cache)
    return program, SEARCHED[cache].copy()
  if reuse is not None and divides_shapes(program, reuse):
    return program, reuse
  state = search(program)
  if cache is not None:
    SEARCHED[cache] = state.copy()
    while len(SEARCHED) > SEARCHED_MAX:
      SEARCHED.popitem(last=False)
  return program, state


def divides_shapes(program: Program, state: np.ndarray) -> bool:
  """Whether every tiled dimension of `state` divides on `program`'s shapes."""
  g, sizes = program.graph, program.mesh.axis_sizes
  if state.shape[0] != g.num_values:
    return False
  for v, a in zip(*np.nonzero(state >= 0)):
    if g.shapes[v][state[v, a]] % sizes[a]:
      return False
  return True


def plan_of_state(program: Program, state: np.ndarray) -> Plan:
  """The `Plan` of a state found for `program` (`state_on`)."""
  return build.make_plan(program, state, {})


__all__ = ["AXIS_NAMES", "SEARCHED", "build_program", "divides_shapes", "megatron", "plan",
           "plan_of_state", "plan_on_devices", "program_for", "read_layout", "run", "searcher",
           "state_on", "trace"]
