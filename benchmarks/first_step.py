"""automap's own time: a step's first call beside `jax.jit`'s, in one process.

Rows (8 simulated CPU devices, a cold plan cache, the default budget):

- unpipelined: a MaxText-style llama decoder (width 256, the layers
  unrolled as HuggingFace writes them, or one `nn.scan`) as its AdamW train
  step, `automap.partition(step, mesh=(4, 2))`'s first call (trace, search,
  compile, run) beside `jax.jit(step)`'s first call on the same arguments;
  then a second `partition` of the same step over a warm plan cache (its
  first call: trace, the plan read back, compile, run), which should add
  under a second to `jax.jit`'s.
- pipelined: the scanned llama (width 128) as a loss, `price_cluster` with
  2 stages x 4 replicas and the plan's first `train_step` call beside the
  unpipelined `jax.jit` step's first call (a step's own run: its second
  `train_step` call).

Each row prints seconds and the ratio automap / jax.jit, the same less a
step's own run (the second call's time: on 8 simulated devices sharing two
cores, running the partitioned step takes seconds of its own), and
automap's split (`Plan.timings`: trace and plan, search, refine).

  python benchmarks/first_step.py [--layers 8,32,64,128] [--kinds unrolled,scanned,pipelined]
  python benchmarks/first_step.py --hit-parts --kinds scanned --layers 8,32
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import optax  # noqa: E402

import automap  # noqa: E402
from automap import cluster, zoo  # noqa: E402

TX = optax.adam(1e-3)


def _timed(fn, *args):
  t = time.perf_counter()
  out = fn(*args)
  jax.block_until_ready(out)
  return time.perf_counter() - t


def _llama_step(layers: int, scanned: bool):
  """The unpipelined rows' llama train step (width 256), its arguments and
  the (4, 2) mesh."""
  config = zoo.LlamaConfig(embed=256, mlp=512, layers=layers, unrolled=not scanned)
  step, args = zoo.llama_train_step(config, constrained=False)
  return step, args, jax.make_mesh((4, 2), ("data", "model"))


def unpipelined(layers: int, scanned: bool) -> dict:
  """A llama train step's first call, partitioned and jitted; and
  partitioned over a warm plan cache."""
  step, args, mesh = _llama_step(layers, scanned)
  jit = jax.jit(step)
  jitted = _timed(jit, *args)
  jit_run = _timed(jit, *args)
  planned = automap.partition(step, mesh=mesh, cache=False)
  first = _timed(planned, *args)
  run = _timed(planned, *args)
  with tempfile.TemporaryDirectory() as cache:
    automap.partition(step, mesh=mesh, cache=cache)(*args)  # fills the cache
    hit = _timed(automap.partition(step, mesh=mesh, cache=cache), *args)
  return {"jit": jitted, "jit_run": jit_run, "first": first, "run": run, "hit": hit,
          "timings": dict(planned.plan.timings)}


def hit_parts(layers: int, scanned: bool) -> dict:
  """A plan-cache hit taken apart, each part timed alone: the trace, plan
  read and lowering (`Partitioned.lower`), the arguments' placement on the
  compiled program's input shardings (first and again), the compile, and
  two runs of the compiled step; `jax.jit(step)`'s first and second calls
  beside it."""
  step, args, mesh = _llama_step(layers, scanned)
  out = {}
  with tempfile.TemporaryDirectory() as cache:
    automap.search(step, *args, mesh=mesh, cache=cache)  # fills the cache
    planned = automap.partition(step, mesh=mesh, cache=cache)
    t = time.perf_counter()
    lowered = planned.lower(*args)
    out["lower"] = time.perf_counter() - t
  t = time.perf_counter()
  compiled = lowered.compile()
  out["compile"] = time.perf_counter() - t
  shardings = compiled.input_shardings[0]
  out["place"] = _timed(jax.device_put, args, shardings)
  out["place_again"] = _timed(jax.device_put, args, shardings)
  placed = jax.device_put(args, shardings)
  out["run"] = _timed(compiled, *placed)
  out["run_again"] = _timed(compiled, *placed)
  jit = jax.jit(step)
  out["jit"], out["jit_run"] = _timed(jit, *args), _timed(jit, *args)
  return out


def pipelined(layers: int) -> dict:
  """`price_cluster` and the first `train_step` call of a 2-stage plan of a
  scanned llama, beside the unpipelined jitted step's first call."""
  loss, params, batch = zoo.llama_loss(zoo.LlamaConfig(
      vocab=256, embed=128, mlp=256, heads=4, kv_heads=2, head_dim=32, layers=layers, seq=32,
      batch=16))

  def step(params, opt_state, *batch):
    value, grads = jax.value_and_grad(loss)(params, *batch)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  opt_state = TX.init(params)
  jit = jax.jit(step)
  jitted = _timed(jit, params, opt_state, *batch)
  jit_run = _timed(jit, params, opt_state, *batch)
  t = time.perf_counter()
  plan = cluster.price_cluster(loss, params, *batch, config=cluster.ClusterConfig(
      pipeline=2, data=4, microbatch=2), global_batch=16, hardware="cpu")
  priced = time.perf_counter() - t
  run = plan.train_step(loss, TX, params, *batch)
  state, value = run(run.init(params), *batch)
  jax.block_until_ready(value)
  first = time.perf_counter() - t
  again = _timed(lambda: run(state, *batch)[1])
  return {"jit": jitted, "jit_run": jit_run, "first": first, "run": again, "priced": priced,
          "programs": len(run.programs)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", default="8,32,64,128")
  parser.add_argument("--kinds", default="unrolled,scanned,pipelined")
  parser.add_argument("--hit-parts", action="store_true",
                      help="take a plan-cache hit apart instead (scanned and unrolled kinds)")
  args = parser.parse_args()
  if args.hit_parts:
    print("| step | layers | trace, plan read, lower s | first placement s (again) | compile s "
          "| partitioned run s: first, second | jax.jit: first call, second s |")
    print("|---|---|---|---|---|---|---|")
    for kind in args.kinds.split(","):
      for layers in map(int, args.layers.split(",")):
        if kind != "pipelined":
          r = hit_parts(layers, kind == "scanned")
          print(f"| {kind} | {layers} | {r['lower']:.2f} | {r['place']:.2f} "
                f"({r['place_again']:.2f}) | {r['compile']:.2f} | {r['run']:.2f}, "
                f"{r['run_again']:.2f} | {r['jit']:.2f}, {r['jit_run']:.2f} |", flush=True)
    return
  print("| step | layers | jax.jit first call s | automap first call s | automap / jax.jit | "
        "less a step's run: jax.jit, automap, ratio | cache hit s | hit's wait over jax.jit's s "
        "| automap's split |")
  print("|---|---|---|---|---|---|---|---|---|")
  for kind in args.kinds.split(","):
    for layers in map(int, args.layers.split(",")):
      if kind == "pipelined":
        r = pipelined(layers)
        hit = ("-", "-")
        split = f"price_cluster {r['priced']:.1f} s, {r['programs']} programs"
      else:
        r = unpipelined(layers, kind == "scanned")
      # The wait a first call adds to a step's run: on 8 simulated devices
      # sharing two cores, running the step is itself seconds.
      mine, theirs = r["first"] - r["run"], r["jit"] - r["jit_run"]
      waits = f"{theirs:.1f}, {mine:.1f}, {mine / theirs:.1f}x"
      if kind != "pipelined":
        hit = f"{r['hit']:.1f}", f"{(r['hit'] - r['run']) - theirs:+.1f}"
        t = r["timings"]
        split = ", ".join(f"{k} {t[k]:.1f} s" for k in ("plan", "search", "refine") if k in t)
      print(f"| {kind} | {layers} | {r['jit']:.1f} | {r['first']:.1f} | "
            f"{r['first'] / r['jit']:.1f}x | {waits} | {hit[0]} | {hit[1]} | {split} |",
            flush=True)


if __name__ == "__main__":
  main()
