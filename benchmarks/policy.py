"""The learned policy against uniform priors.

On train steps of models the policy was not trained on (a GPT deeper and
wider than any trained, a T5-style encoder-decoder, a ViT, a jraph
GraphNetwork: the trainer's GNN is written with segment sums), on (4, 2)
and (2, 4) meshes for tpu-v4, MCTS runs `--episodes` episodes from each of
`--seeds` seeds with the shipped policy and with uniform priors. Reported
per row, medians over seeds: the episodes and wall seconds until the best
plan is within 1% of two targets ("-" when never), and the final plan's
step time. The targets: the best expert's plan (data parallel, Megatron,
Megatron+DP, FSDP), and the best plan any of the row's searches found.

  python benchmarks/policy.py [--quick] [--episodes 200] [--seeds 15] [--first-seed 0]
      [--weights FILE]
"""

from __future__ import annotations

import argparse
import os
import warnings

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402

from automap._src.cost.hardware import get_hardware  # noqa: E402
from automap._src.cost.program import Program  # noqa: E402
from automap._src.cost.tracker import Tracker  # noqa: E402
from automap._src.ir import trace  # noqa: E402
from automap._src.models import zoo as programs  # noqa: E402
from automap._src.search.actions import ActionSpace  # noqa: E402
from automap._src.search.policy import compare, learned  # noqa: E402
from automap._src.search.tactics import expert_states  # noqa: E402
from automap._src.sharding.mesh import MeshSpec  # noqa: E402

HELD_OUT = {
    "GPT 4L h384": lambda: programs.gpt(4, 384),
    "T5 2+2L w512": programs.encoder_decoder,
    "ViT 4L w384": programs.vit,
    "GraphNetwork 4k nodes": programs.graph_network,
}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true", help="two programs, one mesh, 2 seeds")
  parser.add_argument("--episodes", type=int, default=200)
  parser.add_argument("--seeds", type=int, default=15)
  parser.add_argument("--first-seed", type=int, default=0, help="seeds run from here")
  parser.add_argument("--weights", default=None, help="a weights file (default: the shipped)")
  opts = parser.parse_args()
  with warnings.catch_warnings():
    warnings.simplefilter("error", learned.PolicyWarning)
    policy = learned.load(opts.weights)
  names = list(HELD_OUT)[:2] if opts.quick else list(HELD_OUT)
  meshes = [(4, 2)] if opts.quick else [(4, 2), (2, 4)]
  seeds = range(opts.first_seed, opts.first_seed + (2 if opts.quick else opts.seeds))
  print("| program | mesh | best expert ms | best found ms "
        "| episodes to expert: uniform | policy | seconds: uniform | policy "
        "| episodes to best found: uniform | policy | seconds: uniform | policy "
        "| final ms: uniform | policy |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  to_expert, to_best, worse = [], [], 0
  fmt = lambda x, spec: "-" if not np.isfinite(x) else format(x, spec)  # noqa: E731
  for name in names:
    step, args = HELD_OUT[name]()
    traced = trace.trace(step, args)
    for shape in meshes:
      program = Program.build(traced, MeshSpec(("data", "model"), shape),
                              get_hardware("tpu-v4"))
      space = ActionSpace(program)
      expert = min(Tracker(program.model, s).step_time
                   for s in expert_states(program, space).values())
      trails = compare.compare(program, space, policy, seeds, opts.episodes)
      best = compare.best_found(trails)
      # Per label: (episodes, seconds) to the expert's plan, then to the best.
      cells = {k: compare.medians(ts, expert) + compare.medians(ts, best)
               for k, ts in trails.items()}
      final = {k: compare.final(ts) for k, ts in trails.items()}
      u, p = cells["uniform"], cells["policy"]
      to_expert.append(compare.speedup(u[0], p[0]))
      to_best.append(compare.speedup(u[2], p[2]))
      worse += compare.worse(trails)
      print(f"| {name} | {shape} | {expert * 1e3:.3f} | {best * 1e3:.3f} "
            f"| {fmt(u[0], '.0f')} | {fmt(p[0], '.0f')} | {fmt(u[1], '.3f')} "
            f"| {fmt(p[1], '.3f')} | {fmt(u[2], '.0f')} | {fmt(p[2], '.0f')} "
            f"| {fmt(u[3], '.3f')} | {fmt(p[3], '.3f')} "
            f"| {final['uniform'] * 1e3:.3f} | {final['policy'] * 1e3:.3f} |", flush=True)
  print()
  for what, ratios in (("expert cost", to_expert), ("the best plan found", to_best)):
    ratios = np.array(ratios)
    print(f"- episodes to {what} (within 1%), uniform / policy, medians over seeds: "
          f"median {np.median(ratios):.2f}x, least {np.min(ratios):.2f}x over "
          f"{len(ratios)} rows (both alike: 1x; only uniform reaches: 0x)")
  print(f"- rows where the policy's final plan is worse than uniform's: {worse}")


if __name__ == "__main__":
  main()
