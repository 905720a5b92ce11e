"""The compiled program as referee: a layout compiled as a user writes it
and XLA's own accounting of it, beside automap's prices.

`compile_layout` jits a step with only its argument shardings (XLA
propagates the rest); `referee` reads its time (XLA's FLOPs and bytes at
the hardware's peaks, a ring per compiled collective each time it runs)
and peak memory; `expert_specs` lays out the hand-written experts from
automap's tactics.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding

from automap._src.cost.collectives import KINDS, ring_seconds
from automap._src.cost.compiler import compiler_for
from automap._src.cost.model import CostModel
from automap._src.cost.tracker import Tracker
from automap._src.plan import planner
from automap._src.run import apply as apply_lib
from automap._src.run.compiled import collectives, compiled_costs, compiled_memory
from automap._src.search import tactics
from automap._src.search.actions import ActionSpace
from automap._src.sharding.state import spec_of

# `tactics.EXPERTS` as the referee names them.
EXPERT_NAMES = {"data parallel": "data parallel", "Megatron+DP": "Megatron + DP",
                 "FSDP": "FSDP"}

def referee(compiled, mesh, hw) -> dict:
  """The compiled program's own accounting: seconds of compute (XLA's
  FLOPs at the float32 peak plus its bytes accessed at HBM bandwidth), of
  communication (a ring per compiled collective over its group, each time
  it runs: a loop's every trip) and the
  compiled peak bytes per device."""
  costs = compiled_costs(compiled)
  flops, accessed = float(costs.get("flops", 0.0)), float(costs.get("bytes accessed", 0.0))
  sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
  comm = 0.0
  for c in collectives(compiled.as_text(), mesh):
    n = int(np.prod([sizes[a] for a in c.axes])) if c.axes else 1
    if n > 1:
      comm += c.trips * ring_seconds(KINDS.index(c.kind), c.nbytes, n, hw.link_bandwidth,
                                     hw.link_latency)
  compute = flops / hw.fp32_flops + accessed / hw.hbm_bandwidth
  return {"time": compute + comm, "compute": compute, "comm": comm,
          "peak": compiled_memory(compiled)[0], "bytes": accessed}


def expert_specs(step, mesh, hw) -> tuple[dict, object]:
  """Each expert's argument specs, from automap's tactics (the states
  `tactics.expert_states` builds, as its yardsticks use), and their cost
  priced as `evaluate` prices a hand-written layout (its argument specs,
  the rest propagated): under `hw` (the clock that ranks them) and under
  XLA:CPU's compiler (what the program compiled here is checked against)."""
  program = planner.build_program(step.fn, step.args, mesh, hw, names=step.names)
  on_cpu = CostModel(program.graph, program.mesh, hw, compiler_for("cpu"))
  g = program.graph
  out = {}
  for name, state in tactics.expert_states(program, ActionSpace(program)).items():
    if name not in EXPERT_NAMES:
      continue
    specs = [spec_of(state, program.mesh, v, g.rank(v)) for v in g.inputs]
    layout = program.state_from_specs(specs)
    out[EXPERT_NAMES[name]] = (specs, Tracker(program.model, layout).cost(),
                                Tracker(on_cpu, layout).cost())
  return out, program.traced


def compile_layout(traced, mesh, specs, args):
  """`jax.jit` of the step with these argument shardings only, as a user
  writes a layout by hand; XLA propagates the rest."""
  auto = apply_lib.auto_mesh(mesh)
  shardings = jax.tree.unflatten(traced.in_tree, [NamedSharding(auto, s) for s in specs])
  with jax.set_mesh(auto):
    jitted = jax.jit(traced.dynamic_fn(), in_shardings=shardings)
    return jitted.lower(*apply_lib.abstract_args(traced.dynamic_args(args))).compile()


__all__ = ["EXPERT_NAMES", "compile_layout", "expert_specs", "referee"]
