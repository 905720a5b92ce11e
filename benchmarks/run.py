"""Runs the benchmark suite and writes its results.

Each section runs one script of this folder in a fresh process and records
its output under the exact command and the machine it ran on; plots are
written next to this file. The full suite takes under an hour on 2 cores
(the outside-code section, which needs the `outside` extra, 20 minutes);
`--quick` runs a few minutes' subset and writes RESULTS.quick.md.

  python benchmarks/run.py [--quick] [--only quality scale ...]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time

import jax

HERE = os.path.dirname(os.path.abspath(__file__))

# name -> (title, full arguments, quick arguments)
SECTIONS = {
    "quality": ("Quality: automap against the experts, MCTS against the ILP",
                ["--ilp-seconds", "4"], ["--quick", "--ilp-seconds", "4"]),
    "fidelity": ("Fidelity: predicted against compiled", ["--ilp-seconds", "2"],
                 ["--quick"]),
    "constraints": ("Constraints: the user's own layout, priced", [], ["--quick"]),
    # Needs the `outside` extra (README): other libraries' model code.
    "outside": ("Other people's model code: six libraries, priced and judged compiled", [],
                ["--quick"]),
    "search": ("Search efficiency: MCTS against the experts, with and without hints",
               ["--layers", "2", "12", "24", "--plot", "benchmarks/search.png"],
               ["--layers", "2", "--episodes", "100", "--plot", "benchmarks/search.png"]),
    "scale": ("Scale: 1k to 100k equations",
              ["--layers", "2", "6", "24", "96", "232", "--plot", "benchmarks/scale.png"],
              ["--layers", "2", "6", "24", "--actions", "20", "--seconds", "5",
               "--plot", "benchmarks/scale.png"]),
    "budget": ("Search budget honoured", ["--ilp-seconds", "5", "10"],
               ["--seconds", "1", "--ilp-seconds"]),
    "cache": ("Plan cache", ["--layers", "4", "24"], ["--layers", "4"]),
    "policy": ("Learned policy against uniform priors", ["--seeds", "15"], ["--quick"]),
    "measured": ("Published training runs: predicted against measured throughput",
                 ["--fit", "--planner"], ["--only", "narayanan21-t1"]),
    "experts": ("Mixtures of experts against hand-written expert parallelism, compiled",
                ["--programs", "10"], ["--programs", "2"]),
    "pod_scale": ("Pod scale: llama shapes on 256 to 8,192 devices, predicted",
                  ["--seconds", "30"], ["--only", "8b-256-tpu-v5p", "--seconds", "10"]),
    "cluster": ("Cluster planning against fixed Megatron-style splits", [], ["--quick"]),
    "pipeline_run": ("Cluster plans run: measured on 8 CPU devices against the plan's price",
                     [], ["--steps", "2", "--rows", "p4d2"]),
    "accelerator": ("Accelerator co-search against a TPUv4-like baseline",
                    ["--plot", "benchmarks/accelerator.png"],
                    ["--quick", "--plot", "benchmarks/accelerator.png"]),
}


def machine() -> str:
  memory = "?"
  try:
    with open("/proc/meminfo") as f:
      kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
      memory = f"{kib / 2**20:.0f} GiB"
  except (OSError, StopIteration, ValueError):
    pass
  return (f"{platform.machine()}, {os.cpu_count()} CPU cores, {memory} RAM, no "
          f"accelerator; Python {platform.python_version()}, jax {jax.__version__}, "
          "8 simulated CPU devices")


def describe(script: str) -> str:
  """The first paragraph after the title of a script's docstring."""
  with open(os.path.join(HERE, f"{script}.py")) as f:
    text = f.read().split('"""')[1]
  paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
  return " ".join(paragraphs[1].split()) if len(paragraphs) > 1 else ""


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--only", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
  parser.add_argument("--out", default=None)
  opts = parser.parse_args()
  out = opts.out or os.path.join(HERE, "RESULTS.quick.md" if opts.quick else "RESULTS.md")
  root = os.path.dirname(HERE)
  lines = ["# Benchmark results", "",
           f"Written by `python benchmarks/run.py{' --quick' if opts.quick else ''}` on "
           f"{datetime.date.today().isoformat()}. Machine: {machine()}. The machine is "
           "shared and noisy: times are single runs or medians, comparisons are side "
           "by side in one run. Costs are the cost model's predictions for tpu-v4 "
           "unless a section says otherwise.", ""]
  total = time.perf_counter()
  for name in opts.only:
    title, full, quick = SECTIONS[name]
    argv = quick if opts.quick else full
    command = " ".join(["python", f"benchmarks/{name}.py", *argv])
    print(f"running: {command}", file=sys.stderr, flush=True)
    t = time.perf_counter()
    run = subprocess.run([sys.executable, os.path.join(HERE, f"{name}.py"), *argv],
                         cwd=root, capture_output=True, text=True)
    minutes = (time.perf_counter() - t) / 60
    lines += [f"## {title}", "", describe(name), "",
              f"Command: `{command}` ({minutes:.1f} min)", ""]
    lines += [run.stdout.rstrip(), ""]
    if run.returncode:
      lines += ["**The command failed:**", "", "```", run.stderr.strip()[-3000:], "```", ""]
    for plot in ("search", "scale", "accelerator"):
      if name == plot and f"benchmarks/{plot}.png" in argv:
        lines += [f"![{title}]({plot}.png)", ""]
  lines += [f"Suite wall time: {(time.perf_counter() - total) / 60:.1f} min.", ""]
  with open(out, "w") as f:
    f.write("\n".join(lines))
  print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
  main()
