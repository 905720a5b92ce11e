"""The plan a user gets under a memory limit: the default search's final
plan against each prior alone, at the same budget.

Rows: train steps on (4, 2) and (2, 2, 2) meshes (tpu-v4 specs) under a
memory limit at half of data parallelism's peak: a small GPT, llama-style
decoders of 2 and 4 layers, a ViT, a T5-style encoder-decoder and a
mixture-of-experts layer. Per row and seed, the final plan (`automap.search`
at the default budget, 200 episodes or 60 s, with refinement) of:

- `default`: what `automap.search` does with no `policy=`: where data
  parallelism does not fit the limit (every row here), the learned
  filter's MCTS on half the budget, the one-step lookahead's on the rest,
  refinement over both (`search/driver.py`, `_partner`);
- `learned`: the learned filter alone on the whole budget (the default
  before the lookahead shared it);
- `lookahead`, `uniform`: `policy="lookahead"`, `policy="uniform"`.

The target of a row is the fastest fitting plan any method's run found.
The table gives each method's median final step time over the target, and
the summary whether the default is within 2% of the target on every row
and never more than 1% slower than uniform or the lookahead.

  python benchmarks/limits.py [--seeds 3] [--rows REGEX] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
import warnings

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

import automap  # noqa: E402
from automap import zoo  # noqa: E402
from automap._src.search import driver  # noqa: E402

PROGRAMS = {
    "gpt-small": lambda: zoo.gpt_step(),
    "llama-2L": lambda: zoo.llama_train_step(zoo.LlamaConfig(layers=2)),
    "llama-4L": lambda: zoo.llama_train_step(zoo.LlamaConfig(layers=4)),
    "vit-2L": lambda: zoo.vit(layers=2, width=256, batch=32),
    "t5-1+1L": lambda: zoo.encoder_decoder(layers=1, width=256, seq=64),
    "moe": lambda: zoo.moe(experts=8, width=256, hidden=1024, tokens=1024),
}
MESHES = ((4, 2), (2, 2, 2))
METHODS = ("default", "learned", "lookahead", "uniform")
HARDWARE = "tpu-v4"


def data_parallel(step, args, mesh) -> automap.Cost:
  """Data parallelism's price: every batch over every axis, as the expert
  yardstick lays it out."""
  from automap._src.cost.hardware import get_hardware
  from automap._src.cost.tracker import Tracker
  from automap._src.plan import planner
  from automap._src.search.actions import ActionSpace
  from automap._src.search.tactics import expert_states

  program = planner.build_program(step, args, mesh, get_hardware(HARDWARE, mesh))
  state = expert_states(program, ActionSpace(program))["data parallel"]
  return Tracker(program.model, state).cost()


def final(step, args, mesh, method: str, seed: int, limit: float) -> dict:
  """One search's final plan, as the method runs it."""
  policy = None if method in ("default", "learned") else method
  partner = driver._partner
  if method == "learned":  # the filter alone: no second prior
    driver._partner = lambda *a: None
  try:
    t0 = time.perf_counter()
    plan = automap.search(step, *args, mesh=mesh, hardware=HARDWARE, memory_limit=limit,
                          seed=seed, budget=automap.Budget(progress=False),
                          **({} if policy is None else {"policy": policy}))
  finally:
    driver._partner = partner
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


def report(rows: list[dict]) -> list[str]:
  lines = ["| row | limit MiB | " + " | ".join(f"{m}: median final / target"
                                                 for m in METHODS) + " |",
           "|---|---|" + "---|" * len(METHODS)]
  misses, worse = [], []
  for row in rows:
    fitting = [r["step"] for runs in row["runs"].values() for r in runs if r["fits"]]
    if not fitting:
      lines.append(f"| {row['row']} | {row['limit'] / 2**20:.1f} | no method fits |")
      continue
    target = min(fitting)
    med = {m: statistics.median(r["step"] if r["fits"] else float("inf") for r in runs) / target
           for m, runs in row["runs"].items()}
    lines.append(f"| {row['row']} | {row['limit'] / 2**20:.1f} | "
                 + " | ".join(f"{med[m]:.3f}" for m in METHODS) + " |")
    if med["default"] > 1.02:
      misses.append(row["row"])
    if med["default"] > 1.01 * min(med["uniform"], med["lookahead"]):
      worse.append(row["row"])
  lines += ["", f"- default within 2% of the target on {len(rows) - len(misses)} of "
            f"{len(rows)} rows" + (f" (not: {', '.join(misses)})" if misses else ""),
            f"- default more than 1% slower than uniform or the lookahead on "
            f"{len(worse)} rows" + (f" ({', '.join(worse)})" if worse else "")]
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
