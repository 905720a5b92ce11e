"""Does automap price the layout a user wrote? Evaluated vs compiled.

A MaxText-style llama train step (4 layers, embed 256, GQA 8/4 heads, SwiGLU,
scanned and rematerialised layers, adamw) whose parameters carry logical axis
names and whose activations carry `with_logical_constraint`s, in two remat
policies, on (fsdp, tensor) = (4, 2) and (data, fsdp, tensor) = (2, 2, 2):
the user's own layout (`param_specs` under MaxText-like rules), priced by
`automap.evaluate` for the `cpu` spec and compiled by `jax.jit` under the mesh
on 8 simulated CPU devices. Prints collective bytes per device and peak
memory, predicted vs compiled, and the loss against the unpartitioned step;
`--detail` adds the bytes per (collective, mesh axes). Then automap plans the
same step on (4, 2) in each constraints mode ("keep", "hints", "ignore")
and without any constraint (the model with its rules emptied): predicted
step time and peak memory, "your layout" beside them, and each plan
compiled (collective bytes against its prediction, numerics against
`jax.jit` of the program as written).

  python benchmarks/constraints.py [--quick] [--detail]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import automap  # noqa: E402
from automap import zoo  # noqa: E402
from automap.referee import collectives, compiled_memory, summarize  # noqa: E402

CONFIGS = {
    "llama, remat nothing": zoo.LlamaConfig(),
    "llama, remat dots": zoo.LlamaConfig(remat_policy="dots_with_no_batch_dims_saveable"),
}
MESHES = {(4, 2): ("fsdp", "tensor"), (2, 2, 2): ("data", "fsdp", "tensor")}


def error(predicted: float, compiled: float) -> float:
  return (predicted - compiled) / max(compiled, 1.0)


def measure(config: zoo.LlamaConfig, shape: tuple[int, ...]) -> dict:
  """Predicted and compiled costs of the user's layout, and the loss's error."""
  names = MESHES[shape]
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
  step, args = zoo.llama_train_step(config)
  specs = zoo.llama_param_specs(config, mesh)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                           is_leaf=lambda x: isinstance(x, P))
  with jax.set_mesh(mesh):  # the constraints bind to this mesh at trace time
    jitted = jax.jit(step, in_shardings=shardings)
    compiled = jitted.lower(*args).compile()
    _, _, loss = compiled(*jax.device_put(args, shardings))
  _, _, expected = jax.jit(step)(*args)
  cost = automap.evaluate(step, *args, mesh=mesh, in_shardings=specs, hardware="cpu")
  return {"predicted": cost, "compiled_comm": summarize(collectives(compiled.as_text(), mesh)),
          "compiled_memory": compiled_memory(compiled)[0],
          "loss_error": abs(float(loss) - float(expected)) / abs(float(expected))}


def modes(config: zoo.LlamaConfig, episodes: int) -> None:
  """automap's plan of the step in each constraints mode, compiled."""
  mesh = jax.make_mesh((4, 2), MESHES[(4, 2)], axis_types=(AxisType.Auto,) * 2)
  step, args = zoo.llama_train_step(config)
  bare, _ = zoo.llama_train_step(config, constrained=False)
  budget = automap.Budget(episodes=episodes, seconds=600)
  print("| program | mode | step ms predicted | peak MiB predicted | your layout ms "
        "| comm MiB compiled | comm error | max rel. numeric error |")
  print("|---|---|---|---|---|---|---|---|")
  for label, fn, mode in (("constrained", step, "keep"), ("constrained", step, "hints"),
                          ("constrained", step, "ignore"), ("no constraints", bare, "keep")):
    plan = automap.search(fn, *args, mesh=mesh, hardware="cpu", budget=budget,
                          constraints=mode)
    report = automap.verify(plan, fn, *args, mesh=mesh)
    yours = plan.yardsticks.get("your layout")
    print(f"| {label} | {mode} | {plan.cost.step_time * 1e3:.3f} "
          f"| {plan.cost.peak_memory / 2**20:.2f} "
          f"| {'-' if yours is None else f'{yours.cost.step_time * 1e3:.3f}'} "
          f"| {sum(report.compiled_comm_bytes.values()) / 2**20:.3f} "
          f"| {report.comm_error:.1%} | {report.max_rel_error:.1e} |", flush=True)


def detail(r: dict) -> list[str]:
  """Bytes per (collective, axes): evaluated vs compiled."""
  predicted, compiled = r["predicted"].comm_bytes, r["compiled_comm"]
  return [f"  - {k[0]} over {','.join(k[1]) or '-'}: predicted "
          f"{predicted.get(k, 0) / 2**20:.3f} MiB, compiled {compiled.get(k, 0) / 2**20:.3f} MiB"
          for k in sorted(set(predicted) | set(compiled))]


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true", help="one config on (4, 2) only")
  parser.add_argument("--detail", action="store_true",
                      help="bytes per (collective, mesh axes) after the table")
  opts = parser.parse_args()
  configs = dict(list(CONFIGS.items())[:1]) if opts.quick else CONFIGS
  meshes = [(4, 2)] if opts.quick else list(MESHES)
  print("| config | mesh | comm MiB predicted | comm MiB compiled | error "
        "| peak MiB predicted | peak MiB compiled | error | loss rel. error |")
  print("|---|---|---|---|---|---|---|---|---|")
  t = time.perf_counter()
  rows, comm, memory = [], [], []
  for label, config in configs.items():
    for shape in meshes:
      r = measure(config, shape)
      cost, where = r["predicted"], ", ".join(f"{n} {s}" for n, s in zip(MESHES[shape], shape))
      compiled_comm = float(sum(r["compiled_comm"].values()))
      comm.append(error(cost.total_comm_bytes, compiled_comm))
      memory.append(error(cost.peak_memory, r["compiled_memory"]))
      rows.append((f"{label} on ({where})", r))
      print(f"| {label} | ({where}) | {cost.total_comm_bytes / 2**20:.3f} "
            f"| {compiled_comm / 2**20:.3f} | {comm[-1]:+.1%} "
            f"| {cost.peak_memory / 2**20:.2f} | {r['compiled_memory'] / 2**20:.2f} "
            f"| {memory[-1]:+.1%} | {r['loss_error']:.1e} |", flush=True)
  print()
  for name, errors in (("collective bytes", comm), ("peak memory", memory)):
    e = np.abs(errors)
    print(f"- {name} error over {len(e)} layouts: median {np.median(e):.1%}, "
          f"max {e.max():.1%}")
  print(f"- wall time {time.perf_counter() - t:.0f} s")
  if opts.detail:
    for name, r in rows:
      print(f"\n{name}, per collective:\n")
      print("\n".join(detail(r)))
  print()
  modes(CONFIGS["llama, remat nothing"], 20 if opts.quick else 100)


if __name__ == "__main__":
  main()
