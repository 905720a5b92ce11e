"""Cluster plans run on 8 CPU devices: measured wall time against the plan's price.

Each row is a plan for a small GPT (tied embeddings), a MaxText-style llama
whose layers are one `nn.scan`, or a T5-style encoder-decoder, priced on the
`cpu` spec (`price_cluster` with a stated split), then run with
`plan.train_step` on 8 simulated CPU devices, beside the unpipelined `jax.jit`
step on one device. Per row: seconds per global batch (median of the timed
steps, after two warm-up steps that compile), the plan's predicted seconds,
and the bubble: predicted, the plan's (S - 1) / v of the slowest stage's time
per microbatch over its time per batch; measured, 1 - (the slowest stage's
busy seconds, each program waited for) / (the step's wall seconds). The losses
of the first steps are checked against the unpipelined step's. Per stage (the
range over stages): `step.check`'s compiled data-axis collectives (the sync
and ZeRO's), bytes received from other stages and peak memory, each over the
plan's.

The machine runs 8 simulated devices on its cores (two here), so stages do
not run in parallel as they would on 8 accelerators: the measured bubble
and the pipelined / unpipelined ratio say what this host does, not what a
pod would.

  python benchmarks/pipeline_run.py [--steps 5] [--rows REGEX]
  python benchmarks/pipeline_run.py --first-steps 8,32,64
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402

import automap  # noqa: E402
from automap import cluster, zoo  # noqa: E402

BATCH = 32
GPT = zoo.GPTConfig(vocab=256, seq=32, hidden=128, heads=4, layers=8)
TX = optax.adam(1e-3)


def gpt_model():
  return zoo.gpt_loss(GPT, BATCH)


def scanned_llama_model():
  return zoo.llama_loss(zoo.LlamaConfig(vocab=256, embed=128, mlp=256, heads=4, kv_heads=2,
                                        head_dim=32, layers=8, seq=32, batch=BATCH))


def encoder_decoder_model():
  return zoo.encoder_decoder_loss(layers=4, width=128, vocab=256, seq=32, batch=BATCH)


# name: (model, ClusterConfig fields, schedule run (None: the plan's))
ROWS = {
    "gpt-t2p2d2-zero1": (gpt_model, dict(tensor=2, pipeline=2, data=2, microbatch=2, zero=1),
                         None),
    "gpt-p4d2": (gpt_model, dict(pipeline=4, data=2, microbatch=2), None),
    "gpt-p2d2-interleaved2": (gpt_model, dict(pipeline=2, data=2, microbatch=2,
                                              schedule="interleaved", virtual_stages=2), None),
    "gpt-t2p2d2-full": (gpt_model, dict(tensor=2, pipeline=2, data=2, microbatch=2,
                                        recompute="full"), None),
    "gpt-t2p2d2-dots": (gpt_model, dict(tensor=2, pipeline=2, data=2, microbatch=2,
                                        recompute="dots"), None),
    "gpt-t2p2d2-selective": (gpt_model, dict(tensor=2, pipeline=2, data=2, microbatch=2,
                                             recompute="selective"), None),
    "gpt-t2p2d2-zero3": (gpt_model, dict(tensor=2, pipeline=2, data=2, microbatch=2, zero=3),
                         None),
    "gpt-p2d2-gpipe": (gpt_model, dict(pipeline=2, data=2, microbatch=2, schedule="gpipe"),
                       None),
    "t5-p2d2-zero3": (encoder_decoder_model, dict(pipeline=2, data=2, microbatch=2, zero=3),
                      None),
    # Hybrid sharding: ZeRO within groups of 2 replicas, the groups synced once per batch.
    "gpt-p2d4-zero3-hybrid2": (gpt_model, dict(pipeline=2, data=4, microbatch=2, zero=3,
                                               shard_group=2), None),
    # Context parallelism: each stage's sequence split over 2 of its devices.
    "gpt-c2p2d2": (gpt_model, dict(context=2, pipeline=2, data=2, microbatch=2), None),
    # A MaxText-style llama whose 8 layers are one nn.scan over stacked weights.
    "llama-scanned-t2p2d2": (scanned_llama_model, dict(tensor=2, pipeline=2, data=2,
                                                       microbatch=2), None),
    "llama-scanned-p2d2-interleaved2": (scanned_llama_model, dict(
        pipeline=2, data=2, microbatch=2, schedule="interleaved", virtual_stages=2), None),
}


def reference_step(loss):
  @jax.jit
  def step(params, opt, *batch):
    value, grads = jax.value_and_grad(loss)(params, *batch)
    updates, opt = TX.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt, value

  return step


def measure(name: str, steps: int) -> dict:
  model, fields, schedule = ROWS[name]
  loss, params, batch = model()
  plan = cluster.price_cluster(loss, params, *batch, config=cluster.ClusterConfig(**fields),
                               global_batch=BATCH, hardware="cpu",
                               budget=automap.Budget(episodes=20))
  step = plan.train_step(loss, TX, params, *batch, schedule=schedule)
  state = step.init(params)
  ref = reference_step(loss)
  p, o = params, TX.init(params)
  losses, want = [], []
  for _ in range(2):  # compile, and check the losses
    state, value = step(state, *batch)
    p, o, expected = ref(p, o, *batch)
    losses.append(float(value))
    want.append(float(expected))
  walls, ref_walls = [], []
  for _ in range(steps):
    t0 = time.perf_counter()
    state, value = step(state, *batch)
    jax.block_until_ready((value, state.params))
    walls.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    p, o, expected = jax.block_until_ready(ref(p, o, *batch))
    ref_walls.append(time.perf_counter() - t0)
  busy = []
  for _ in range(3):
    state, value = step.run(state, *batch, timed=True)
    per_stage = [0.0] * step.S
    for work, seconds in zip(step.executed, step.seconds):
      per_stage[work.stage] += seconds
    busy.append(max(per_stage))
  checks, state = step.check(state, *batch)
  span = lambda name: (min(c.ratios()[name] for c in checks),  # noqa: E731
                       max(c.ratios()[name] for c in checks))
  wall = statistics.median(walls)
  placement = plan.placement
  return {
      "row": name, "stages": step.S, "chunks": step.v, "data": step.d,
      "microbatches": step.M, "zero": step.zero, "schedule": step.schedule,
      "recompute": placement.stages[0].recompute_mode,
      "loss_error": max(abs(a - b) / abs(b) for a, b in zip(losses, want)),
      "wall": wall, "reference": statistics.median(ref_walls), "predicted": plan.time,
      "bubble_predicted": placement.bubble / placement.time,
      "bubble_measured": 1 - statistics.median(busy) / wall,
      "data_bytes": span("data"), "tensor_bytes": span("tensor"), "received": span("received"),
      "held": span("held"), "memory": span("memory"),
  }


def first_steps(layers: int) -> dict:
  """Seconds to the first step of a scanned llama of `layers` layers: the
  unpipelined `jax.jit` step's compile, and a 2-stage plan's first
  `train_step` call (its programs compiled; each stage scans its slice)."""
  loss, params, batch = zoo.llama_loss(zoo.LlamaConfig(
      vocab=256, embed=128, mlp=256, heads=4, kv_heads=2, head_dim=32, layers=layers, seq=32,
      batch=16))
  step = reference_step(loss)
  t = time.perf_counter()
  step.lower(params, TX.init(params), *batch).compile()
  jitted = time.perf_counter() - t
  plan = cluster.price_cluster(loss, params, *batch, config=cluster.ClusterConfig(
      pipeline=2, data=4, microbatch=2), global_batch=16, hardware="cpu",
      budget=automap.Budget(episodes=4))
  t = time.perf_counter()
  pipelined = plan.train_step(loss, TX, params, *batch)
  _, value = pipelined(pipelined.init(params), *batch)
  jax.block_until_ready(value)
  return {"jit": jitted, "first": time.perf_counter() - t, "programs": len(pipelined.programs)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--rows", default=".")
  parser.add_argument("--first-steps", default="",
                      help="comma-separated depths: time to the first step of a scanned "
                           "llama, pipelined and jitted, instead of the rows")
  args = parser.parse_args()
  if args.first_steps:
    print("| layers | jax.jit compile s | pipelined first step s (2 stages) | programs |")
    print("|---|---|---|---|")
    for layers in map(int, args.first_steps.split(",")):
      r = first_steps(layers)
      print(f"| {layers} | {r['jit']:.1f} | {r['first']:.1f} | {r['programs']} |", flush=True)
    return
  print("| row | schedule | stages x chunks x data, microbatches | recompute | ZeRO | "
        "loss vs unpipelined | measured s / batch | unpipelined s | pipelined / unpipelined | "
        "predicted s (cpu spec) | measured / predicted | bubble predicted | bubble measured | "
        "data-axis bytes / plan | tensor-axis bytes / plan | received / plan | held / plan | "
        "memory / plan |")
  print("|---" * 18 + "|")
  for name in ROWS:
    if not re.search(args.rows, name):
      continue
    r = measure(name, args.steps)
    print(f"| {r['row']} | {r['schedule']} | {r['stages']} x {r['chunks']} x {r['data']}, "
          f"{r['microbatches']} | {r['recompute']} | {r['zero']} | {r['loss_error']:.1e} | "
          f"{r['wall']:.3f} | {r['reference']:.3f} | {r['wall'] / r['reference']:.2f}x | "
          f"{r['predicted']:.4f} | {r['wall'] / r['predicted']:.1f}x | "
          f"{r['bubble_predicted']:.1%} | {r['bubble_measured']:.1%} | "
          + " | ".join(f"{lo:.2f}-{hi:.2f}"
                       for lo, hi in (r["data_bytes"], r["tensor_bytes"], r["received"],
                                      r["held"], r["memory"]))
          + " |", flush=True)


if __name__ == "__main__":
  main()
