"""The memory timeline of late reductions and staged reshards, as XLA lays
them out: an unreduced gradient held once, a reduction over two groups of
axes chained, a staged gather's steps freed once read, and an optimizer's
update made in place in a reduced gradient's buffer."""

import jax
import jax.numpy as jnp
import pytest
from helpers import compile_as_written
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import automap
from automap._src.cost.tracker import Tracker
from automap._src.models import moe
from automap._src.plan import planner
from automap._src.search.actions import ActionSpace
from automap._src.search.tactics import expert_states

MESH = jax.make_mesh((2, 2, 2), ("data", "model", "seq"), axis_types=(AxisType.Auto,) * 3)


def expert_grads(w, x):
  """The gradient of experts' weights [E, D, H] from tokens [E, C, D]."""
  return jax.grad(lambda w: jnp.sum(jnp.tanh(jnp.einsum("ecd,edh->ech", x, w)) ** 2))(w)


@pytest.mark.parametrize("specs", [
    (P(None, "model", "seq"), P(None, ("data", "model"))),
    (P(None, "model", None), P(None, ("data", "model"))),
    (P(None, "data", None), P(None, ("data", "model"))),
], ids=["tiled", "rows", "rows-on-data"])
def test_a_gradient_returned_unreduced_is_held_once(specs):
  """The contraction's partial sums live in its own buffer until the
  combined all-reduce writes the program's result: one buffer, not the
  contraction's and a held copy beside it (40% over before)."""
  args = (jnp.ones((4, 128, 256)) / 128, jnp.ones((4, 64, 128)))
  cost = automap.evaluate(expert_grads, *args, mesh=MESH, in_shardings=specs, hardware="cpu")
  _, peak, _ = compile_as_written(expert_grads, args, MESH, specs)
  assert cost.peak_memory == pytest.approx(peak, rel=0.05)


@pytest.fixture(scope="module")
def moe_fsdp_tp():
  """GShard's einsum dispatch under FSDP+TP on (2, 2, 2): its expert
  weights' gradients reduce over the model axis, then over data."""
  fn, args = moe.make_train_step("einsum", experts=8, width=64, hidden=128, groups=16,
                                 group_size=32)
  program = planner.build_program(fn, args, MESH, "cpu")
  state = program.as_compiled(expert_states(program, ActionSpace(program))["FSDP+TP"])
  return fn, args, program, state


def test_a_reduction_over_two_groups_reduces_the_first_ones_result(moe_fsdp_tp):
  _, _, program, state = moe_fsdp_tp
  tracker = Tracker(program.model, state)
  assert tracker.chained, "no op of this step reduces over two groups of axes"
  for (key, o), first_key in tracker.chained.items():
    held_from = next(first for op, first, *_ in tracker.held_inputs(key) if op == o)
    # The second input is the first collective's result: held from there.
    assert held_from >= tracker.windows(first_key)[o]
    # The first hands its result on: nothing of it is held at its collective.
    assert next(early for op, *_, early, _ in tracker.held_inputs(first_key) if op == o) == 0.0


def test_a_staged_gathers_steps_are_freed_once_read(moe_fsdp_tp):
  _, _, program, state = moe_fsdp_tp
  tracker = Tracker(program.model, state)
  assert tracker.passing, "no operand of this step is resharded in steps"
  for key, passing in tracker.passing.items():
    readers = tracker.reshards[key]
    if len(passing) == len(readers):  # a step on the way for every reader
      a = program.model.analysis  # made by its first reader, or once its value is
      assert tracker.copy_span(key, readers)[-1] in (a.at[readers].min(), a.start[key[0]])


def test_the_moe_step_under_fsdp_tp_peaks_as_compiled(moe_fsdp_tp):
  fn, args, program, state = moe_fsdp_tp
  from automap._src.plan import build as plan_build
  plan = plan_build.make_plan(program, state, {"strategy": "FSDP+TP"})
  report = automap.verify(plan, fn, *args, mesh=MESH)
  assert report.comm_error <= 0.05
  assert report.memory_error <= 0.15


def sgd_step(w1, w2, x):
  """Two layers' SGD step: each update is made in its gradient's buffer."""
  def loss(w1, w2):
    return ((jnp.tanh(x @ w1) @ w2) ** 2).mean()
  g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2)
  return w1 - 0.1 * g1, w2 - 0.1 * g2


def test_an_update_made_in_a_reduced_gradients_buffer_hosts_nothing_before():
  """The combined all-reduce writes each reduced gradient into the buffer
  the update then overwrites, a result of the program: that buffer cannot
  also hold the unreduced inputs waiting for the collective."""
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  args = (jnp.ones((128, 512)) / 128, jnp.ones((512, 128)) / 512, jnp.ones((64, 128)))
  specs = (P(None, "model"), P("model", None), P("data"))
  program = planner.build_program(sgd_step, args, mesh, "cpu")
  tracker = Tracker(program.model, program.state_from_specs(list(specs)))
  assert set(tracker.taken_by_reductions()) == set(program.graph.outputs)
  _, peak, _ = compile_as_written(sgd_step, args, mesh, specs)
  assert tracker.peak_memory == pytest.approx(peak, rel=0.05)
