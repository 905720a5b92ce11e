"""Search quality and speed against the hand-written experts.

For GPT train steps of L layers on several meshes: the best of the expert
strategies (data parallel, Megatron, Megatron + data parallel, FSDP) under
the cost model, then MCTS with and without layer-group hints: episodes and
seconds until its plan is within 1% of that best, and the final ratio
found / expert after the episode budget. Nothing is compiled. Prints a
Markdown table.

  python benchmarks/search.py --layers 2 12 24 48 [--plot benchmarks/search.png]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import automap  # noqa: E402
from automap._src.cost.program import Program  # noqa: E402
from automap._src.cost.tracker import Tracker  # noqa: E402
from automap._src.ir import trace  # noqa: E402
from automap._src.search import mcts  # noqa: E402
from automap._src.search.actions import ActionSpace  # noqa: E402
from automap._src.sharding.mesh import MeshSpec  # noqa: E402
from automap._src.sharding.state import flat_specs  # noqa: E402
from automap.zoo import GPTConfig, gpt_train_step, megatron_specs  # noqa: E402

MESHES = [(8, 1), (4, 2), (2, 4), (1, 8), (2, 2, 2)]
NAMES = ("data", "model", "seq")


def fsdp_specs(args, axes: tuple[str, ...], devices: int):
  """Batch over every axis; each parameter and moment split along its
  largest dimension the device count divides."""
  def spec(path, x):
    if jax.tree_util.keystr(path[:1], simple=True) == "2":
      return P(axes)
    for d in sorted(range(x.ndim), key=lambda d: -x.shape[d]):
      if x.shape[d] % devices == 0:
        return P(*([None] * d), axes)
    return P()
  return jax.tree_util.tree_map_with_path(spec, args)


def experts(args, mesh: MeshSpec) -> dict:
  names = mesh.axis_names
  data = tuple(n for n in names if n != "model")
  everything = tuple(names)
  return {
      "data parallel": megatron_specs(args, everything, None),
      "Megatron": megatron_specs(args, None, "model"),
      "Megatron+DP": megatron_specs(args, data, "model"),
      "FSDP": fsdp_specs(args, everything, mesh.num_devices),
  }


def run(traced, args, mesh: MeshSpec, patterns, episodes: int, target: float) -> dict:
  program = Program.build(traced, mesh, automap.HARDWARE["tpu-v4"])
  t = time.perf_counter()
  space = ActionSpace(program, patterns)
  search = mcts.Search(program, space, None, seed=0)
  hit, curve = {}, []

  def progress(s):
    curve.append((s.episodes, s.best.score[1] / target))
    if not hit and s.best.score[1] <= target * 1.01:
      hit.update(episodes=s.episodes, seconds=time.perf_counter() - t)

  result = search.run(episodes, 600.0, progress)
  found = Tracker(program.model, result.state).step_time  # re-costed from scratch
  return {"to_1pct": hit.get("episodes"), "seconds_1pct": hit.get("seconds"),
          "ratio": found / target, "seconds": time.perf_counter() - t,
          "groups": len(space.groups), "curve": curve}


def plot(curves: dict, path: str) -> None:
  """Best plan / best expert against episodes, one line per search."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for (layers, hint), curve in curves.items():
    episodes, ratio = zip(*curve)
    ax.plot(episodes, ratio, "-" if hint == "block_*" else "--",
            label=f"{layers} layers, hints: {hint}")
  ax.axhline(1.0, color="grey", lw=0.8)
  ax.set_xlabel("episodes")
  ax.set_ylabel("best plan step time / best expert")
  ax.set_title("MCTS search efficiency, GPT train steps on a (4, 2) mesh")
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--layers", type=int, nargs="+", default=[2, 12, 24])
  parser.add_argument("--episodes", type=int, default=200)
  parser.add_argument("--plot", default=None,
                      help="write a PNG of best plan against episodes on (4, 2) here")
  args_ = parser.parse_args()
  curves = {}
  print("| layers | mesh | best expert | expert ms | hints | groups | episodes to 1% "
        "| s to 1% | found / expert | s total |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for layers in args_.layers:
    config = GPTConfig(vocab=512, seq=128, hidden=512, heads=8, layers=layers)
    step, args = gpt_train_step(config, batch=32, abstract=True)
    traced = trace.trace(step, args)
    for shape in MESHES:
      mesh = MeshSpec(NAMES[:len(shape)], shape)
      program = Program.build(traced, mesh, automap.HARDWARE["tpu-v4"])
      costs = {}
      for name, specs in experts(args, mesh).items():
        state = program.state_from_specs(flat_specs(specs, args))
        costs[name] = Tracker(program.model, state).step_time
      best = min(costs, key=costs.get)
      for patterns in (("block_*",), ()):
        r = run(traced, args, mesh, patterns, args_.episodes, costs[best])
        hint = "block_*" if patterns else "none"
        if shape == (4, 2):
          curves[layers, hint] = r["curve"]
        to = "-" if r["to_1pct"] is None else str(r["to_1pct"])
        secs = "-" if r["seconds_1pct"] is None else f"{r['seconds_1pct']:.2f}"
        print(f"| {layers} | {shape} | {best} | {costs[best] * 1e3:.3f} | {hint} | "
              f"{r['groups']} | {to} | {secs} | {r['ratio']:.3f} | {r['seconds']:.1f} |",
              flush=True)
  if args_.plot and curves:
    plot(curves, args_.plot)


if __name__ == "__main__":
  main()
