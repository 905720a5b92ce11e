"""One process of a two-process automap run: tests/run/test_multihost.py starts two.

    python tests/run/multihost_worker.py PROCESS_ID PORT OUT_DIR

Each process owns 4 CPU devices; together they form one (4, 2) mesh of 8
devices with JAX's multi-controller runtime (coordinator on 127.0.0.1:PORT,
cross-process collectives by gloo over TCP). Both processes partition the same
program with `cache=OUT_DIR/plans`, where the test stored the plan it searched
on 8 devices of one process, so the plan is applied, not searched again.
Each process writes the plan it ran to OUT_DIR/plan-<PROCESS_ID>.json and its
compiled collectives to OUT_DIR/info-<PROCESS_ID>.json; process 0 writes the
results, gathered from both, to OUT_DIR/results.npz (leaf i under "i").

The program and settings live here so that the test builds exactly the same.
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np

PROCESSES = 2
DEVICES_PER_PROCESS = 4
MESH_SHAPE, MESH_AXES = (4, 2), ("data", "model")
SEED = 0
EPISODES = 40  # The episode budget binds, not the seconds: the search is reproducible.
SECONDS = 300.0


def program():
  """`(fn, args)`: loss and gradients of a one-block GPT wide enough that its
  plan shards weights over "model" too. Arguments are numpy arrays drawn from
  a seeded generator: the same bytes in every process, and nothing compiled
  to make them."""
  import jax
  from helpers import GPTConfig, loss_and_grads, make_train_step

  config = GPTConfig(vocab=128, seq=8, hidden=256, heads=4, layers=1)
  batch = 2
  _, specs = make_train_step(config, batch=batch, abstract=True)
  fn, (params, _) = loss_and_grads(specs, config)
  rng = np.random.default_rng(SEED)
  params = jax.tree.map(
      lambda s: (0.05 * rng.standard_normal(s.shape)).astype(s.dtype), params)
  tokens = rng.integers(0, config.vocab, (batch, config.seq + 1), dtype=np.int32)
  return fn, (params, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})


def partitioned(fn, mesh, cache):
  import automap

  return automap.partition(
      fn, mesh=mesh, hardware="cpu", seed=SEED, cache=cache,
      budget=automap.Budget(episodes=EPISODES, seconds=SECONDS, progress=False))


def plan_json(plan) -> str:
  """The plan as saved, less the one statistic that says where it came from."""
  d = plan.to_json()
  d["stats"] = {k: v for k, v in d["stats"].items() if k != "cached"}
  return json.dumps(d, indent=1, sort_keys=True)


def axes_across_processes(mesh) -> list[str]:
  """The mesh axes along which the owning process changes."""
  owner = np.vectorize(lambda d: d.process_index)(mesh.devices)
  return [name for k, name in enumerate(mesh.axis_names)
          if (np.diff(owner, axis=k) != 0).any()]


def main(argv: list[str]) -> None:
  if len(argv) != 4:
    raise SystemExit(f"usage: {argv[0]} PROCESS_ID PORT OUT_DIR")
  process_id, port, out_dir = int(argv[1]), int(argv[2]), pathlib.Path(argv[3])

  import jax

  # Before the CPU backend exists: 4 devices in this process (this wins over
  # XLA_FLAGS), and gloo, 0.10's default for cross-process CPU collectives,
  # named so a changed default cannot silently leave them out.
  jax.config.update("jax_num_cpu_devices", DEVICES_PER_PROCESS)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
      coordinator_address=f"127.0.0.1:{port}", coordinator_bind_address=f"127.0.0.1:{port}",
      num_processes=PROCESSES, process_id=process_id, initialization_timeout=120)
  from jax.experimental import multihost_utils

  import automap

  assert jax.process_count() == PROCESSES, jax.process_count()
  assert jax.local_device_count() == DEVICES_PER_PROCESS, jax.local_devices()
  assert jax.device_count() == PROCESSES * DEVICES_PER_PROCESS, jax.devices()

  fn, args = program()
  mesh = jax.make_mesh(MESH_SHAPE, MESH_AXES)
  f = partitioned(fn, mesh, out_dir / "plans")
  out = f(*args)  # Host arguments in, results sharded over both processes out.
  assert not any(x.is_fully_addressable for x in jax.tree.leaves(out))
  gathered = multihost_utils.process_allgather(out, tiled=True)

  # The compiled collectives of the two-process program against the plan's.
  # Abstract arguments: jit refuses numpy ones with shardings that span processes.
  specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
  report = automap.verify(f.plan, fn, *specs, mesh=mesh)
  info = {"cached": bool(f.plan.stats.get("cached", False)),
          "axes_across_processes": axes_across_processes(mesh),
          "comm_error": report.comm_error, "table": report.table(),
          "collectives": [[kind, list(axes), nbytes]
                          for (kind, axes), nbytes in report.compiled_comm_bytes.items()]}
  (out_dir / f"plan-{process_id}.json").write_text(plan_json(f.plan))
  (out_dir / f"info-{process_id}.json").write_text(json.dumps(info, indent=1))
  if process_id == 0:
    np.savez(out_dir / "results.npz",
             **{str(i): np.asarray(x) for i, x in enumerate(jax.tree.leaves(gathered))})
  multihost_utils.sync_global_devices("automap multihost worker done")
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv)
