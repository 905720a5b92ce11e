"""A plan applies unchanged when its mesh spans processes.

The plan is searched here, on this process's 8 devices, and stored in a plan
cache; two processes of 4 CPU devices each (JAX's multi-controller runtime,
gloo collectives over localhost) then partition the same program on a (4, 2)
mesh spanning both with that cache, so they apply the stored plan. They must
run the same plan, compile the collectives it predicts, one of them across the
processes, and compute what this process computes, partitioned or not.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import jax
import multihost_worker as worker
import numpy as np
import pytest

import automap

WORKER = pathlib.Path(__file__).with_name("multihost_worker.py")
TIMEOUT = 180.0  # seconds for both processes together; they take ~10 alone
ATTEMPTS = 3  # fresh ports, should another program take the coordinator's first
PORT_TAKEN = "Failed to add port to server"  # the coordinator could not bind it


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def worker_env() -> dict[str, str]:
  """This environment with 4 CPU devices a process instead of conftest's 8,
  and this process's automap and the tests' helpers first on the path."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  root = str(pathlib.Path(automap.__file__).resolve().parents[1])
  tests = str(pathlib.Path(__file__).resolve().parents[1])
  env["PYTHONPATH"] = os.pathsep.join([root, tests, *filter(None, [env.get("PYTHONPATH")])])
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  flags.append(f"--xla_force_host_platform_device_count={worker.DEVICES_PER_PROCESS}")
  env["XLA_FLAGS"] = " ".join(flags)
  return env


def start(out_dir: pathlib.Path) -> tuple[list[int | None], bool, list[str]]:
  """Runs both processes on a fresh port until both exit, one fails or the
  time is up; whatever still runs is killed. Returns the exit codes (None:
  killed), whether the time ran out, and each process's output."""
  port, env = free_port(), worker_env()
  logs = [out_dir / f"worker-{i}.log" for i in range(worker.PROCESSES)]
  procs = []
  try:
    for i, log in enumerate(logs):
      with open(log, "w") as f:
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), str(i), str(port), str(out_dir)],
            stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env))
    deadline = time.monotonic() + TIMEOUT
    while (any(p.poll() is None for p in procs)
           and not any(p.poll() for p in procs)  # the other would wait for it
           and time.monotonic() < deadline):
      time.sleep(0.1)
    timed_out = time.monotonic() >= deadline
  finally:
    codes = [p.poll() for p in procs]
    for p in procs:
      if p.poll() is None:
        p.kill()
    for p in procs:
      p.wait()
  return codes, timed_out, [log.read_text() for log in logs]


def run_workers(out_dir: pathlib.Path) -> None:
  for attempt in range(ATTEMPTS):
    codes, timed_out, logs = start(out_dir)
    if codes == [0] * worker.PROCESSES:
      return
    if PORT_TAKEN not in logs[0] or attempt == ATTEMPTS - 1:
      break
  report = "\n".join(f"--- process {i}: exit code {c} ---\n{log[-6000:]}"
                     for i, (c, log) in enumerate(zip(codes, logs)))
  pytest.fail(f"the two worker processes did not both succeed"
              f"{f' within {TIMEOUT:g} s' if timed_out else ''} (exit code None: "
              f"killed):\n{report}", pytrace=False)


@pytest.mark.heavy
def test_plan_applies_unchanged_on_a_mesh_spanning_two_processes(tmp_path, devices):
  fn, args = worker.program()
  mesh = jax.make_mesh(worker.MESH_SHAPE, worker.MESH_AXES)
  f = worker.partitioned(fn, mesh, tmp_path / "plans")
  reference = jax.tree.leaves(f(*args))  # searches, and stores the plan
  plan = f.plan
  assert "cached" not in plan.stats
  assert any("model" in str(s) for s in plan.in_specs), "the plan shards weights"
  expected = jax.tree.leaves(jax.jit(fn)(*args))

  run_workers(tmp_path)

  for i in range(worker.PROCESSES):
    # Applied from the cache, normally. A source edit since this process
    # imported automap changes the cache key and the process searches again:
    # the same plan, as the seed and the episode budget fix the search.
    info = json.loads((tmp_path / f"info-{i}.json").read_text())
    assert (tmp_path / f"plan-{i}.json").read_text() == worker.plan_json(plan), (
        f"process {i} ran another plan (from the cache: {info['cached']})")
    # The compiled program's collectives are the predicted ones, and the plan
    # moves data between the processes, not only within each.
    assert info["comm_error"] < 0.05, info["table"]
    assert info["axes_across_processes"] == ["data"]
    assert any("data" in axes for _, axes, _ in info["collectives"]), info["table"]

  results = np.load(tmp_path / "results.npz")
  assert len(results.files) == len(expected)
  scale = max(float(np.abs(e).max()) for e in expected)
  for i, (r, e) in enumerate(zip(reference, expected)):
    actual = results[str(i)]
    assert actual.shape == e.shape and actual.dtype == e.dtype
    # Same plan, same program: only the summation order of a cross-process
    # reduction may differ from this process's.
    np.testing.assert_allclose(actual, np.asarray(r), rtol=1e-6, atol=1e-7 * scale)
    np.testing.assert_allclose(actual, np.asarray(e), rtol=1e-5, atol=1e-6 * scale)
