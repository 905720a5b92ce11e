"""Does the cost model tell the truth? Predicted vs compiled, per mesh.

For the GPT step (adam) and its (loss, grads) function, on every 8-device
(data, model) mesh: automap's plan and the hand-written experts, each
compiled on 8 simulated CPU devices. Prints collective bytes per device and
peak memory, predicted vs compiled, and the numerics against the
unpartitioned function.

  python benchmarks/fidelity.py
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import jax  # noqa: E402
from helpers import gpt_step, loss_and_grads, megatron_specs  # noqa: E402

import automap  # noqa: E402
from automap._src import api, hardware, program, trace  # noqa: E402

MESHES = [(8, 1), (4, 2), (2, 4), (1, 8)]


def expert_plan(fn, args, mesh, specs, hw):
  prog = program.Program.build(trace.trace(fn, args), api.MeshSpec.of(mesh),
                               hardware.get_hardware(hw))
  state = prog.state_from_specs(api.flat_specs(specs, args))
  return prog.make_plan(state, {"strategy": "expert"})


def main():
  step, args = gpt_step()
  grads_fn, grads_args = loss_and_grads(args)
  print("| program | mesh | strategy | comm MiB predicted | comm MiB compiled | error "
        "| peak MiB predicted | peak MiB compiled | error | max rel. numeric error |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for name, fn, fargs in (("train step", step, args), ("loss+grads", grads_fn, grads_args)):
    for shape in MESHES:
      mesh = jax.make_mesh(shape, ("data", "model"))
      plans = {"automap": automap.search(fn, *fargs, mesh=mesh, hardware="cpu")}
      if name == "train step":
        for label, kw in (("Megatron+DP", {}),
                          ("data parallel", {"data": ("data", "model"), "model": None})):
          try:
            plans[label] = expert_plan(fn, fargs, mesh, megatron_specs(fargs, **kw), "cpu")
          except automap.MeshError:
            continue  # e.g. 4 heads cannot split 8 ways
      for label, plan in plans.items():
        r = automap.verify(plan, fn, *fargs, mesh=mesh)
        print(f"| {name} | {shape} | {label} | {r.predicted_comm_bytes / 2**20:.3f} "
              f"| {r.compiled_total_comm_bytes / 2**20:.3f} | {r.comm_error:.1%} "
              f"| {r.predicted.peak_memory / 2**20:.2f} | {r.compiled_memory / 2**20:.2f} "
              f"| {r.memory_error:.1%} | {r.max_rel_error:.1e} |", flush=True)


if __name__ == "__main__":
  main()
