"""Pod scale, predicted: llama-style models at full depth on 256 to 8,192 devices.

Each row traces a MaxText-style llama decoder (`automap.zoo.llama_train_step`:
scanned layers rematerialised with nothing saved, bfloat16 compute,
float32 weights and AdamW) from `jax.ShapeDtypeStruct`s at the 8B, 70B or 405B
shape and full depth, one 2,048-token sequence per device, and plans it
with `automap.search` on an abstract (data, fsdp, tensor) mesh of tpu-v5p
or h100: nothing is compiled and no device is needed. Beside the plan,
priced by the same model on the same mesh:
- MaxText's logical rules, the layout that model is written with (batch
  over data x fsdp, embedding over fsdp, heads, MLP and vocabulary over
  tensor; on h100 the data axis crosses nodes, which makes it HSDP);
- the search's experts: FSDP over every axis, and FSDP+TP (Megatron on the
  tensor axis, FSDP over the others).
Rows ending "-unrolled" write the dense models' layers as HuggingFace's
Flax Llama does: one `nn.remat`'d module per layer (flax's default
prevent_cse), no scan; they should plan as their scanned twins do.
A Mixtral 8x7B row (top-2 of 8 experts in every MLP, MaxText's einsum
dispatch per sequence) plans on a (data, fsdp, expert) mesh; MaxText's
rules put the experts over `expert` and the batch over every axis, and
the expert + data parallel yardstick (EP+DP: experts over `expert`, the
rest replicated) stands beside. Its MFU counts the parameters a token
runs through (two of eight experts).
Reported: seconds to plan (trace included), predicted seconds per step and
MFU (6 x parameters x tokens plus causal attention, over the device's
peak), and peak GB per device against the device's capacity; a layout
over capacity is marked and its MFU not counted.

`--twins` instead prices one layout of the 70B-width decoder unrolled and
scanned at 20, 40 and 80 layers (MaxText's rules with the weights FSDP over
(data, fsdp) and Megatron over tensor, activations pinned, on an abstract
(16, 16, 4) mesh, 1,024 sequences of 2,048 tokens): predicted step and
peak of each form on tpu-v5p and h100, and the unrolled form's peak with
XLA's collective combiners off, which attributes what is left between them.

  python benchmarks/pod_scale.py [--only ROW ...] [--seconds 60]
  python benchmarks/pod_scale.py --twins [--layers 20 40 80]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
import warnings

import jax
import jax.numpy as jnp

import automap
from automap import zoo
from automap._src.cost.model import CostModel
from automap._src.cost.tracker import Tracker
from automap._src.plan import planner
from automap._src.search import tactics
from automap._src.search.actions import ActionSpace

SHAPES = {  # Llama 3's published shapes (Grattafiori et al. 2024, Table 3)
    "8b": dict(embed=4096, mlp=14336, heads=32, kv_heads=8, head_dim=128, layers=32),
    "70b": dict(embed=8192, mlp=28672, heads=64, kv_heads=8, head_dim=128, layers=80),
    "405b": dict(embed=16384, mlp=53248, heads=128, kv_heads=8, head_dim=128, layers=126),
    # Mixtral 8x7B (Jiang et al. 2024): 8 experts per MLP, top-2, vocabulary 32,000.
    "8x7b": dict(embed=4096, mlp=14336, heads=32, kv_heads=8, head_dim=128, layers=32,
                 experts=8, top_k=2, vocab=32000),
}
VOCAB, SEQ = 128256, 2048
# (model, hardware, (data, fsdp, tensor)): tensor within a node or a few
# chips, FSDP over most of the devices, data parallelism over the rest.
ROWS = {
    "8b-256-tpu-v5p": ("8b", "tpu-v5p", (1, 64, 4)),
    "8b-256-h100": ("8b", "h100", (1, 32, 8)),
    "70b-1024-tpu-v5p": ("70b", "tpu-v5p", (4, 64, 4)),
    "70b-1024-h100": ("70b", "h100", (4, 32, 8)),
    "70b-8192-tpu-v5p": ("70b", "tpu-v5p", (32, 64, 4)),
    "405b-8192-tpu-v5p": ("405b", "tpu-v5p", (8, 128, 8)),
    "405b-8192-h100": ("405b", "h100", (8, 128, 8)),
    # (data, fsdp, expert): the experts over a node's or a few chips' devices.
    "8x7b-256-tpu-v5p": ("8x7b", "tpu-v5p", (1, 32, 8)),
    "8x7b-1024-h100": ("8x7b", "h100", (4, 32, 8)),
}
# The dense rows' models unrolled, as HuggingFace's Flax Llama writes them:
# one `nn.remat`'d module per layer, no scan. Priced beside their scanned
# twins (the rows without the suffix).
UNROLLED = "-unrolled"
ROWS.update({name + UNROLLED: ROWS[name] for name in (
    "8b-256-tpu-v5p", "8b-256-h100", "70b-1024-tpu-v5p", "70b-1024-h100")})
AXES = ("data", "fsdp", "tensor")
MOE_AXES = ("data", "fsdp", "expert")


def config_of(model: str, devices: int, unrolled: bool = False) -> zoo.LlamaConfig:
  return zoo.LlamaConfig(**dict(dict(vocab=VOCAB), seq=SEQ, batch=devices,
                                dtype=jnp.bfloat16, unrolled=unrolled, **SHAPES[model]))


def active_params(config: zoo.LlamaConfig, params) -> float:
  """Parameters each token runs through: of the experts' weights, top_k of
  `experts`."""
  total = 0.0
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    share = config.top_k / config.experts if "moe" in jax.tree_util.keystr(path) else 1.0
    total += math.prod(leaf.shape) * share
  return total


def model_flops(config: zoo.LlamaConfig, params: float) -> float:
  """FLOPs of one step: 6 per active parameter per token, plus causal
  attention (12 x layers x heads x head_dim x seq^2 per sequence, halved)."""
  tokens = config.batch * config.seq
  attention = 6 * config.layers * config.heads * config.head_dim * config.seq**2 * config.batch
  return 6 * params * tokens + attention


def measure(name: str, seconds: float) -> dict:
  model, hardware, shape = ROWS[name]
  devices = math.prod(shape)
  config = config_of(model, devices, name.endswith(UNROLLED))
  hw = automap.HARDWARE[hardware]
  mesh = jax.sharding.AbstractMesh(shape, MOE_AXES if config.experts else AXES)
  t0 = time.perf_counter()
  step, args = zoo.llama_train_step(config, constrained=False, abstract=True)
  plan = automap.search(step, *args, mesh=mesh, hardware=hw,
                        budget=automap.Budget(episodes=10**6, seconds=seconds, progress=False))
  took = time.perf_counter() - t0
  params = sum(math.prod(x.shape) for x in jax.tree.leaves(args[0]))
  flops = model_flops(config, active_params(config, args[0]))
  out = {"automap": (plan.cost.step_time, plan.cost.peak_memory), "plan_s": took,
         "kept": plan.stats.get("kept", "search"), "flops": flops, "devices": devices,
         "hw": hw, "params": params}
  specs, opt, batch = zoo.llama_param_specs(config, mesh)
  with jax.sharding.use_abstract_mesh(mesh):
    written, written_args = zoo.llama_train_step(config, constrained=True, abstract=True)
    cost = automap.evaluate(written, *written_args, mesh=mesh, hardware=hw,
                            in_shardings=(specs, opt, {"inputs": batch, "targets": batch}))
  out["MaxText rules"] = (cost.step_time, cost.peak_memory)
  program = planner.build_program(step, args, mesh, hw)
  experts = tactics.expert_states(program, ActionSpace(program))
  for expert in ("FSDP", "FSDP+TP", "EP+DP"):
    if expert in experts:  # its remat'd layers laid out as XLA would, as plans are
      cost = Tracker(program.model, program.as_compiled(experts[expert])).cost()
      out[expert] = (cost.step_time, cost.peak_memory)
  return out


def cell(result: dict, key: str) -> str:
  if key not in result:
    return "-"
  step, peak = result[key]
  hw = result["hw"]
  mfu = result["flops"] / (step * result["devices"] * hw.flops)
  over = peak > hw.hbm_capacity
  return (f"{step:.2f} s, {peak / 1e9:.1f} GB" + (" (over)" if over else f", MFU {mfu:.0%}"))


def twins(layers: tuple[int, ...]) -> None:
  """The `--twins` table: one layout, the stack unrolled and scanned."""
  mesh = jax.sharding.AbstractMesh((16, 16, 4), AXES)
  print("| layers | hardware | unrolled | scanned | peak unrolled / scanned "
        "| unrolled, combiners off |")
  print("|---|---|---|---|---|---|")
  for n in layers:
    for hardware in ("tpu-v5p", "h100"):
      priced = {}
      for unrolled in (True, False):
        config = dataclasses.replace(config_of("70b", 1024, unrolled), layers=n,
                                     fsdp=("data", "fsdp"))
        specs, opt, batch = zoo.llama_param_specs(config, mesh)
        with jax.sharding.use_abstract_mesh(mesh):
          step, args = zoo.llama_train_step(config, abstract=True)
          program = planner.build_program(step, args, mesh, hardware)
        flat = jax.tree.leaves((specs, opt, {"inputs": batch, "targets": batch}),
                               is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
        state = program.state_from_specs(flat)
        priced[unrolled] = Tracker(program.model, state).cost()
        if unrolled:  # XLA's combiners off: every reduction when it is made
          apart = dataclasses.replace(program.model.compiler, combine_bytes=0.0)
          model = CostModel(program.graph, program.mesh, program.model.hw, apart)
          priced["apart"] = Tracker(model, state).cost()
      u, t = priced[True], priced[False]
      print(f"| {n} | {hardware} | {u.step_time:.2f} s, {u.peak_memory / 2**30:.1f} GiB "
            f"| {t.step_time:.2f} s, {t.peak_memory / 2**30:.1f} GiB "
            f"| {u.peak_memory / t.peak_memory:.2f}x "
            f"| {priced['apart'].peak_memory / 2**30:.1f} GiB "
            f"({priced['apart'].peak_memory / t.peak_memory:.2f}x) |", flush=True)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--twins", action="store_true",
                      help="the 70B-width stack unrolled and scanned, one layout")
  parser.add_argument("--layers", type=int, nargs="*", default=[20, 40, 80])
  parser.add_argument("--only", nargs="*", default=list(ROWS), choices=list(ROWS))
  parser.add_argument("--seconds", type=float, default=60.0, help="search budget per row")
  opts = parser.parse_args()
  warnings.simplefilter("ignore", automap.SearchWarning)
  if opts.twins:
    twins(tuple(opts.layers))
    return
  columns = ("automap", "MaxText rules", "FSDP", "FSDP+TP", "EP+DP")
  print("| row | parameters | plan s | " + " | ".join(columns) + " | kept |")
  print("|---|---|---|" + "---|" * len(columns) + "---|")
  for name in opts.only:
    r = measure(name, opts.seconds)
    print(f"| {name} | {r['params'] / 1e9:.1f}B | {r['plan_s']:.1f} | "
          + " | ".join(cell(r, c) for c in columns) + f" | {r['kept']} |", flush=True)


if __name__ == "__main__":
  main()
