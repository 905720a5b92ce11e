"""Exposed communication: a two-stream list schedule, as XLA overlaps collectives."""

import jax
import numpy as np
import pytest
from helpers import megatron_specs, mesh
from jax.sharding import PartitionSpec as P

import automap
from automap._src.cost import overlap
from automap._src.models.gpt import GPTConfig, make_train_step


def test_independent_compute_runs_in_a_reductions_shadow():
  """A (2 s, then a 3 s reduction of its result a) -> C reads a; B (4 s)
  needs nothing. In program order A, C, B the compute stream would wait
  for a: 2 + 3 + 1 + 4 = 10 s. The scheduler runs B while a is reduced:
  A 0-2, B 2-6, C 6-7, the reduction 2-5 hidden."""
  operands = [(0,), (2,), (1,)]  # A reads x0, C reads a (=v2), B reads x1
  results = [(2,), (3,), (4,)]
  compute = np.array([2.0, 1.0, 4.0])
  after = np.array([3.0, 0.0, 0.0])
  assert overlap.makespan(operands, results, compute, np.zeros(3), after, 5) == 7.0
  # A reduction nothing else can hide is on the clock: 2 + 3 + 1.
  assert overlap.makespan(operands[:2], results[:2], compute[:2], np.zeros(2), after[:2],
                          5) == 6.0


def test_a_reshard_before_an_op_delays_it_and_queues_on_one_stream():
  """Two ops each resharding an argument first (2 s, 3 s on the one
  communication stream) then computing 1 s: 0-2 comm, 2-3 op 0; 2-5 comm,
  5-6 op 1."""
  operands, results = [(0,), (1,)], [(2,), (3,)]
  span = overlap.makespan(operands, results, np.array([1.0, 1.0]), np.array([2.0, 3.0]),
                          np.zeros(2), 4)
  assert span == 6.0


def step_and_args():
  config = GPTConfig(vocab=128, seq=128, hidden=128, heads=4, layers=4)
  return make_train_step(config, batch=256, abstract=True)


@pytest.mark.heavy
def test_data_parallel_gradient_reductions_hide_behind_the_backward():
  step, args = step_and_args()
  m = mesh((8, 1))
  specs = (jax.tree.map(lambda _: P(), args[0]), jax.tree.map(lambda _: P(), args[1]),
           P("data"))
  tpu = automap.evaluate(step, *args, mesh=m, in_shardings=specs, hardware="tpu-v4")
  assert 0 < tpu.exposed_comm_time < 0.75 * tpu.comm_time
  assert tpu.overlapped_step_time == pytest.approx(tpu.compute_time + tpu.exposed_comm_time)
  # The searches rank plans by the overlapped clock; the serial sum stays.
  assert tpu.step_time == tpu.overlapped_step_time
  assert tpu.serial_step_time == pytest.approx(tpu.compute_time + tpu.comm_time)
  # XLA:CPU runs collectives in place: all of it is exposed.
  cpu = automap.evaluate(step, *args, mesh=m, in_shardings=specs, hardware="cpu")
  assert cpu.exposed_comm_time == cpu.comm_time


def test_tensor_parallel_reductions_the_next_op_reads_stay_exposed():
  step, args = step_and_args()
  m = mesh((2, 4))
  cost = automap.evaluate(step, *args, mesh=m, in_shardings=megatron_specs(args),
                          hardware="tpu-v4")
  assert cost.exposed_comm_time >= 0.9 * cost.comm_time
  assert automap.Cost.from_json(cost.to_json()) == cost


def test_explain_shows_exposed_and_total_communication_where_xla_overlaps():
  import jax.numpy as jnp

  def mlp(x, w1, w2):
    return jnp.tanh(x @ w1) @ w2

  x = (jnp.ones((64, 32)), jnp.ones((32, 64)), jnp.ones((64, 32)))
  budget = automap.Budget(episodes=4, seconds=10, progress=False)
  tpu = automap.search(mlp, *x, mesh=mesh((4, 2)), hardware="tpu-v4", budget=budget)
  c = tpu.cost
  assert (f"communication {c.exposed_comm_time * 1e3:.3f} ms exposed of "
          f"{c.comm_time * 1e3:.3f} ms") in tpu.explain()
  assert "ranked by the overlapped clock" in tpu.explain()
  cpu = automap.search(mlp, *x, mesh=mesh((4, 2)), hardware="cpu", budget=budget)
  assert "exposed of" not in cpu.explain()
  assert "ranked by the serial clock" in cpu.explain()


@pytest.mark.parametrize("hardware", ["tpu-v4", "h100"])
def test_the_searched_clock_is_the_schedule_after_every_update(hardware):
  """The Tracker's step time, refreshed incrementally as a search changes
  layouts, is the two-stream schedule of the state it holds, as a tracker
  made from scratch on that state prices it; the serial sum stays beside it."""
  from automap._src.cost.hardware import get_hardware
  from automap._src.cost.program import Program
  from automap._src.cost.tracker import Tracker
  from automap._src.ir import trace
  from automap._src.search.actions import ActionSpace
  from automap._src.sharding.mesh import MeshSpec

  step, args = step_and_args()
  m = mesh((4, 2))
  program = Program.build(trace.trace(step, args, m), MeshSpec.of(m), get_hardware(hardware))
  space = ActionSpace(program)
  state = program.initial_state()
  tracker = Tracker(program.model, state)
  rng = np.random.default_rng(0)
  for _ in range(12):
    actions = space.legal(state)
    changed = space.apply(state, actions[rng.integers(len(actions))])
    tracker.update(changed)
    scheduled = Tracker(program.model, state.copy()).exposed_comm_time()
    assert tracker.exposed_comm_time() == pytest.approx(min(scheduled, tracker.comm_time))
    assert tracker.step_time == pytest.approx(tracker.compute + tracker.exposed_comm_time())
    assert tracker.serial_step_time >= tracker.step_time
  assert tracker.comm_time > tracker.exposed_comm_time() > 0


def test_the_schedule_kernel_is_its_python_source():
  """`kernels.list_schedule` compiled and as written agree on a random DAG."""
  from automap._src.cost import kernels
  from automap._src.cost.analysis import dependencies

  rng = np.random.default_rng(1)
  n = 60
  operands = [tuple(int(v) for v in rng.choice(n + 4, size=2) if v < o + 4) for o in range(n)]
  results = [(o + 4,) for o in range(n)]
  deps = dependencies(operands, results, n + 4)
  secs = [rng.exponential(size=n) * (rng.random(n) < p) for p in (1.0, 0.3, 0.3)]
  args = (deps.operands, deps.results, deps.succ_ptr, deps.succ_idx, deps.preds, *secs, n + 4)
  assert kernels.list_schedule(*args) == pytest.approx(kernels.list_schedule.py_func(*args))
  assert kernels.list_schedule(*args) >= secs[0].sum()
