"""`automap demo`: partition a GPT training step and compare with Megatron.

Plans the step on a (data, model) mesh of simulated CPU devices, prints the
plan beside hand-written Megatron + data parallelism (and pure data
parallelism) priced by the same cost model, runs one partitioned step and
checks it against the unpartitioned step and the compiled collectives.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import jax
import numpy as np
from jax.sharding import PartitionSpec
from rich.console import Console
from rich.table import Table

import automap
from automap._src.ir.naming import layer_of
from automap._src.models.gpt import GPTConfig, make_train_step, megatron_specs
from automap._src.plan.explain import format_spec


@dataclasses.dataclass(frozen=True)
class DemoConfig:
  model: GPTConfig = GPTConfig(vocab=512, seq=128, hidden=512, heads=8, layers=4)
  batch: int = 32
  mesh: tuple[int, int] = (4, 2)
  hardware: str = "tpu-v4"
  seconds: float = 60.0


def _ms(seconds: float) -> str:
  return f"{seconds * 1e3:.3f}"


def _mib(nbytes: float) -> str:
  return f"{nbytes / 2**20:.1f}"


def run(cfg: DemoConfig, console: Console | None = None) -> dict:
  """Plans the demo's step, prints the plan beside the experts, runs one
  partitioned step and checks it; returns whether it checks out ("ok"),
  the plan's step time over Megatron + DP's ("ratio"), how far the
  predicted collective bytes are from the compiled ones ("comm_error"),
  and the seconds planning took ("plan_seconds")."""
  # Wide enough for the tables when piped to a file or a CI log.
  console = console or Console(width=None if sys.stdout.isatty() else 120)
  n = int(np.prod(cfg.mesh))
  if len(jax.devices()) < n:
    raise RuntimeError(
        f"the demo needs {n} devices, found {len(jax.devices())}; set "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before starting "
        "Python (the `automap` command does this for you).")
  model = cfg.model
  console.rule("[bold]automap demo")
  console.print(f"GPT train step (adam): {model.layers} layers, hidden {model.hidden}, "
                f"{model.heads} heads, batch {cfg.batch} x seq {model.seq}, vocab "
                f"{model.vocab}; mesh {cfg.mesh} ('data', 'model') of simulated CPU "
                f"devices; costs for {cfg.hardware}.")
  step, args = make_train_step(model, batch=cfg.batch)
  mesh = jax.make_mesh(cfg.mesh, ("data", "model"))
  partitioned, plan_seconds = _plan(cfg, console, step, args, mesh)
  plan = partitioned.plan
  experts = {
      "Megatron + DP": megatron_specs(args),
      "data parallel": megatron_specs(args, data=("data", "model"), model=None),
  }
  yardstick = _print_costs(cfg, console, plan, step, args, mesh, experts)
  _print_layouts(console, plan, experts["Megatron + DP"])
  _print_collectives(console, plan)
  ok, comm_error = _run_and_check(cfg, console, partitioned, plan, step, args, mesh)
  return {"ok": ok, "ratio": plan.cost.step_time / yardstick,
          "comm_error": comm_error, "plan_seconds": plan_seconds}


def _plan(cfg: DemoConfig, console: Console, step, args, mesh) -> tuple:
  """The step partitioned on `mesh` and lowered for `args` (its plan
  searched, or loaded from the plan cache), and the seconds that took."""
  t0 = time.perf_counter()
  partitioned = automap.partition(step, mesh=mesh, hardware=cfg.hardware,
                                  budget=automap.Budget(episodes=1000, seconds=cfg.seconds))
  partitioned.lower(*args)
  plan = partitioned.plan
  plan_seconds = time.perf_counter() - t0
  source = "loaded from the plan cache; searched by " if plan.stats.get("cached") else ""
  console.print(f"planned in {plan_seconds:.1f} s "
                f"({source}MCTS: {plan.stats['episodes']} episodes, best at episode "
                f"{plan.stats['episode_of_best']}, {plan.stats['groups']} layer "
                f"groups, graph of {plan.stats['graph_ops']} ops)")
  console.print("actions: " + "; ".join(plan.stats["actions"])
                + f" (then {plan.stats.get('refine_moves', 0)} refinement moves)")
  return partitioned, plan_seconds


def _print_costs(cfg: DemoConfig, console: Console, plan, step, args, mesh,
                 experts: dict) -> float:
  """Prints the plan's predicted cost beside the experts' (`experts`: name
  -> their argument specs); returns Megatron + DP's step time, seconds."""
  costs = {"automap": plan.cost}
  for name, specs in experts.items():
    costs[name] = automap.evaluate(step, *args, mesh=mesh, in_shardings=specs,
                                   hardware=cfg.hardware)
  yardstick = costs["Megatron + DP"].step_time
  table = Table(title=f"predicted cost per step on {cfg.hardware}")
  for col in ("strategy", "step ms", "compute ms", "comm ms", "comm MiB",
              "peak MiB/device", "vs Megatron+DP"):
    table.add_column(col, justify="right" if col != "strategy" else "left")
  for name, c in costs.items():
    table.add_row(name, _ms(c.step_time), _ms(c.compute_time), _ms(c.comm_time),
                  _mib(c.total_comm_bytes), _mib(c.peak_memory),
                  f"{c.step_time / yardstick:.3f}x")
  console.print(table)
  return yardstick


def _print_layouts(console: Console, plan, expert_specs) -> None:
  """Prints the first layer group's parameter layouts (and those outside
  the layers), the plan's beside the expert's."""
  megatron = jax.tree.leaves(expert_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
  layers = Table(title="parameter layouts, layer group block_0 (the others alike "
                 "unless the search chose otherwise)")
  for col in ("parameter", "shape", "automap", "Megatron + DP"):
    layers.add_column(col)
  for path, shape, spec, expert in zip(plan.in_paths, plan.in_shapes,
                                       plan.in_specs, megatron):
    if path.startswith("0/block_0/") or (path.startswith("0/") and "block_" not in path):
      layers.add_row(path[2:], str(tuple(shape)), format_spec(spec), format_spec(expert))
  console.print(layers)


def _print_collectives(console: Console, plan) -> None:
  """Prints the plan's collectives per device, summed by layer."""
  per_layer: dict[tuple, list] = {}
  for scope, kind, axes, nbytes, count in plan.collectives:
    key = (layer_of(scope), kind, ",".join(axes))
    acc = per_layer.setdefault(key, [0, 0.0])
    acc[0] += count
    acc[1] += nbytes
  coll = Table(title="automap's collectives per device, by layer")
  for col in ("layer", "collective", "mesh axes", "count", "MiB"):
    coll.add_column(col)
  for (layer, kind, axes), (count, nbytes) in sorted(per_layer.items()):
    coll.add_row(layer, kind, axes, str(count), _mib(nbytes))
  console.print(coll)


def _run_and_check(cfg: DemoConfig, console: Console, partitioned, plan, step, args,
                   mesh) -> tuple[bool, float]:
  """Runs one partitioned step and the unpartitioned one, and prints how
  their losses, parameters and collectives compare; returns whether they
  check out, and how far the predicted collective bytes are from the
  compiled ones (a share)."""
  console.print("running one partitioned step and the unpartitioned step...")
  t0 = time.perf_counter()
  out = partitioned(*args)
  jax.block_until_ready(out)
  expected = jax.jit(step)(*args)
  run_seconds = time.perf_counter() - t0
  loss, ref_loss = float(out[2]), float(expected[2])
  param_err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(e))))
                  for a, e in zip(jax.tree.leaves(out[0]), jax.tree.leaves(expected[0])))
  report = automap.verify(plan, step, *args, mesh=mesh, check_numerics=False)
  compiled_bytes = report.compiled_total_comm_bytes
  predicted = report.predicted_comm_bytes
  comm_error = report.comm_error
  console.print(
      f"loss {loss:.6f} vs unpartitioned {ref_loss:.6f} (relative difference "
      f"{abs(loss - ref_loss) / abs(ref_loss):.1e}); largest parameter difference "
      f"after the adam step {param_err:.1e}; compiled collectives "
      f"{_mib(compiled_bytes)} MiB vs predicted {_mib(predicted)} MiB per device "
      f"({comm_error:.1%} apart; XLA:CPU all-reduces where {cfg.hardware} would "
      f"reduce-scatter, and the prediction is re-priced for that); ran in "
      f"{run_seconds:.1f} s.")
  ok = abs(loss - ref_loss) <= 1e-5 * abs(ref_loss) and comm_error < 0.05
  console.print("[bold green]numerics and collectives check out" if ok else
                "[bold red]MISMATCH against the unpartitioned step")
  return ok, comm_error
