"""Which clock ranks the plans: a snapshot of searches through the public API.

Runs `automap.search` over small programs of six families x four 8-device
meshes x memory limits x seeds x three hardware specs, and records each
plan's argument layouts and cost. `--record` writes the snapshot
(`clock_snapshot.json`); `--check` searches again and compares:

- on the `cpu` spec, where XLA runs collectives in place, plans and costs
  must be identical to the snapshot (the clock did not change there);
- on `tpu-v4` and `h100`, where the searches now minimise the overlapped
  step time, each new plan is priced beside the recorded one on the
  current clock (`automap.evaluate` of the recorded layouts) and must not
  be slower.

  python benchmarks/clock.py --record   # before a change to the clock
  python benchmarks/clock.py --check    # after it
  python benchmarks/clock.py --compare  # the last --check's searches again
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import automap  # noqa: E402
from automap import zoo as programs  # noqa: E402

SNAPSHOT = os.path.join(os.path.dirname(__file__), "clock_snapshot.json")
MESHES = {(8,): ("data",), (4, 2): ("data", "model"), (2, 4): ("data", "model"),
          (2, 2, 2): ("data", "model", "seq")}
EPISODES = 40


def _programs() -> dict:
  tiny = {"MLP 128x512": lambda: programs.mlp(width=128, hidden=512, batch=32),
          "GPT 2L h128": lambda: _gpt(2, 128)}
  return tiny | programs.small()


def _gpt(layers: int, hidden: int):
  config = programs.GPTConfig(vocab=256, seq=32, hidden=hidden, heads=4, layers=layers)
  return programs.gpt_train_step(config, batch=8, abstract=True)


def rows():
  """(key, program name, mesh shape, hardware, memory_limit, seed) per search:
  every program, mesh and seed on cpu with no memory limit and with a tight
  one (three quarters of the unlimited plan's peak) (96), and every program
  and mesh once on tpu-v4 and h100 (48)."""
  out = []
  for name in _programs():
    for shape in MESHES:
      for limit in (None, "tight"):
        for seed in (0, 1):
          out.append((name, shape, "cpu", limit, seed))
      for hw in ("tpu-v4", "h100"):
        out.append((name, shape, hw, None, 0))
  return [("|".join(map(str, r)), *r) for r in out]


def _specs(plan) -> list[str]:
  return [str(s) for s in jax.tree.leaves(
      plan.in_shardings, is_leaf=lambda x: isinstance(x, P) or x is None)]


def _search(step, args, mesh, hw, limit, seed):
  return automap.search(step, *args, mesh=mesh, hardware=hw, memory_limit=limit, seed=seed,
                        budget=automap.Budget(episodes=EPISODES, seconds=1e6, progress=False))


def _cost(cost) -> dict:
  return {"step_time": cost.step_time, "serial_step_time": cost.compute_time + cost.comm_time,
          "compute_time": cost.compute_time, "comm_time": cost.comm_time,
          "exposed_comm_time": cost.exposed_comm_time, "peak_memory": cost.peak_memory,
          "comm_bytes": cost.total_comm_bytes}


def run(keys: set[str] | None = None) -> dict:
  builders, out, built = _programs(), {}, {}
  for key, name, shape, hw, limit, seed in rows():
    if keys is not None and key not in keys:
      continue
    if name not in built:
      built[name] = builders[name]()
    step, args = built[name]
    mesh = jax.make_mesh(shape, MESHES[shape])
    if limit == "tight":
      free = _search(step, args, mesh, hw, None, seed)
      limit = 0.75 * free.cost.peak_memory
    t = time.perf_counter()
    try:
      plan = _search(step, args, mesh, hw, limit, seed)
    except automap.MemoryLimitError as e:
      out[key] = {"error": str(e).splitlines()[0]}
      print(f"{key:<48} does not fit", flush=True)
      continue
    out[key] = {"specs": _specs(plan), "cost": _cost(plan.cost),
                "seconds": time.perf_counter() - t}
    print(f"{key:<48} {plan.cost.step_time * 1e3:9.4f} ms  {out[key]['seconds']:5.1f} s",
          flush=True)
  return out


def _spec_of(text: str):
  return None if text == "None" else eval(text, {"P": P, "PartitionSpec": P})  # noqa: S307


def check(snapshot: dict, new: dict) -> int:
  builders, built, failures, moved = _programs(), {}, 0, []
  for key, old in snapshot.items():
    name, shape, hw = key.split("|")[:3]
    now = new[key]
    if "error" in old or "error" in now:
      if old.get("error") != now.get("error"):
        failures += 1
        print(f"CHANGED fit: {key}")
      continue
    if hw == "cpu":
      same = now["specs"] == old["specs"] and all(
          abs(now["cost"][k] - v) <= 1e-9 * max(abs(v), 1e-30)
          for k, v in old["cost"].items() if k in ("step_time", "peak_memory", "comm_bytes"))
      if not same:
        failures += 1
        print(f"CHANGED on cpu: {key}")
      continue
    if name not in built:
      built[name] = builders[name]()
    step, args = built[name]
    shape = tuple(int(x) for x in shape.strip("()").split(",") if x.strip())
    mesh = jax.make_mesh(shape, MESHES[shape])
    flat, tree = jax.tree.flatten(args, is_leaf=lambda x: x is None)
    specs = jax.tree.unflatten(tree, [_spec_of(s) for s in old["specs"]])
    before = automap.evaluate(step, *args, mesh=mesh, hardware=hw, in_shardings=specs)
    ratio = now["cost"]["step_time"] / before.step_time
    moved.append((key, before.step_time, now["cost"]["step_time"], ratio))
    if ratio > 1 + 1e-6:
      failures += 1
  print("\n| search | recorded plan, ms | new plan, ms | new / recorded |\n|---|---:|---:|---:|")
  for key, b, n, r in moved:
    print(f"| {key} | {b * 1e3:.4f} | {n * 1e3:.4f} | {r:.3f} |")
  cpu = sum(1 for k in snapshot if "|cpu|" in k)
  print(f"\ncpu: {cpu} searches, {failures} changed or slower in all")
  return failures


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--record", action="store_true")
  parser.add_argument("--check", action="store_true")
  parser.add_argument("--now", default=os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                    "automap_clock_now.json"),
                      help="where --check keeps its searches (reused with --compare)")
  parser.add_argument("--compare", action="store_true",
                      help="compare the searches --check kept, without searching again")
  a = parser.parse_args()
  jnp.zeros(())  # devices up before timing
  if a.record:
    with open(SNAPSHOT, "w") as f:
      json.dump(run(), f, indent=1)
  elif a.check or a.compare:
    with open(SNAPSHOT) as f:
      snapshot = json.load(f)
    if a.check:
      with open(a.now, "w") as f:
        json.dump(run(set(snapshot)), f)
    with open(a.now) as f:
      sys.exit(1 if check(snapshot, json.load(f)) else 0)
  else:
    parser.error("give --record, --check or --compare")


if __name__ == "__main__":
  main()
