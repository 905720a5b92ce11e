"""The plan a user gets under a memory limit: each prior's final plan at
the same budget.

Rows: train steps on (4, 2) and (2, 2, 2) meshes (tpu-v4 specs) under a
memory limit at half of data parallelism's peak (as
`automap.referee.expert_specs` prices it): a small GPT, llama-style
decoders of 2 and 4 layers, a ViT, a T5-style encoder-decoder and a
mixture-of-experts layer. Per row and seed, the final plan of
`automap.search` at the default budget (200 episodes or 60 s, with
refinement) with each prior: `learned` (the default, no `policy=`),
`lookahead` and `uniform`. A search that finds no plan within the limit
is a miss.

The target of a row is the fastest fitting plan any run found; the table
gives each prior's median final step time over it, and the summary on how
many rows each prior ends within 2% of the target.

  python benchmarks/limits.py [--seeds 2] [--rows REGEX] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
import types
import warnings

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

import automap  # noqa: E402
from automap import referee, zoo  # noqa: E402

PROGRAMS = {
    "gpt-small": lambda: zoo.gpt_step(),
    "llama-2L": lambda: zoo.llama_train_step(zoo.LlamaConfig(layers=2)),
    "llama-4L": lambda: zoo.llama_train_step(zoo.LlamaConfig(layers=4)),
    "vit-2L": lambda: zoo.vit(layers=2, width=192, batch=32),
    "t5-1+1L": lambda: zoo.encoder_decoder(layers=1, width=256, seq=64),
    "moe": lambda: zoo.moe(experts=8, width=256, hidden=1024, tokens=1024),
}
MESHES = ((4, 2), (2, 2, 2))
METHODS = ("learned", "lookahead", "uniform")
HARDWARE = "tpu-v4"


def data_parallel(step, args, mesh) -> automap.Cost:
  """Data parallelism's price, as the expert yardstick lays it out."""
  program = types.SimpleNamespace(fn=step, args=args, names=None)
  experts, _ = referee.expert_specs(program, mesh, automap.HARDWARE[HARDWARE])
  return experts["data parallel"][2]


def final(step, args, mesh, method: str, seed: int, limit: float) -> dict:
  """One search's final plan with the prior `method` names."""
  t0 = time.perf_counter()
  try:
    plan = automap.search(step, *args, mesh=mesh, hardware=HARDWARE, memory_limit=limit,
                          seed=seed, budget=automap.Budget(progress=False),
                          **({} if method == "learned" else {"policy": method}))
  except automap.MemoryLimitError:  # no plan it found fits: a miss, not a crash
    return {"step": float("inf"), "peak": float("nan"), "fits": False,
            "seconds": time.perf_counter() - t0}
  return {"step": plan.cost.step_time, "peak": plan.cost.peak_memory,
          "fits": plan.cost.peak_memory <= limit, "seconds": time.perf_counter() - t0}


def run_row(name: str, shape, seeds: int) -> dict:
  step, args = PROGRAMS[name]()
  names = ("data", "model", "seq")[:len(shape)]
  mesh = jax.sharding.AbstractMesh(shape, names)
  limit = 0.5 * data_parallel(step, args, mesh).peak_memory
  row = {"row": f"{name} {shape}", "limit": limit, "runs": {}}
  for method in METHODS:
    row["runs"][method] = [final(step, args, mesh, method, seed, limit)
                           for seed in range(seeds)]
  return row


def report(rows: list[dict], methods=METHODS) -> list[str]:
  lines = ["| row | limit MiB | " + " | ".join(f"{m}: median final / target"
                                                 for m in methods) + " |",
           "|---|---|" + "---|" * len(methods)]
  within = dict.fromkeys(methods, 0)
  scored = 0
  for row in rows:
    fitting = [r["step"] for runs in row["runs"].values() for r in runs if r["fits"]]
    if not fitting:
      lines.append(f"| {row['row']} | {row['limit'] / 2**20:.1f} | "
                   + " | ".join("no plan fits" for _ in methods) + " |")
      continue
    scored += 1
    target = min(fitting)
    med = {m: statistics.median(r["step"] if r["fits"] else float("inf")
                                for r in row["runs"][m]) / target for m in methods}
    for m in methods:
      within[m] += med[m] <= 1.02
    lines.append(f"| {row['row']} | {row['limit'] / 2**20:.1f} | "
                 + " | ".join(f"{med[m]:.3f}" for m in methods) + " |")
  lines += ["", "- within 2% of the target: " + ", ".join(
      f"{m} on {within[m]} of {scored} rows" for m in methods)]
  return lines


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--rows", default=".*", help="a regex the row names must match")
  parser.add_argument("--out", default=None, help="JSON lines, one per row (resumable)")
  opts = parser.parse_args()
  warnings.simplefilter("ignore")
  done = {}
  if opts.out and os.path.exists(opts.out):
    with open(opts.out) as f:
      done = {r["row"]: r for r in map(json.loads, f) if r}
  rows = []
  for name in PROGRAMS:
    for shape in MESHES:
      key = f"{name} {shape}"
      if not re.search(opts.rows, key):
        continue
      row = done.get(key) or run_row(name, shape, opts.seeds)
      if opts.out and key not in done:
        with open(opts.out, "a") as f:
          f.write(json.dumps(row) + "\n")
      rows.append(row)
      print(report([row])[2], flush=True)
  print("\n".join(report(rows)))


if __name__ == "__main__":
  main()
