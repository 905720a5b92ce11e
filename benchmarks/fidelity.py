"""Does the cost model tell the truth? Predicted vs compiled.

Every plan small enough to compile here: for the GPT step of the tests (2
layers, hidden 128, adam) and its (loss, grads) function on every 8-device
(data, model) mesh, and for small T5-style, ViT, mixture-of-experts and
graph-network train steps on (4, 2) and (2, 2, 2), and two mixtures of
experts as libraries write them (GShard's einsum dispatch, a sort-and-gather
one) on (4, 2), (2, 4) and (2, 2, 2): automap's plans (MCTS, and
`search="ilp"` with `--ilp-seconds`) and the experts (data parallelism,
Megatron + data parallelism, and expert + data parallelism where there are
experts), searched for the `cpu` spec and compiled on 8
simulated CPU devices. Prints collective bytes per device, peak memory and
HBM traffic (against XLA's `cost_analysis()["bytes accessed"]`), predicted
vs compiled, the numerics against the unpartitioned function, and the
distribution of the errors.

`--devices 32` (or 64) runs the GPT step, its (loss, grads) function and
the two mixtures of experts on 32 or 64 simulated devices instead, on 3- and 4-axis meshes, with the
FSDP and FSDP+TP experts beside: the fidelity section at the scale of a
few nodes.

`--depth` prices layer stacks as users write them instead: a llama-style
decoder (width 512) with `nn.remat` on every layer, MaxText's activation
pins, weights FSDP over (data, fsdp) and Megatron over tensor, and AdamW,
unrolled (as HuggingFace's Flax models are) and as one `nn.scan`, at 4 and
16 layers: `automap.evaluate`'s peak against the compiled allocation of
the step as written (arguments, results and temporaries).

  python benchmarks/fidelity.py [--quick] [--devices 32 --ilp-seconds 0] [--depth]
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

DEVICES = int(sys.argv[sys.argv.index("--devices") + 1]) if "--devices" in sys.argv else 8
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={DEVICES}")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import automap  # noqa: E402
from automap import zoo  # noqa: E402
from automap._src.plan import build as plan_build  # noqa: E402
from automap._src.plan import planner  # noqa: E402
from automap._src.search.actions import ActionSpace  # noqa: E402
from automap._src.search.tactics import expert_states  # noqa: E402
from automap.referee import compiled_memory  # noqa: E402

MESHES = [(8, 1), (4, 2), (2, 4), (1, 8)]
NAMES = ("data", "model", "seq", "expert")
# 3- and 4-axis meshes of a few nodes' devices.
SCALED = {32: [(4, 4, 2), (2, 8, 2), (2, 2, 4, 2), (2, 2, 2, 4)],
          64: [(4, 8, 2), (4, 4, 4), (2, 4, 4, 2), (2, 2, 8, 2)]}
# (data, fsdp, tensor) meshes of the `--depth` rows.
DEPTH = {8: (2, 2, 2), 32: (4, 4, 2), 64: (4, 8, 2)}


def cases(quick: bool):
  """(program name, fn, args, meshes)."""
  step, args = zoo.gpt_step()
  grads_fn, grads_args = zoo.loss_and_grads(args)
  # Mixtures of experts, both dispatches (`zoo.moe_train_step`), top-2 of 8.
  experts = [(f"MoE {d} 8x128", *zoo.moe_train_step(
      d, experts=8, width=64, hidden=128, groups=2 * DEVICES, group_size=32))
      for d in ("einsum", "sorted")]
  if DEVICES != 8:
    yield "GPT train step", step, args, SCALED[DEVICES]
    yield "GPT loss+grads", grads_fn, grads_args, SCALED[DEVICES]
    for name, fn, moe_args in experts:
      yield name, fn, moe_args, SCALED[DEVICES]
    return
  yield "GPT train step", step, args, [(4, 2)] if quick else MESHES
  if quick:
    return
  yield "GPT loss+grads", grads_fn, grads_args, MESHES
  for name, build in zoo.small().items():
    fn, abstract = build()
    yield name, fn, zoo.materialize(abstract), [(4, 2), (2, 2, 2)]
  for name, fn, moe_args in experts:
    yield name, fn, moe_args, [(4, 2), (2, 4), (2, 2, 2)]


def plans(fn, args, mesh, ilp_seconds: float) -> dict:
  out = {"automap (MCTS)": automap.search(fn, *args, mesh=mesh, hardware="cpu")}
  if ilp_seconds > 0:  # 0: MCTS alone (the ILP's model of a 4-axis mesh outgrows this host)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", automap.SearchWarning)
      out["automap (ILP)"] = automap.search(fn, *args, mesh=mesh, hardware="cpu",
                                            search="ilp",
                                            budget=automap.Budget(seconds=ilp_seconds))
  prog = planner.build_program(fn, args, mesh, "cpu")
  states = expert_states(prog, ActionSpace(prog))
  labels = ("data parallel", "Megatron+DP") + (("FSDP", "FSDP+TP") if DEVICES != 8 else ())
  for label in labels + ("EP+DP",):
    if label in states:
      out[label] = plan_build.make_plan(prog, states[label], {"strategy": label})
  return out


def depth(layers: tuple[int, ...]) -> None:
  """The `--depth` rows: unrolled and scanned remat'd stacks as written."""
  shape = DEPTH[DEVICES]
  mesh = jax.make_mesh(shape, ("data", "fsdp", "tensor"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  print("| decoder | layers | mesh | peak MiB predicted | peak MiB compiled | error |")
  print("|---|---|---|---|---|---|")
  errors = []
  for n in layers:
    for unrolled in (True, False):
      config = zoo.LlamaConfig(vocab=1024, embed=512, mlp=1536, heads=8, kv_heads=4,
                               head_dim=64, layers=n, seq=128, batch=2 * DEVICES,
                               unrolled=unrolled, fsdp=("data", "fsdp"))
      step, args = zoo.llama_train_step(config, abstract=True)
      params, opt, batch = zoo.llama_param_specs(config, mesh)
      specs = (params, opt, {"inputs": batch, "targets": batch})
      shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs,
                               is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
      with jax.set_mesh(mesh):
        cost = automap.evaluate(step, *args, mesh=mesh, in_shardings=specs, hardware="cpu")
        compiled = jax.jit(step, in_shardings=shardings).lower(*args).compile()
      peak = compiled_memory(compiled)[0]
      errors.append(cost.peak_memory / peak - 1)
      print(f"| {'unrolled' if unrolled else 'scanned'} | {n} | {shape} "
            f"| {cost.peak_memory / 2**20:.1f} | {peak / 2**20:.1f} | {errors[-1]:+.1%} |",
            flush=True)
  e = np.abs(errors)
  print(f"\n- peak memory error over {len(e)} stacks: median {np.median(e):.1%}, "
        f"max {e.max():.1%}; within 15%: {(e <= 0.15).sum()} of {len(e)}")


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true", help="the GPT step on (4, 2) only")
  parser.add_argument("--depth", action="store_true",
                      help="unrolled and scanned remat'd decoders as written instead")
  parser.add_argument("--layers", type=int, nargs="*", default=[4, 16],
                      help="depths of the --depth rows")
  parser.add_argument("--ilp-seconds", type=float, default=10.0)
  parser.add_argument("--devices", type=int, default=8, choices=(8, 32, 64),
                      help="simulated devices (32, 64: 3- and 4-axis meshes)")
  opts = parser.parse_args()
  if opts.depth:
    depth(tuple(opts.layers))
    return
  print("| program | mesh | strategy | comm MiB predicted | comm MiB compiled | error "
        "| peak MiB predicted | peak MiB compiled | error "
        "| traffic MiB predicted | traffic MiB compiled | error | max rel. numeric error |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  comm, memory, traffic = [], [], []
  for name, fn, args, meshes in cases(opts.quick):
    for shape in meshes:
      mesh = jax.make_mesh(shape, NAMES[:len(shape)])
      for label, plan in plans(fn, args, mesh, opts.ilp_seconds).items():
        r = automap.verify(plan, fn, *args, mesh=mesh)
        comm.append(r.comm_error)
        memory.append(r.memory_error)
        traffic.append(r.traffic_error)
        print(f"| {name} | {shape} | {label} | {r.predicted_comm_bytes / 2**20:.3f} "
              f"| {r.compiled_total_comm_bytes / 2**20:.3f} | {r.comm_error:.1%} "
              f"| {r.predicted.peak_memory / 2**20:.2f} | {r.compiled_memory / 2**20:.2f} "
              f"| {r.memory_error:.1%} | {r.predicted.memory_traffic / 2**20:.2f} "
              f"| {r.compiled_traffic / 2**20:.2f} | {r.traffic_error:.1%} "
              f"| {r.max_rel_error:.1e} |", flush=True)
  print()
  for label, errors, target in (("collective bytes", comm, 0.05), ("peak memory", memory, 0.15),
                                ("memory traffic", traffic, 0.15)):
    e = np.abs(errors)
    print(f"- {label} error over {len(e)} compiled plans: median {np.median(e):.1%}, "
          f"p90 {np.percentile(e, 90):.1%}, max {e.max():.1%}; within {target:.0%}: "
          f"{(e <= target).sum()} of {len(e)}")


if __name__ == "__main__":
  main()
