"""Plan making: a searched state turned into a `Plan`.

Pins every layout the rewritten program can name (so XLA partitions exactly
the state the cost model priced), records the reshards and collectives the
model expects, and prices the expert yardsticks beside it.
"""

from __future__ import annotations

from jax.sharding import PartitionSpec

from automap._src.cost.model import KINDS
from automap._src.cost.program import Program
from automap._src.cost.tracker import Tracker
from automap._src.ir import graph as graph_lib
from automap._src.ir.naming import layer_of
from automap._src.plan import report
from automap._src.plan.plan import Plan, Yardstick
from automap._src.search import tactics
from automap._src.search.driver import Found
from automap._src.search.request import MemoryLimitError
from automap._src.sharding.mesh import MeshError
from automap._src.sharding.state import State, spec_from_row, spec_of


def state_of(program: Program, plan: Plan) -> State:
  """The state a plan pins: its argument, result and intermediate layouts."""
  g = program.graph
  layouts = list(zip(g.inputs, plan.in_specs)) + list(plan.constraints.items())
  layouts += list(plan.inferred.items())
  layouts += [(v, s) for v, s in zip(g.outputs, plan.out_specs) if v >= 0]
  return program.pinned_state(layouts, "plan layout")


def make_plan(program: Program, state: State, stats: dict,
              memory_limit: float | None = None) -> Plan:
  """The plan of `state`: every layout the rewritten program pins, its
  predicted cost, per-layer report and the expert yardsticks beside it."""
  g, mesh = program.graph, program.mesh
  state = program.as_compiled(state)
  tracker = Tracker(program.model, state)
  op_costs = tracker.ops
  spec = lambda v: spec_of(state, mesh, v, g.rank(v)) if v >= 0 else PartitionSpec()  # noqa: E731
  # Every intermediate the rewritten program can name is pinned, so XLA
  # partitions exactly the state the cost model priced.
  # Values XLA makes anew in whatever layout their readers want (a
  # broadcast constant, an iota) are left to it: pinned, XLA may gather
  # the constant instead.
  free = program.model.free
  # A sealed call (custom derivatives, remat) is bound whole: its results
  # are pinned where it returns them, what it makes inside is left to XLA.
  named = ~g.sealed | g.bound
  constraints = {v: spec(v) for v in range(g.num_values)
                 if g.kind[v] == graph_lib.INTERMEDIATE and named[v]
                 and g.rank(v) > 0 and not free[v]}
  # Those it cannot name are recorded, so the plan re-prices as searched.
  inferred = {v: spec(v) for v in range(g.num_values)
              if g.kind[v] == graph_lib.INTERMEDIATE and not named[v]
              and g.rank(v) > 0 and not free[v]}
  # Operands entering an op in another layout are resharded explicitly, and
  # a result the op computes in another layout than its own is pinned to
  # that layout first: XLA then moves data the way the cost model priced,
  # not by a strategy of its own.
  reshards, natural = {}, {}
  for o in range(g.num_ops):
    results = g.results[o]
    if not results or g.sealed[results[0]]:
      continue
    for p, row in op_costs[o].reshards.items():
      v = g.operands[o][p]
      if not free[v]:
        reshards[(results[0], p)] = spec_from_row(row, mesh, g.rank(v))
    for v, row in zip(results, op_costs[o].natural):
      if row is not None and v in constraints and tuple(state[v]) != row:
        natural[v] = spec_from_row(row, mesh, g.rank(v))
  collectives: dict[tuple, list] = {}
  copies = set()  # a resharded copy is made once, for its first reader
  for o, c in enumerate(op_costs):
    for kind, mask, nbytes, _, position, target, _ in c.comms:
      if position >= 0:
        copy = program.model.copy_key(o, position, kind, mask, target, nbytes)
        if copy in copies:
          continue
        copies.add(copy)
      axes = tuple(n for a, n in enumerate(mesh.axis_names) if mask >> a & 1)
      key = (layer_of(g.scopes[o], depth=8), kind, axes)
      acc = collectives.setdefault(key, [0.0, 0])
      acc[0] += nbytes
      acc[1] += 1
  return Plan(
      mesh=mesh, hardware=program.hardware, fingerprint=g.fingerprint,
      in_paths=program.traced.in_paths, out_paths=program.traced.out_paths,
      in_shapes=tuple(tuple(a.shape) for a in program.traced.in_avals),
      in_specs=tuple(spec(v) for v in g.inputs),
      out_specs=tuple(spec(v) for v in g.outputs),
      constraints=constraints, reshards=reshards, natural=natural,
      inferred=inferred, cost=tracker.cost(),
      collectives=tuple((s, KINDS[k], a, b, n)
                        for (s, k, a), (b, n) in collectives.items()),
      program_constraints=program.constraints, stats=stats, memory_limit=memory_limit,
      layers=report.layers(program, tracker), yardsticks=yardsticks(program, state),
      tree_paths=program.traced.tree_paths,
      in_tree=program.traced.in_tree, out_tree=program.traced.out_tree)


# The yardstick of the program as written, where it or its arguments state
# a layout.
USER_LAYOUT = "your layout"


def yardsticks(program: Program, state: State) -> dict[str, Yardstick]:
  """The expert strategies' costs (and the program's own layout's, where
  it states one), and where their argument layouts differ from `state`'s."""
  g, mesh = program.graph, program.mesh
  out = {}
  others = dict(tactics.yardsticks(program))
  if program.has_user_layout:
    try:
      others[USER_LAYOUT] = program.user_layout()
    except MeshError:  # Ignored constraints for another mesh: nothing to price.
      pass
  for name, other in others.items():
    differs = {}
    for v, path in zip(g.inputs, program.traced.in_paths):
      if (state[v] != other[v]).any():
        differs[path] = spec_of(other, mesh, v, g.rank(v))
    out[name] = Yardstick(Tracker(program.model, other).cost(), differs)
  return out


def plan_of(program: Program, found: Found, memory_limit: float | None) -> Plan:
  """The plan of a search's result; a MemoryLimitError if its best is over
  the limit."""
  if found.score[0] > 0:
    saved = program.saved_lower_bound()
    bound = max(program.memory_lower_bound(), saved)
    why = ("" if saved < memory_limit else
           f" The activations the backward reads alone need {saved:,.0f} bytes per device "
           f"spread over all {program.mesh.num_devices} devices: rematerialise them "
           "(jax.checkpoint), shorten the batch or sequence per device, or use more devices.")
    raise MemoryLimitError(
        f"no plan found within memory_limit={memory_limit:,.0f} bytes per "
        f"device: the best found needs "
        f"{memory_limit + found.score[0]:,.0f} bytes (lower bound "
        f"{bound:,.0f}). Raise the limit, use more "
        "devices, or give a larger search budget." + why)
  stats = dict(found.stats, graph_values=program.graph.num_values,
               graph_ops=program.graph.num_ops)
  plan = make_plan(program, found.state, stats, memory_limit)
  plan.timings.update(found.timings)
  return plan
