"""Accelerator co-search: the best architecture within a TPUv4-like area against that baseline.

For GPT2-XL-, OPT-30B-, BERT-Large- and Llama2-7B-shaped models (bf16, Adam
in mixed precision) on 1024 accelerators linked like tpu-v4, automap searches
the architecture (tensor units, systolic array size, vector units and width,
on-chip buffer) within the baseline's area together with the placement
(stages, TP/DP widths, ZeRO, recompute, microbatch), each layer pass
scheduled on the architecture's cores by the CP-SAT operator-scheduling ILP.
The baseline is the TPUv4-like point (8 tensor units of 128x128, 2 vector
units of 128 lanes, 128 MiB on chip) with its own best placement. Search time
is wall seconds on this machine for one model, profiling included.

  python benchmarks/accelerator.py [--quick] [--models NAME ...] [--plot PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import automap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import MODELS, block_model  # noqa: E402

# Adam in mixed precision: fp32 master weights and two moments per bf16
# parameter, in bytes of optimizer state per parameter byte (the co-search
# takes the optimizer as that ratio).
OPTIMIZER = 6.0

HERE = os.path.dirname(os.path.abspath(__file__))


def workload(name: str) -> automap.cluster.Workload:
  """The 2-block model of the named shape, its second block standing for the rest."""
  loss, params, batch = block_model(name)
  layers, *_, global_batch, _ = MODELS[name]
  return automap.cluster.Workload(loss, params, batch, global_batch, name,
                          repeat={"block_1": layers - 1})


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--plot", default=None)
  parser.add_argument("--models", nargs="+", choices=["GPT2-XL", "OPT-30B", "BERT-Large",
                                                      "Llama2-7B"], default=None)
  opts = parser.parse_args()
  models = opts.models or (
      ["BERT-Large"] if opts.quick else ["GPT2-XL", "OPT-30B", "BERT-Large", "Llama2-7B"])
  print("| model | best architecture | area mm^2 | placement | samples/s | TPUv4-like "
        "samples/s | ratio | points / placed at bound / scheduled | search s |")
  print("|---|---|---|---|---|---|---|---|---|")
  ratios, times = [], []
  for name in models:
    plan = automap.cluster.search_accelerator(
        workload(name), devices=1024, hardware="tpu-v4", optimizer=OPTIMIZER,
        microbatches=(1, 2, 4), schedule_seconds=0.5 if opts.quick else 1.0,
        budget=automap.Budget(episodes=10 if opts.quick else 20, seconds=60, progress=False),
        progress=False)
    a, (r,), (b,) = plan.accelerator, plan.results, plan.baseline_results
    p = r.placement
    hows = [h for _, _, h in plan.history]
    points, bounded, scheduled = hows.count("ratio"), hows.count("bound"), hows.count("exact")
    print(f"| {name} | {a.tensor_units}x{a.array}^2 TU, {a.vector_units}x{a.vector_width} VU, "
          f"{a.buffer / 2**20:.0f} MiB | {a.area():.0f} | p{len(p.stages)} d{p.data_parallel} "
          f"t{'/'.join(str(t) for t in sorted({s.width for s in p.stages}))} mb{r.microbatch} "
          f"| {r.throughput:,.1f} | {b.throughput:,.1f} | {plan.score:.3f}x | "
          f"{points} / {bounded} / {scheduled} | {plan.seconds:.0f} |")
    ratios.append(plan.score)
    times.append(plan.seconds)
    if opts.plot and name == models[0]:
      plan.plot(opts.plot)
  print()
  print(f"Throughput against the TPUv4-like baseline: min {min(ratios):.3f}x, median "
        f"{statistics.median(ratios):.3f}x over {len(ratios)} models; search time median "
        f"{statistics.median(times):.0f} s, max {max(times):.0f} s per model (2 cores).")


if __name__ == "__main__":
  main()
