"""The compiled program as referee: a layout compiled as a user writes it
and XLA's own accounting of it, beside automap's prices.

`compile_layout` jits a step with only its argument shardings (XLA
propagates the rest); `compile_plan` compiles automap's plan of it;
`referee` reads a compiled program's time (XLA's FLOPs and bytes at the
hardware's peaks, a ring per compiled collective each time it runs) and
peak memory; `expert_specs` lays out the hand-written experts from
automap's tactics.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from automap._src.cost.collectives import KINDS, ring_seconds
from automap._src.cost.compiler import compiler_for
from automap._src.cost.hardware import Hardware
from automap._src.cost.model import Cost, CostModel
from automap._src.cost.tracker import Tracker
from automap._src.ir.trace import Traced
from automap._src.plan import planner
from automap._src.plan.plan import Plan
from automap._src.run import apply as apply_lib
from automap._src.run.compiled import (
  collectives,
  compiled_costs,
  compiled_memory,
  compiled_seconds,
)
from automap._src.search import tactics
from automap._src.search.actions import ActionSpace
from automap._src.sharding.state import spec_of

# `tactics.EXPERTS` as the referee names them.
EXPERT_NAMES = {"data parallel": "data parallel", "Megatron+DP": "Megatron + DP",
                 "FSDP": "FSDP"}

def referee(compiled: jax.stages.Compiled, mesh: Mesh, hw: Hardware) -> dict[str, float]:
  """The compiled program's own accounting, the same for every layout.

  A serial estimate: compute is XLA's FLOPs at the float32 peak plus its
  bytes accessed at HBM bandwidth (`cost_analysis()`, after fusion);
  communication a textbook ring per compiled collective over its group,
  each time it runs (a loop's every trip); nothing overlapped.

  Args:
    compiled: the compiled program (`compile_layout`, `compile_plan`, or
      `jax.jit(f).lower(...).compile()`).
    mesh: the mesh it was compiled on.
    hw: the device whose peaks and links price it (`automap.HARDWARE[name]`).

  Returns:
    {"time": compute + comm, "compute": seconds, "comm": seconds, "peak":
    compiled peak bytes per device (`compiled_memory`), "bytes": bytes
    accessed per device, "estimate": the backend's own time estimate in
    seconds (`compiled_seconds`: XLA:TPU's; nan where it gives none)}.

  Raises:
    ValueError: a replica group names a device `mesh` lacks (the program
      was compiled on another mesh).
  """
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
  estimate = compiled_seconds(compiled)
  return {"time": compute + comm, "compute": compute, "comm": comm,
          "peak": compiled_memory(compiled)[0], "bytes": accessed,
          "estimate": float("nan") if estimate is None else estimate}


def expert_specs(step: Any, mesh: Mesh, hw: Hardware,
                 ) -> tuple[dict[str, tuple[list[PartitionSpec], Cost, Cost]], Traced]:
  """The hand-written experts' argument layouts of a step, and their prices.

  The layouts are automap's tactics on the step (data parallelism over
  every axis, Megatron + data parallelism, FSDP), read back as argument
  PartitionSpecs; each is priced as `automap.evaluate` prices a layout
  written by hand (its argument specs, the rest propagated).

  Args:
    step: the step: an object with `fn` (the step function), `args` (its
      arguments) and `names` (as `automap.search` takes them, or None).
    mesh: the mesh to lay it out on.
    hw: the device that prices the layouts (`automap.HARDWARE[name]`).

  Returns:
    ({"data parallel" | "Megatron + DP" | "FSDP": (argument specs, cost
    under `hw`, cost under XLA:CPU's compiler, what a program compiled on
    this host is checked against)}, the traced step, for `compile_layout`
    and `compile_plan`). Experts the mesh or program does not admit are
    left out.

  Raises:
    automap.MeshError: `mesh` is no mesh automap plans on.
  """
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


def compile_layout(traced: Traced, mesh: Mesh, specs: Sequence[PartitionSpec],
                   args: tuple) -> jax.stages.Compiled:
  """The step compiled with these argument shardings only, as a user writes
  a layout by hand (`jax.jit(in_shardings=...)`); XLA propagates the rest.

  Args:
    traced: the traced step (`expert_specs` returns it).
    mesh: the mesh the specs name axes of; compiled on its Auto view.
    specs: one PartitionSpec per array leaf of the arguments, in flattened
      order.
    args: the step's arguments (arrays or ShapeDtypeStructs).

  Returns:
    The compiled program.

  Raises:
    ValueError: `specs` are not one per array leaf of `args`, or a spec
      does not fit its argument (more dimensions than it has).
  """
  auto = apply_lib.auto_mesh(mesh)
  shardings = jax.tree.unflatten(traced.in_tree, [NamedSharding(auto, s) for s in specs])
  with jax.set_mesh(auto):
    jitted = jax.jit(traced.dynamic_fn(), in_shardings=shardings)
    return jitted.lower(*apply_lib.abstract_args(traced.dynamic_args(args))).compile()


def compile_plan(traced: Traced, mesh: Mesh, plan: Plan, args: tuple) -> jax.stages.Compiled:
  """automap's plan of the step compiled, as `automap.partition` runs it
  (the plan's argument and result shardings and its constraints).

  Args:
    traced: the traced step (`expert_specs` returns it).
    mesh: a concrete mesh of the plan's shape; compiled on its Auto view.
    plan: an `automap.Plan` of the step for these arguments.
    args: the step's arguments (arrays or ShapeDtypeStructs).

  Returns:
    The compiled program.

  Raises:
    ValueError: `args` are not of the structure `traced` was traced with.
  """
  return apply_lib.compile_with_plan(traced, mesh, plan, args)


__all__ = ["EXPERT_NAMES", "compile_layout", "compile_plan", "expert_specs", "referee"]
