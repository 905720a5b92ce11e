"""Plan quality: automap (MCTS and ILP) against the hand-written experts.

For train steps of several model families (`automap.zoo.catalogue`) on five 8-device
meshes and two hardware specs: predicted step time of data parallelism,
Megatron (tensor parallel on the last mesh axis of size > 1), Megatron + data
parallelism on the other axes, FSDP (batch and every parameter and moment
split over every axis), FSDP+TP (MaxText's layout, on two or more axes),
EP+DP (a mixture of experts' experts over one axis, the batch over all),
automap's MCTS (200 episodes, no hints, its best
plans then refined) and, on tpu-v4, `search="ilp"` (warm-started from that
plan, within `--ilp-seconds`). Experts are the search's own tactics, so they
apply to any program. Every plan is priced by the cost model; nothing is
compiled. Prints a Markdown table and a summary.

  python benchmarks/quality.py [--quick] [--only NAME_PREFIX ...]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402

import automap  # noqa: E402
from automap import Budget, SearchOptions  # noqa: E402
from automap import zoo as programs  # noqa: E402
from automap._src.cost.program import Program  # noqa: E402
from automap._src.cost.tracker import Tracker  # noqa: E402
from automap._src.ir import trace  # noqa: E402
from automap._src.search import driver, tactics  # noqa: E402
from automap._src.search.actions import ActionSpace  # noqa: E402
from automap._src.sharding.mesh import MeshSpec  # noqa: E402

MESHES = [(8, 1), (4, 2), (2, 4), (1, 8), (2, 2, 2)]
NAMES = ("data", "model", "seq")
def row(program: Program, ilp_seconds: float | None, episodes: int) -> dict:
  space = ActionSpace(program)
  costs = {name: Tracker(program.model, s) for name, s in
           tactics.expert_states(program, space).items()}
  out = {name: (t.step_time, t.peak_memory) for name, t in costs.items()}
  if ilp_seconds is None:
    request = SearchOptions(budget=Budget(episodes=episodes, seconds=600))
    found = driver.run_mcts(program, space, request, 600.0)
    t = Tracker(program.model, found.state)
    out["MCTS"] = (t.step_time, t.peak_memory)
    return out
  request = SearchOptions(budget=Budget(episodes=episodes, seconds=ilp_seconds), search="ilp")
  start = time.perf_counter()
  found = driver.run_ilp(program, space, request)
  out["ilp_s"] = time.perf_counter() - start
  out["MCTS"] = (found.stats["warm_start"]["step_time"], np.nan)
  t = Tracker(program.model, found.state)
  out["ILP"] = (t.step_time, t.peak_memory)
  out["status"] = found.stats["status"]
  return out


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true",
                      help="three programs, two meshes, tpu-v4 only")
  parser.add_argument("--ilp-seconds", type=float, default=20.0)
  parser.add_argument("--episodes", type=int, default=200)
  parser.add_argument("--only", nargs="*", default=None,
                      help="programs whose names start with these")
  opts = parser.parse_args()
  meshes = [(4, 2), (2, 2, 2)] if opts.quick else MESHES
  hardware = ["tpu-v4"] if opts.quick else ["tpu-v4", "h100"]
  print("| program | mesh | hardware | DP ms | Megatron ms | Megatron+DP ms | FSDP ms "
        "| FSDP+TP ms | EP+DP ms | MCTS ms | ILP ms (status) | best expert peak MiB "
        "| automap peak MiB "
        "| MCTS / best expert | ILP / best expert | MCTS / ILP |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  summary = {"mcts": [], "ilp": [], "mcts_ilp_optimal": []}
  for name, build in programs.catalogue(opts.quick).items():
    if opts.only and not any(name.startswith(prefix) for prefix in opts.only):
      continue
    step, args = build()
    traced = trace.trace(step, args)
    for shape in meshes:
      mesh = MeshSpec(NAMES[:len(shape)], shape)
      for hw in hardware:
        program = Program.build(traced, mesh, automap.HARDWARE[hw])
        r = row(program, opts.ilp_seconds if hw == "tpu-v4" else None, opts.episodes)
        best = min((e for e in tactics.EXPERTS if e in r), key=lambda e: r[e][0])
        ms = lambda k, r=r: f"{r[k][0] * 1e3:.3f}" if k in r else "-"  # noqa: E731
        ratio = r["MCTS"][0] / r[best][0]
        summary["mcts"].append(ratio)
        ilp = ilp_ratio = mcts_ilp = "-"
        peak = r["MCTS"][1] if "ILP" not in r else r["ILP"][1]
        if "ILP" in r:
          ilp = f"{ms('ILP')} ({r['status']})"
          ilp_ratio = f"{r['ILP'][0] / r[best][0]:.3f}"
          mcts_ilp = f"{r['MCTS'][0] / r['ILP'][0]:.3f}"
          summary["ilp"].append(r["ILP"][0] / r[best][0])
          if r["status"] == "optimal":
            summary["mcts_ilp_optimal"].append(r["MCTS"][0] / r["ILP"][0])
        print(f"| {name} | {shape} | {hw} | {ms('data parallel')} | {ms('Megatron')} "
              f"| {ms('Megatron+DP')} | {ms('FSDP')} | {ms('FSDP+TP')} | {ms('EP+DP')} "
              f"| {ms('MCTS')} | {ilp} "
              f"| {r[best][1] / 2**20:.1f} | {peak / 2**20:.1f} "
              f"| {ratio:.3f} | {ilp_ratio} | {mcts_ilp} |", flush=True)
  print()
  for key, label in (("mcts", "MCTS / best expert"), ("ilp", "ILP / best expert"),
                     ("mcts_ilp_optimal", "MCTS / ILP where the ILP proved optimality")):
    values = summary[key]
    if values:
      print(f"- {label}: median {np.median(values):.3f}, worst {max(values):.3f} "
            f"over {len(values)} rows")
    else:
      print(f"- {label}: no rows")


if __name__ == "__main__":
  main()
