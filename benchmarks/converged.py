"""When the search is done: how long MCTS goes on finding better plans.

Rows: the plan-quality benchmark's programs (`automap.zoo.catalogue`) on
(4, 2) and (2, 2, 2) meshes, tpu-v4 specs, with no memory limit beyond the
device's and under a limit at half of data parallelism's peak (as
`automap.referee.expert_specs` prices it). Split by family before anything
ran: `fit` rows (the MLP and the GPTs, families the learned filter trained
on) choose `Budget.patience`; `validation` rows (T5, ViT, the mixtures of
experts, the graph network, held out of the filter's corpus) only report.

Per row and prior (`learned`, the default, and `uniform`), after a
one-episode warm-up, `automap.search` at the default budget runs twice: with `--patience`
(MCTS ends after that many episodes in a row without a better plan) and
without it (the whole budget). Each run keeps its episodes, the episodes
that found a better plan (`Plan.stats["improved_at"]`), its final step time
and peak after refinement, and its wall seconds.

The report gives, from the whole-budget runs, the longest stretch without a
better plan before a run's last improvement (a patience longer than it
loses none of that run's MCTS improvements), per split; and, side by side,
each patient run's final plan and wall time against its whole-budget twin.

  python benchmarks/converged.py [--patience 50] [--rows REGEX] [--out FILE]
  python benchmarks/converged.py --report FILE
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
from limits import HARDWARE, data_parallel  # noqa: E402  (the same yardstick)

import automap  # noqa: E402
from automap import zoo  # noqa: E402

MESHES = ((4, 2), (2, 2, 2))
PRIORS = ("learned", "uniform")
FIT = ("MLP", "GPT")  # families the learned filter trained on: they choose


def split_of(name: str) -> str:
  return "fit" if name.startswith(FIT) else "validation"


def search(step, args, mesh, limit, prior: str, patience: int | None) -> dict:
  t0 = time.perf_counter()
  try:
    plan = automap.search(
        step, *args, mesh=mesh, hardware=HARDWARE, memory_limit=limit,
        budget=automap.Budget(progress=False, patience=patience),
        **({} if prior == "learned" else {"policy": prior}))
  except automap.MemoryLimitError:  # no plan within the limit: kept as a miss
    return {"step": float("inf"), "fits": False, "seconds": time.perf_counter() - t0}
  return {"step": plan.cost.step_time, "peak": plan.cost.peak_memory,
          "fits": limit == "device" or plan.cost.peak_memory <= limit,
          "episodes": plan.stats["episodes"], "improved_at": plan.stats["improved_at"],
          "search_s": plan.timings.get("search"), "seconds": time.perf_counter() - t0}


def rows(pattern: str):
  for name, build in zoo.catalogue().items():
    for shape in MESHES:
      for limit in ("device", "half"):
        key = f"{name} {shape} {limit}"
        if re.search(pattern, key):
          yield key, name, build, shape, limit


def longest_wait(improved_at: list[int]) -> int:
  """Episodes of the longest stretch without a better plan before the
  last one found (0 where the first plan was the best)."""
  marks = [0, *improved_at]
  return max((b - a for a, b in zip(marks, marks[1:])), default=0)


def report(done: list[dict], patience: int) -> list[str]:
  lines = [f"| split | prior | runs | longest wait before the last improvement: median, max "
           f"| whole budget's runs with a longer wait than {patience} "
           f"| final with patience / whole budget: median, worst "
           f"| wall s with patience / whole budget: median, sum ratio |",
           "|---|---|---|---|---|---|---|"]
  for split in ("fit", "validation"):
    for prior in PRIORS:
      runs = [r for r in done if r["split"] == split and r["prior"] == prior]
      if not runs:
        continue
      waits = [longest_wait(r["whole"]["improved_at"]) for r in runs if r["whole"]["fits"]]
      finals = [r["patient"]["step"] / r["whole"]["step"] for r in runs
                if r["whole"]["fits"] and r["patient"]["fits"]]
      missed = sum(r["whole"]["fits"] and not r["patient"]["fits"] for r in runs)
      walls = [r["patient"]["seconds"] / r["whole"]["seconds"] for r in runs]
      summed = (sum(r["patient"]["seconds"] for r in runs)
                / sum(r["whole"]["seconds"] for r in runs))
      lines.append(
          f"| {split} | {prior} | {len(runs)} | {statistics.median(waits):.0f}, {max(waits)} "
          f"| {sum(w >= patience for w in waits)} "
          f"| {statistics.median(finals):.3f}, {max(finals):.3f}"
          + (f" ({missed} no longer fit)" if missed else "")
          + f" | {statistics.median(walls):.2f}, {summed:.2f} |")
  return lines


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--patience", type=int, default=50)
  parser.add_argument("--rows", default=".*", help="a regex the row keys must match")
  parser.add_argument("--out", default=None, help="JSON lines, one per row (resumable)")
  parser.add_argument("--report", default=None, help="report a finished --out file")
  opts = parser.parse_args()
  warnings.simplefilter("ignore")
  if opts.report:
    with open(opts.report) as f:
      done = [json.loads(line) for line in f if line.strip()]
    print("\n".join(report(done, done[0]["patience"])))
    return
  done = []
  seen = set()
  if opts.out and os.path.exists(opts.out):
    with open(opts.out) as f:
      done = [json.loads(line) for line in f if line.strip()]
    seen = {(r["row"], r["prior"]) for r in done}
  for key, name, build, shape, which in rows(opts.rows):
    step, args = build()
    mesh = jax.sharding.AbstractMesh(shape, ("data", "model", "seq")[:len(shape)])
    limit = "device" if which == "device" else 0.5 * data_parallel(step, args, mesh).peak_memory
    for prior in PRIORS:
      if (key, prior) in seen:
        continue
      # Once per process and program size (the filter's network compile,
      # the cost kernels' load): paid here, by neither timed run.
      search(step, args, mesh, limit, prior, 1)
      row = {"row": key, "split": split_of(name), "prior": prior, "patience": opts.patience,
             "patient": search(step, args, mesh, limit, prior, opts.patience),
             "whole": search(step, args, mesh, limit, prior, None)}
      done.append(row)
      if opts.out:
        with open(opts.out, "a") as f:
          f.write(json.dumps(row) + "\n")
      p, w = row["patient"], row["whole"]
      print(f"{key} {prior}: episodes {p.get('episodes')} / {w.get('episodes')}, "
            f"final {p['step'] / w['step']:.3f}, wall {p['seconds']:.1f} / {w['seconds']:.1f} s, "
            f"improved at {w.get('improved_at')}", flush=True)
  print("\n".join(report(done, opts.patience)))


if __name__ == "__main__":
  main()
