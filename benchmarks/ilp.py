"""MCTS against the exact ILP, and both against the best tactic.

For small programs (GPT train steps, an MLP train step) on several meshes,
tpu-v4 costs: the best expert tactic, MCTS (200 episodes, layer groups
found from structure), and `search="ilp"` (per-op strategies on CP-SAT,
warm-started from that MCTS plan, within the budget's seconds), every plan
re-priced by the cost model from scratch. "bound" is the solver's proven
lower bound on any plan of its model; "optimal" means it closed the gap.
Nothing is compiled. Prints a Markdown table.

  python benchmarks/ilp.py --seconds 60
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from automap._src import api, trace  # noqa: E402
from automap._src.cost import Tracker  # noqa: E402
from automap._src.hardware import get_hardware  # noqa: E402
from automap._src.models.gpt import GPTConfig, make_train_step  # noqa: E402
from automap._src.program import Program  # noqa: E402
from automap._src.search.actions import ActionSpace  # noqa: E402
from automap._src.sharding import MeshSpec  # noqa: E402

NAMES = ("data", "model", "seq")


def shapes_only(args):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)


def mlp_step():
  """A 2-matmul MLP regression train step (sgd), batch 64, width 1024."""
  def step(params, x, y):
    def loss(p):
      return jnp.mean((jax.nn.gelu(x @ p["w1"]) @ p["w2"] - y) ** 2)
    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 1e-2 * g, params, grads)
  f32 = jnp.float32
  args = ({"w1": jax.ShapeDtypeStruct((1024, 4096), f32),
           "w2": jax.ShapeDtypeStruct((4096, 1024), f32)},
          jax.ShapeDtypeStruct((64, 1024), f32), jax.ShapeDtypeStruct((64, 1024), f32))
  return step, args


def programs():
  for layers in (2, 12):
    gpt = GPTConfig(vocab=512, seq=128, hidden=512, heads=8, layers=layers)
    yield f"GPT {layers}L h512", *make_train_step(gpt, batch=32, abstract=True)
  small = GPTConfig(vocab=128, seq=16, hidden=128, heads=4, layers=2)
  step, args = make_train_step(small, batch=8)
  yield "GPT 2L h128", step, shapes_only(args)
  yield "MLP 1024x4096", *mlp_step()


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--seconds", type=float, default=60.0)
  parser.add_argument("--episodes", type=int, default=200)
  parser.add_argument("--meshes", nargs="+", default=["8,1", "4,2", "2,4", "2,2,2"])
  opts = parser.parse_args()
  meshes = [tuple(int(n) for n in m.split(",")) for m in opts.meshes]
  print("| program | mesh | best tactic ms | MCTS ms | ILP ms | ILP bound ms | ILP status "
        "| MCTS / ILP | ILP s | ILP choices |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for name, step, args in programs():
    traced = trace.trace(step, args)
    for shape in meshes:
      mesh = MeshSpec(NAMES[:len(shape)], shape)
      program = Program.build(traced, mesh, get_hardware("tpu-v4"))
      space = ActionSpace(program)
      request = api._Request.of(None, api.Budget(episodes=opts.episodes,
                                                 seconds=opts.seconds), None, 0, "ilp")
      t = time.perf_counter()
      found = api._run_ilp(program, space, request)
      ilp_s = time.perf_counter() - t
      start = program.initial_state()
      best = min(Tracker(program.model, s).step_time for s in
                 [start] + [_applied(space, start, tactic) for tactic in space.tactics])
      ms = {"mcts": found.stats["warm_start"]["step_time"] * 1e3,
            "ilp": Tracker(program.model, found.state).step_time * 1e3}
      stats = found.stats
      print(f"| {name} | {shape} | {best * 1e3:.3f} | {ms['mcts']:.3f} | {ms['ilp']:.3f} "
            f"| {stats['bound'] * 1e3:.3f} | {stats['status']} "
            f"| {ms['mcts'] / ms['ilp']:.3f} | {ilp_s:.1f} | {stats['choices']:,} |",
            flush=True)


def _applied(space, start, tactic):
  state = start.copy()
  space.apply(state, tactic)
  return state


if __name__ == "__main__":
  main()
