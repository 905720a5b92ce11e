"""A schedule added by registering one object is ordered, priced, checked and run.

The schedule here, a reversed GPipe (every forward in order, then every
backward from the last microbatch to the first), exists only in this module:
registering it is all it takes for `ClusterConfig` to accept it, the cluster
model to price what it holds, and the executor to run its timetable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import automap
from automap import cluster
from automap._src.models import gpt, zoo


def reversed_gpipe_order(stage: int, stages: int, microbatches: int,
                         virtual: int) -> list[tuple[str, int, int]]:
  """Stage s's forwards of microbatches 0 .. M - 1, then its backwards M - 1 .. 0."""
  return ([("forward", stage, m) for m in range(microbatches)]
          + [("backward", stage, m) for m in reversed(range(microbatches))])


REVERSED = cluster.Schedule("reversed-gpipe", "reversed GPipe", reversed_gpipe_order)


@pytest.fixture
def reversed_gpipe():
  cluster.register_schedule(REVERSED)
  yield REVERSED
  cluster.unregister_schedule(REVERSED.name)


def flat() -> automap.Hardware:
  """One flat interconnect with no latency."""
  return automap.Hardware(name="flat", flops=1e12, fp32_flops=1e12, hbm_bandwidth=1e12,
                          hbm_capacity=1e12, link_bandwidth=1e9, link_latency=0.0,
                          network_bandwidth=1e9, network_latency=0.0, devices_per_node=64)


def blocks(n: int) -> cluster.LayerGraph:
  """n equal blocks: forward 1 s, backward 2 s, 1e9 bytes of parameters, 0.5e9 stashed."""
  cost = cluster.LayerCost(forward=1.0, backward=2.0, params=1e9, activations=0.5e9)
  return cluster.LayerGraph.chain([cluster.Layer(f"b{i}", {1: cost}) for i in range(n)], 1e8)


def test_a_registered_schedule_is_a_timetable_that_holds_every_microbatch(reversed_gpipe):
  assert cluster.schedule_names() == ("gpipe", "1f1b", "interleaved", "reversed-gpipe")
  table = cluster.timetable("reversed-gpipe", 3, 4)
  assert table.render().splitlines()[-1] == (
      "stage 2: .   .   F0  F1  F2  F3  B3  B2  B1  B0  .   .")
  assert table.slots == cluster.timetable("gpipe", 3, 4).slots
  # No closed form given: what a stage holds is counted from its order.
  assert [reversed_gpipe.in_flight(s, 3, 4) for s in range(3)] == [4.0] * 3
  assert [table.in_flight(s) for s in range(3)] == [4.0] * 3
  # Every dependency is met: a backward after its own forward and the next stage's backward.
  slot = {(w.phase, w.chunk, w.microbatch): w.slot for w in table.in_order()}
  for (phase, c, m), t in slot.items():
    if phase == "backward":
      assert slot[("forward", c, m)] < t
      assert c == 2 or slot[("backward", c + 1, m)] < t
  with pytest.raises(cluster.PlacementError, match="'reversed-gpipe' runs one chunk per stage"):
    cluster.timetable("reversed-gpipe", 2, 4, 2)
  with pytest.raises(cluster.PlacementError, match="is registered already"):
    cluster.register_schedule(REVERSED)


def test_an_unregistered_schedule_is_refused_by_name():
  assert "reversed-gpipe" not in cluster.schedule_names()
  with pytest.raises(cluster.PlacementError, match=r"ClusterConfig.schedule must be one of "
                     r"\('gpipe', '1f1b', 'interleaved'\), got 'reversed-gpipe'"):
    cluster.ClusterConfig(pipeline=2, schedule="reversed-gpipe")
  with pytest.raises(cluster.PlacementError, match="built-in schedule 'gpipe' stays"):
    cluster.unregister_schedule("gpipe")


def test_a_registered_schedule_is_priced_holding_what_its_order_holds(reversed_gpipe):
  """4 blocks on 2 stages, 4 microbatches: the reversed GPipe takes GPipe's
  time and, holding every microbatch, its memory."""
  priced = {}
  for schedule in ("gpipe", "1f1b", "reversed-gpipe"):
    config = cluster.ClusterConfig(pipeline=2, schedule=schedule)
    priced[schedule] = cluster.price_placement(blocks(4), config, global_batch=4,
                                               hardware=flat(), optimizer="sgd")
  plan, gpipe = priced["reversed-gpipe"], priced["gpipe"]
  assert plan.schedule == "reversed-gpipe"
  assert [s.in_flight for s in plan.stages] == [4, 4]
  assert plan.time == pytest.approx(gpipe.time)
  assert [s.memory for s in plan.stages] == pytest.approx([s.memory for s in gpipe.stages])
  assert plan.stages[1].memory > priced["1f1b"].stages[1].memory
  assert cluster.Placement.from_json(plan.to_json()) == plan


@pytest.mark.slow
def test_a_registered_schedule_runs_as_the_unpipelined_step(reversed_gpipe):
  config = gpt.GPTConfig(vocab=64, seq=8, hidden=32, heads=2, layers=2)
  loss, params, batch = zoo.gpt_loss(config, 16)
  plan = cluster.price_cluster(
      loss, params, *batch, global_batch=16, hardware="cpu",
      config=cluster.ClusterConfig(pipeline=2, data=2, microbatch=2, schedule="reversed-gpipe"),
      budget=automap.Budget(episodes=4, progress=False))
  assert plan.schedule() == ("reversed-gpipe", 2, 4, 1)
  assert "(reversed GPipe)" in plan.explain()
  tx = optax.adam(1e-2, eps=1e-3)
  step = plan.train_step(loss, tx, params, *batch, schedule="reversed-gpipe")
  state, value = step(step.init(params), *batch)
  assert step.executed == step.timetable.in_order()
  assert [w.microbatch for w in step.timetable.work[0] if w.phase == "backward"] == [3, 2, 1, 0]

  @jax.jit
  def reference(params):
    value, grads = jax.value_and_grad(loss)(params, *batch)
    updates, _ = tx.update(grads, tx.init(params), params)
    return optax.apply_updates(params, updates), value

  want, want_value = reference(params)
  np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
  for got, ref in zip(jax.tree.leaves(step.params(state)), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-4, rtol=1e-4)
  assert jnp.isfinite(value)
