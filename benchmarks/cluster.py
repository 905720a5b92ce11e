"""Cluster planning: automap's placement against the fixed splits PHAZE compared with.

For GPT2-XL-, OPT-30B-, BERT-Large-, Llama2-7B- and GPT3-shaped models
(bf16, Adam with fp32 master weights, gradients and moments), the layer costs of one
transformer block (and of the embedding and head) come from the cost model at
tensor-parallel widths 1-8, each under the sharding search's plan for that
width, and are repeated for the model's depth (nothing is compiled). The
planner then searches stages, widths, data parallelism, ZeRO, recompute and
the microbatch size on 64 to 1024 devices; the Megatron-style baselines
(p stages x d data x t tensor) get the same search with p, d and t fixed.
Throughput is samples per second; "planner" is the placement's wall time
(the per-width profiling of the block is listed apart).

  python benchmarks/cluster.py [--quick]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import automap
from automap import Budget
from automap._src.cluster.placement.dp import place_any
from automap._src.cluster.profile import layers as layers_lib
from automap._src.plan import planner
from automap.cluster import LayerGraph, PlacementError, PlacementOptions
from automap.zoo import GPT, GPTConfig

# name: (layers, hidden, heads, seq, vocab, global batch, baseline (p, d, t))
MODELS = {
    "GPT2-XL": (48, 1600, 25, 1024, 50257, 512, (32, 32, 1)),
    "OPT-30B": (48, 7168, 56, 2048, 50272, 1360, (12, 85, 1)),
    "BERT-Large": (24, 1024, 16, 512, 30522, 1024, (8, 128, 1)),
    "Llama2-7B": (32, 4096, 32, 4096, 32000, 1024, (8, 128, 1)),
    "GPT3-175B": (96, 12288, 96, 2048, 50257, 1536, (32, 8, 4)),
}
WIDTHS = (1, 2, 4, 8)


def block_model(name: str):
  """(loss, params, (inputs, targets)) of a 2-block bf16 model of the named
  shape, microbatch of one, all abstract."""
  _, hidden, heads, seq, vocab, _, _ = MODELS[name]
  config = GPTConfig(vocab=vocab, seq=seq, hidden=hidden, heads=heads, layers=2,
                     dtype=jnp.bfloat16)
  model = GPT(config)
  tokens = jax.ShapeDtypeStruct((1, seq), jnp.int32)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, seq),
                                                                         jnp.int32)))["params"]
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), params)

  def loss(params, inputs, targets):
    logits = model.apply({"params": params}, inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  return loss, params, (tokens, tokens)


def block_profile(name: str, hardware: str, episodes: int,
                  sizes: tuple[int, ...]) -> layers_lib.Profile:
  """Layer costs of the 2-block model of the named shape at each microbatch size."""
  loss, params, batch = block_model(name)
  search = planner.searcher(Budget(episodes=episodes, seconds=120, progress=False))
  return layers_lib.measure(loss, params, batch, widths=WIDTHS,
                            hardware=automap.HARDWARE[hardware], search=search, sizes=sizes)


def model_graph(profile: layers_lib.Profile, depth: int, batch: int) -> LayerGraph:
  """The 2-block profile at microbatch `batch`, its second block repeated to `depth` blocks."""
  return profile.at(batch).repeat("block_1", depth - 1)


def best(profile, depth, devices, global_batch, hardware, microbatches, **fixed):
  sizes = [b for b in microbatches if global_batch % b == 0]
  try:
    # Adam in mixed precision (fp32 master weights, gradients and moments);
    # the interleaved schedule searched where legal.
    options = PlacementOptions(optimizer="adam", mixed_precision=True, virtual_stages=None,
                               **fixed)
    plan, i = place_any([(model_graph(profile, depth, b), global_batch // b) for b in sizes],
                        devices=devices, hardware=hardware, options=options)
  except PlacementError:
    return None
  return plan, sizes[i]


def describe(plan, b) -> str:
  widths = sorted({s.width for s in plan.stages})
  recompute = sum(s.recompute for s in plan.stages)
  woven = f" v{plan.virtual_stages}" if plan.virtual_stages > 1 else ""
  return (f"p{len(plan.stages)}{woven} d{plan.data_parallel} "
          f"t{'/'.join(map(str, widths))} mb{b} z{plan.zero} rc{recompute}")


def number(x: float) -> str:
  """A throughput cell: "-" where there is none (no plan, no baseline)."""
  return "-" if math.isnan(x) else f"{x:,.1f}"


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true")
  opts = parser.parse_args()
  models = ["GPT2-XL", "BERT-Large"] if opts.quick else list(MODELS)
  hardwares = ["tpu-v4"] if opts.quick else ["tpu-v4", "h100"]
  device_counts = (64, 1024) if opts.quick else (64, 256, 1024)
  microbatches = (1, 2, 4, 8)
  print("| model | hardware | devices | automap plan | samples/s | baseline | baseline "
        "samples/s | automap / baseline | planner s |")
  print("|---|---|---|---|---|---|---|---|---|")
  ratios, planner = [], []
  for hardware in hardwares:
    for name in models:
      depth, *_, global_batch, (p, d, t) = MODELS[name]
      t0 = time.perf_counter()
      profile = block_profile(name, hardware, 10 if opts.quick else 30, microbatches)
      profiled = time.perf_counter() - t0
      for devices in device_counts:
        t0 = time.perf_counter()
        found = best(profile, depth, devices, global_batch, hardware, microbatches)
        seconds = time.perf_counter() - t0
        planner.append(seconds)
        plan_text, tput = ("no plan fits", float("nan"))
        if found:
          plan_text, tput = describe(*found), global_batch / found[0].time
        base_text, base_tput, ratio = "", float("nan"), ""
        if devices == 1024:
          base = best(profile, depth, p * d * t, global_batch, hardware, microbatches,
                      data_parallel=d, stages=p, widths=(t,))
          base_text = f"p{p} d{d} t{t}" + ("" if base else " (does not fit)")
          if base:
            base_tput = global_batch / base[0].time
            base_text += f" (mb{base[1]} z{base[0].zero})"
            ratios.append(tput / base_tput)
            ratio = f"{tput / base_tput:.2f}x"
        print(f"| {name} | {hardware} | {devices} | {plan_text} | {number(tput)} | "
              f"{base_text or '-'} | {number(base_tput)} | {ratio or '-'} | {seconds:.2f} |")
      print(f"<!-- {name} on {hardware}: per-width block profile {profiled:.1f} s -->")
  print()
  print(f"automap / baseline throughput: median {statistics.median(ratios):.2f}x, "
        f"min {min(ratios):.2f}x over {len(ratios)} baselines. Planner: median "
        f"{statistics.median(planner):.2f} s, max {max(planner):.2f} s per model and "
        "device count (microbatch sizes 1, 2, 4, 8 each).")


if __name__ == "__main__":
  main()
