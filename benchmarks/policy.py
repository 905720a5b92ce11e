"""The learned policy against uniform priors.

On train steps of models the policy was not trained on (a GPT deeper and
wider than any trained, a T5-style encoder-decoder, a ViT, a jraph
GraphNetwork: the trainer's GNN is written with segment sums), on (4, 2)
and (2, 4) meshes for tpu-v4, MCTS runs `--episodes` episodes from each of
`--seeds` seeds with the shipped policy and with uniform priors. Reported
per row, medians over seeds: the episodes and wall seconds until the best
plan is within 1% of the best expert's (data parallel, Megatron,
Megatron+DP, FSDP; "-" when never), and the final plan's step time.

  python benchmarks/policy.py [--quick] [--episodes 200] [--seeds 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
import programs  # noqa: E402
from quality import expert_states  # noqa: E402

from automap._src import trace  # noqa: E402
from automap._src.cost import Tracker  # noqa: E402
from automap._src.hardware import get_hardware  # noqa: E402
from automap._src.policy import learned  # noqa: E402
from automap._src.program import Program  # noqa: E402
from automap._src.search import mcts  # noqa: E402
from automap._src.search.actions import ActionSpace  # noqa: E402
from automap._src.sharding import MeshSpec  # noqa: E402

HELD_OUT = {
    "GPT 4L h384": lambda: programs.gpt(4, 384),
    "T5 2+2L w512": programs.encoder_decoder,
    "ViT 4L w384": programs.vit,
    "GraphNetwork 4k nodes": programs.graph_network,
}


def run(program: Program, space: ActionSpace, policy, seed: int, episodes: int,
        target: float) -> tuple[float, float, float]:
  """(episodes to target or inf, seconds to target or inf, final step time)."""
  search = mcts.Search(program, space, None, seed, policy=policy)
  reached: list[tuple[int, float]] = []

  def watch(s: mcts.Search) -> None:
    if not reached and s.best.score[1] <= target:
      reached.append((s.episodes, time.perf_counter() - s.t0))

  result = search.run(episodes, 600.0, watch)
  if not reached:  # never: longer than any budget, for the medians
    return np.inf, np.inf, result.score[1]
  return float(reached[0][0]), reached[0][1], result.score[1]


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true", help="two programs, one mesh, 2 seeds")
  parser.add_argument("--episodes", type=int, default=200)
  parser.add_argument("--seeds", type=int, default=5)
  opts = parser.parse_args()
  with warnings.catch_warnings():
    warnings.simplefilter("error", learned.PolicyWarning)
    policy = learned.load()
  names = list(HELD_OUT)[:2] if opts.quick else list(HELD_OUT)
  meshes = [(4, 2)] if opts.quick else [(4, 2), (2, 4)]
  seeds = range(2 if opts.quick else opts.seeds)
  print("| program | mesh | best expert ms | uniform: episodes to expert | policy: episodes "
        "| uniform: seconds to expert | policy: seconds | uniform: final ms "
        "| policy: final ms | episodes uniform / policy |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  ratios, worse = [], 0
  for name in names:
    step, args = HELD_OUT[name]()
    traced = trace.trace(step, args)
    for shape in meshes:
      program = Program.build(traced, MeshSpec(("data", "model"), shape),
                              get_hardware("tpu-v4"))
      space = ActionSpace(program)
      expert = min(Tracker(program.model, s).step_time
                   for s in expert_states(program, space).values())
      target = expert * 1.01
      rows = {}
      for label, p in (("uniform", None), ("policy", policy)):
        rows[label] = np.array([run(program, space, p, seed, opts.episodes, target)
                                for seed in seeds])
      med = {k: np.median(v, axis=0) for k, v in rows.items()}
      fmt = lambda x, spec: "-" if not np.isfinite(x) else format(x, spec)  # noqa: E731
      u, p = med["uniform"][0], med["policy"][0]
      ratio = 1.0 if np.isinf(u) and np.isinf(p) else u / p
      ratios.append(ratio)
      worse += int(med["policy"][2] > med["uniform"][2] * (1 + 1e-9))
      print(f"| {name} | {shape} | {expert * 1e3:.3f} | {fmt(med['uniform'][0], '.0f')} "
            f"| {fmt(med['policy'][0], '.0f')} | {fmt(med['uniform'][1], '.3f')} "
            f"| {fmt(med['policy'][1], '.3f')} | {med['uniform'][2] * 1e3:.3f} "
            f"| {med['policy'][2] * 1e3:.3f} | {fmt(ratio, '.1f')} |", flush=True)
  print()
  ratios = np.array(ratios)
  print(f"- episodes to expert cost, uniform / policy (medians over seeds): median "
        f"{np.median(ratios):.2f}x, least {np.min(ratios):.2f}x over {len(ratios)} rows "
        "(a row neither reaches counts 1x; one only uniform reaches, 0x)")
  print(f"- rows where the policy's final plan is worse than uniform's: {worse}")


if __name__ == "__main__":
  main()
