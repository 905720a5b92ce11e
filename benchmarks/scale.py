"""Pipeline speed against program size, from 1k to 100k equations.

For GPT train steps of L layers: jaxpr equations, trace, graph build, one
full propagation + cost evaluation, one incremental action (tile +
propagate + re-cost; median over the search's candidate actions, on their
first visit, which prices the new layouts, and with the memo warm: each
action's median over five more visits, then the median and p90 over
actions) and the same with its undo (first visit, median),
and an end-to-end `automap.search` (trace to plan, MCTS and refinement
under `Budget(seconds=...)`). Then the growth exponent of each time against the
equation count (least squares on log-log). Prints Markdown tables;
`--plot PATH` draws the times (needs matplotlib: `pip install -e .[bench]`).

  python benchmarks/scale.py --layers 2 6 24 96 232 --plot benchmarks/scale.png
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import automap  # noqa: E402
from automap._src.cost.program import Program  # noqa: E402
from automap._src.cost.tracker import Tracker  # noqa: E402
from automap._src.ir import graph, trace  # noqa: E402
from automap._src.sharding.mesh import MeshSpec  # noqa: E402
from automap.zoo import GPTConfig, gpt_train_step  # noqa: E402

MESH = (("data", "model"), (4, 2))
COLUMNS = {"trace_s": "trace", "build_s": "graph build", "full_eval_s": "full evaluation",
           "action_s": "action", "search_s": "end-to-end search"}


def candidate_actions(prog) -> list[tuple[int, int, int]]:
  """(value, dim, axis) for every argument dim an axis divides, largest
  arguments first."""
  g, mesh = prog.graph, prog.mesh
  out = [(v, d, a) for v in g.inputs for d, n in enumerate(g.shapes[v])
         for a, size in enumerate(mesh.axis_sizes) if size > 1 and n % size == 0]
  return sorted(out, key=lambda x: -int(g.nbytes[x[0]]))


def load_kernels() -> None:
  """Loads the compiled kernels (from numba's disk cache, else compiling
  them) on a one-layer step, so the first timed size does not pay it."""
  step, args = gpt_train_step(GPTConfig(vocab=64, seq=8, hidden=32, heads=2, layers=1),
                              batch=8, abstract=True)
  prog = Program.build(trace.trace(step, args), MeshSpec(*MESH), automap.HARDWARE["tpu-v4"])
  state = prog.initial_state()
  tracker = Tracker(prog.model, state)
  v, d, a = candidate_actions(prog)[0]
  tracker.update(prog.propagator().tile(state, v, d, a))


def measure(layers: int, actions: int, seconds: float) -> dict:
  config = GPTConfig(vocab=512, seq=128, hidden=512, heads=8, layers=layers)
  step, args = gpt_train_step(config, batch=32, abstract=True)
  t = time.perf_counter()
  traced = trace.trace(step, args)
  t_trace = time.perf_counter() - t
  t = time.perf_counter()
  g = graph.build(traced)
  t_build = time.perf_counter() - t
  mesh = MeshSpec(*MESH)
  prog = Program.build(traced, mesh, automap.HARDWARE["tpu-v4"])
  state = prog.initial_state()
  t = time.perf_counter()
  tracker = Tracker(prog.model, state)
  t_full = time.perf_counter() - t
  prop = prog.propagator()
  forward, times, touched = [], [], []
  warm: list[list[float]] = []
  for visit in range(6):
    for i, (v, d, a) in enumerate(candidate_actions(prog)[:actions]):
      before = state.copy()
      t = time.perf_counter()
      changed = prop.tile(state, v, d, a)
      tracker.update(changed)
      _ = tracker.step_time, tracker.peak_memory
      took = time.perf_counter() - t
      state[changed] = before[changed]
      tracker.update(changed)
      if visit == 0:
        forward.append(took)
        times.append(time.perf_counter() - t)
        touched.append(len(changed))
        warm.append([])
      else:
        warm[i].append(took)
  warm_each = sorted(statistics.median(w) for w in warm)
  del prog, tracker
  t = time.perf_counter()
  plan = automap.search(step, *args, mesh=jax.sharding.AbstractMesh(MESH[1], MESH[0]),
                        budget=automap.Budget(episodes=200, seconds=seconds))
  t_search = time.perf_counter() - t
  return {"layers": layers, "equations": g.num_ops, "values": g.num_values,
          "trace_s": t_trace, "build_s": t_build, "full_eval_s": t_full,
          "forward_s": statistics.median(forward), "warm_s": statistics.median(warm_each),
          "warm_p90_s": warm_each[int(0.9 * len(warm_each))],
          "action_s": statistics.median(times),
          "values_touched": statistics.median(touched),
          "search_s": t_search, "episodes": plan.stats["episodes"]}


def exponents(rows: list[dict]) -> dict[str, float]:
  """Growth exponent of each time column against equations (log-log fit)."""
  n = np.log([r["equations"] for r in rows])
  return {k: float(np.polyfit(n, np.log([r[k] for r in rows]), 1)[0]) for k in COLUMNS}


def plot(rows: list[dict], fits: dict[str, float], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.5))
  n = [r["equations"] for r in rows]
  for k, label in COLUMNS.items():
    ax.loglog(n, [r[k] for r in rows], "o-", label=f"{label} (n^{fits[k]:.2f})")
  ax.set_xlabel("jaxpr equations")
  ax.set_ylabel("seconds")
  ax.set_title("automap pipeline time against program size (GPT train steps)")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main():
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--layers", type=int, nargs="+", default=[2, 6, 24, 96, 232])
  p.add_argument("--actions", type=int, default=100)
  p.add_argument("--seconds", type=float, default=20.0,
                 help="the search budget of the end-to-end run")
  p.add_argument("--plot", default=None, help="write a PNG of the times here")
  args = p.parse_args()
  print("| layers | equations | values | trace s | graph build s | full evaluation s "
        "| action ms, first visit | memo warm | warm p90 | action+undo ms "
        "| values touched (median) "
        "| end-to-end search s | episodes |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  load_kernels()
  rows = []
  for layers in args.layers:
    r = measure(layers, args.actions, args.seconds)
    rows.append(r)
    print(f"| {r['layers']} | {r['equations']:,} | {r['values']:,} | {r['trace_s']:.2f} "
          f"| {r['build_s']:.2f} | {r['full_eval_s']:.3f} | {1e3 * r['forward_s']:.2f} "
          f"| {1e3 * r['warm_s']:.2f} | {1e3 * r['warm_p90_s']:.2f} "
          f"| {1e3 * r['action_s']:.2f} | {r['values_touched']:.0f} "
          f"| {r['search_s']:.1f} | {r['episodes']} |", flush=True)
  if len(rows) > 1:
    fits = exponents(rows)
    print("\n| growth exponent | " + " | ".join(COLUMNS.values()) + " |")
    print("|---|" + "---|" * len(COLUMNS))
    print("| time ~ equations^k | " + " | ".join(f"{fits[k]:.2f}" for k in COLUMNS) + " |")
    if args.plot:
      plot(rows, fits, args.plot)


if __name__ == "__main__":
  main()
