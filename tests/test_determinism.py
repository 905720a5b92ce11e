"""Same inputs and seed, same plan, to the byte; interrupts leave no debris."""

import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest
from helpers import gpt_step, mesh, mlp

import automap

TESTS = os.path.dirname(os.path.abspath(__file__))

PLAN_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from test_determinism import plan_of
plan_of({search!r}, {seed}).save(sys.argv[1])
"""


def plan_of(search: str, seed: int) -> automap.Plan:
  """MCTS on a GPT train step; the ILP where it proves its optimum fast."""
  if search == "mcts":
    step, args = gpt_step()
  else:
    step = mlp
    args = tuple(jax.ShapeDtypeStruct(s, jnp.float32)
                 for s in ((64, 128), (128, 512), (512, 128)))
  return automap.search(step, *args, mesh=mesh((4, 2)), seed=seed, search=search,
                        budget=automap.Budget(episodes=20, seconds=600))


def _env(**extra) -> dict:
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  env.update(extra)
  return env


def _plans_in_subprocesses(paths, seed: int, search: str, hash_seeds) -> list[bytes]:
  """The plans of processes started side by side, one per hash seed."""
  script = PLAN_SCRIPT.format(tests=TESTS, seed=seed, search=search)
  runs = [subprocess.Popen([sys.executable, "-c", script, str(path)],
                           env=_env(PYTHONHASHSEED=hash_seed))
          for path, hash_seed in zip(paths, hash_seeds)]
  for run in runs:
    assert run.wait(timeout=600) == 0
  return [path.read_bytes() for path in paths]


# Minutes of fresh processes: the slow tier's. A seed's plan is checked
# byte for byte within a process by test_search_is_deterministic_for_a_seed.
@pytest.mark.slow
@pytest.mark.parametrize("search", ["mcts", "ilp"])
def test_same_seed_gives_byte_identical_plans_across_processes(tmp_path, search):
  plan_of(search, seed=3).save(tmp_path / "here.json")
  # String hashing differs between the two processes: no set or dict order
  # of strings may leak into the plan.
  a, b = _plans_in_subprocesses([tmp_path / "a.json", tmp_path / "b.json"], 3, search,
                                hash_seeds=["1", "2"])
  assert a == b == (tmp_path / "here.json").read_bytes()


@pytest.mark.slow
def test_other_seeds_may_differ_but_keep_the_memory_limit():
  step, args = gpt_step()
  m = mesh((4, 2))
  free = automap.search(step, *args, mesh=m, hardware="tpu-v4",
                        budget=automap.Budget(episodes=60))
  limit = 0.7 * free.cost.peak_memory
  for seed in (1, 2):
    plan = automap.search(step, *args, mesh=m, hardware="tpu-v4", memory_limit=limit,
                          seed=seed, budget=automap.Budget(episodes=60))
    assert plan.cost.peak_memory <= limit


INTERRUPT_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import automap
from automap._src.search import mcts
from helpers import gpt_step, mesh
step, args = gpt_step()
run = mcts.Search.run
def announced(self, *a, **k):
  print("searching", flush=True)
  return run(self, *a, **k)
mcts.Search.run = announced
f = automap.partition(step, mesh=mesh((4, 2)), cache=sys.argv[1],
                      budget=automap.Budget(episodes=10**9, seconds=300))
f(*args)
"""


@pytest.mark.heavy
def test_ctrl_c_during_a_search_raises_cleanly_and_caches_nothing(tmp_path):
  cache = tmp_path / "cache"
  # As a context, the pipes are closed whatever happens: none is left to
  # the next test's garbage collection.
  with subprocess.Popen(
      [sys.executable, "-c", INTERRUPT_SCRIPT.format(tests=TESTS), str(cache)],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()) as proc:
    try:
      assert proc.stdout.readline().strip() == "searching"
      time.sleep(1.0)
      proc.send_signal(signal.SIGINT)
      _, err = proc.communicate(timeout=120)
    finally:
      proc.kill()
  assert proc.returncode != 0
  assert err.rstrip().endswith("KeyboardInterrupt"), err[-2000:]
  assert not cache.exists() or not any(cache.iterdir())


def test_an_interrupt_inside_a_compiled_kernel_is_still_an_interrupt():
  from automap._src.sharding import propagation_kernels as kernels

  def dispatch():  # what numba's dispatcher does with Ctrl-C in its Python code
    try:
      raise KeyboardInterrupt
    except KeyboardInterrupt as e:
      raise SystemError("returned a result with an exception set") from e

  with pytest.raises(SystemError) as caught:
    dispatch()
  assert kernels.interrupted(caught.value)
  assert not kernels.interrupted(SystemError("a real error"))
