"""Pipeline speed against program size.

For GPT train steps of L layers: jaxpr equations, graph build time, one full
propagation + cost evaluation, and the time of one incremental action
(tile + propagate + re-cost + undo), median over the candidate actions of the
search. Prints a Markdown table.

  python benchmarks/scale.py --layers 2 12 24
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from automap._src import cost, graph, hardware, program, sharding, trace  # noqa: E402
from automap._src.models.gpt import GPTConfig, make_train_step  # noqa: E402


def shapes_only(args):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)


def candidate_actions(prog) -> list[tuple[int, int, int]]:
  """(value, dim, axis) for every argument dim an axis divides, largest
  arguments first."""
  g, mesh = prog.graph, prog.mesh
  out = [(v, d, a) for v in g.inputs for d, n in enumerate(g.shapes[v])
         for a, size in enumerate(mesh.axis_sizes) if size > 1 and n % size == 0]
  return sorted(out, key=lambda x: -int(g.nbytes[x[0]]))


def measure(layers: int, actions: int) -> dict:
  config = GPTConfig(vocab=512, seq=128, hidden=512, heads=8, layers=layers)
  step, args = make_train_step(config, batch=32)
  args = shapes_only(args)
  t = time.perf_counter()
  traced = trace.trace(step, args)
  t_trace = time.perf_counter() - t
  t = time.perf_counter()
  g = graph.build(traced)
  t_build = time.perf_counter() - t
  mesh = sharding.MeshSpec(("data", "model"), (4, 2))
  prog = program.Program(traced, g, mesh, hardware.get_hardware("tpu-v4"),
                         cost.CostModel(g, mesh, hardware.get_hardware("tpu-v4")),
                         sharding.empty_state(g, mesh),
                         __import__("numpy").zeros(g.num_values, bool))
  state = prog.initial_state()
  t = time.perf_counter()
  tracker = cost.Tracker(prog.model, state)
  t_full = time.perf_counter() - t
  prop = prog.propagator()
  times, touched = [], []
  for v, d, a in candidate_actions(prog)[:actions]:
    before = state.copy()
    t = time.perf_counter()
    changed = prop.tile(state, v, d, a)
    tracker.update(changed)
    _ = tracker.step_time, tracker.peak_memory
    state[changed] = before[changed]
    tracker.update(changed)
    times.append(time.perf_counter() - t)
    touched.append(len(changed))
  return {"layers": layers, "equations": g.num_ops, "values": g.num_values,
          "trace_s": t_trace, "build_s": t_build, "full_eval_s": t_full,
          "action_ms": 1e3 * statistics.median(times),
          "action_p90_ms": 1e3 * sorted(times)[int(0.9 * len(times))],
          "values_touched": statistics.median(touched)}


def main():
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--layers", type=int, nargs="+", default=[2, 12, 24])
  p.add_argument("--actions", type=int, default=200)
  args = p.parse_args()
  print("| layers | equations | values | trace s | graph build s | full evaluation s "
        "| action+undo ms (median) | p90 ms | values touched (median) |")
  print("|---|---|---|---|---|---|---|---|---|")
  for layers in args.layers:
    r = measure(layers, args.actions)
    print(f"| {r['layers']} | {r['equations']:,} | {r['values']:,} | {r['trace_s']:.2f} "
          f"| {r['build_s']:.2f} | {r['full_eval_s']:.3f} | {r['action_ms']:.2f} "
          f"| {r['action_p90_ms']:.2f} | {r['values_touched']:.0f} |", flush=True)


if __name__ == "__main__":
  main()
