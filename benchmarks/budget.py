"""How closely the search honours its wall-clock budget.

MCTS on a 24-layer GPT train step (mesh (4, 2), tpu-v4 costs) with an
unbounded episode budget and a seconds budget; prints the seconds the search
took against the budget, median of three runs each.

  python benchmarks/budget.py
"""

from __future__ import annotations

import os
import statistics

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

import automap  # noqa: E402
from automap._src.models.gpt import GPTConfig, make_train_step  # noqa: E402


def main():
  config = GPTConfig(vocab=512, seq=128, hidden=512, heads=8, layers=24)
  step, args = make_train_step(config, batch=32, abstract=True)
  mesh = jax.sharding.AbstractMesh((4, 2), ("data", "model"))
  print("| budget s | search s (median of 3) | episodes | over budget |")
  print("|---|---|---|---|")
  for seconds in (1.0, 3.0, 10.0):
    runs = [automap.search(step, *args, mesh=mesh,
                           budget=automap.Budget(episodes=10**9, seconds=seconds)).stats
            for _ in range(3)]
    took = statistics.median(r["seconds"] for r in runs)
    episodes = statistics.median(r["episodes"] for r in runs)
    print(f"| {seconds:.0f} | {took:.2f} | {episodes:.0f} | {took / seconds - 1:+.1%} |",
          flush=True)


if __name__ == "__main__":
  main()
