"""How closely the search honours its wall-clock budget.

MCTS and the ILP on a 24-layer GPT train step (mesh (4, 2), tpu-v4 costs)
with an unbounded episode budget and a seconds budget; prints the seconds
the search took against the budget, median of three runs each. The ILP's
seconds include its MCTS warm start and building its model, which is not
interruptible.

  python benchmarks/budget.py [--seconds 1 3 10] [--ilp-seconds 10 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import warnings

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

import automap  # noqa: E402
from automap.zoo import GPTConfig, gpt_train_step  # noqa: E402


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--seconds", type=float, nargs="+", default=[1.0, 3.0, 10.0])
  parser.add_argument("--ilp-seconds", type=float, nargs="*", default=[10.0, 30.0])
  opts = parser.parse_args()
  config = GPTConfig(vocab=512, seq=128, hidden=512, heads=8, layers=24)
  step, args = gpt_train_step(config, batch=32, abstract=True)
  mesh = jax.sharding.AbstractMesh((4, 2), ("data", "model"))
  print("| search | budget s | search s (median of 3) | MCTS episodes | over budget |")
  print("|---|---|---|---|---|")
  warnings.simplefilter("ignore", automap.SearchWarning)
  for method, budgets in (("mcts", opts.seconds), ("ilp", opts.ilp_seconds)):
    for seconds in budgets:
      plans = [automap.search(step, *args, mesh=mesh, search=method,
                              budget=automap.Budget(episodes=10**9, seconds=seconds))
               for _ in range(3)]
      took = statistics.median(p.timings["search"] for p in plans)
      episodes = statistics.median(p.stats.get("episodes") or p.stats["warm_start"]["episodes"]
                                   for p in plans)
      print(f"| {method} | {seconds:g} | {took:.2f} | {episodes:.0f} "
            f"| {took / seconds - 1:+.1%} |", flush=True)


if __name__ == "__main__":
  main()
