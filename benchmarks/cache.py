"""What a cached plan saves: planning time on the first and second run.

GPT train steps of L layers (hidden 512, 8 heads, seq 128, batch 32) on a
(4, 2) mesh of simulated CPU devices; `partition(...).lower(...)` in a fresh
`Partitioned` each time, against one cache folder. "plan s" is the time from
the call to a plan (trace, then search or cache load), before compiling.

  python benchmarks/cache.py --layers 4 24
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

import automap  # noqa: E402
from automap.zoo import GPTConfig, gpt_train_step  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--layers", type=int, nargs="+", default=[4, 24])
  args_ = parser.parse_args()
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  print("| layers | first run: plan s (search) | second run: plan s (cache) | saved |")
  print("|---|---|---|---|")
  with tempfile.TemporaryDirectory() as folder:
    for layers in args_.layers:
      config = GPTConfig(vocab=512, seq=128, hidden=512, heads=8, layers=layers)
      step, args = gpt_train_step(config, batch=32, abstract=True)
      runs = []
      for _ in range(2):
        f = automap.partition(step, mesh=mesh, cache=folder)
        f.lower(*args)
        runs.append(f.plan.timings["plan"])
      print(f"| {layers} | {runs[0]:.2f} | {runs[1]:.2f} | {runs[0] / runs[1]:.0f}x |",
            flush=True)


if __name__ == "__main__":
  main()
