"""Hybrid sharding run as a training step: ZeRO within groups of consecutive
replicas, plain data parallelism across the groups. Numerics against the
unpartitioned jitted step, and each stage's compiled collectives and held
bytes against the plan's price."""

from __future__ import annotations

import logging

import optax
import pytest
from helpers import stated_run

import automap
from automap import cluster
from automap._src.models import gpt, zoo

GPT = gpt.GPTConfig(vocab=64, seq=8, hidden=32, heads=2, layers=4)
BATCH = 16
BUDGET = automap.Budget(episodes=8)
TX = optax.adam(1e-2, eps=1e-3)  # eps above rounding noise, as test_executor.py


def run_and_check(**config):
  """Three optimizer steps of the plan against the jitted step, then one
  checked step; returns the plan, the step and its checks."""
  loss, params, batch = zoo.gpt_loss(GPT, BATCH)
  plan, step, state = stated_run(loss, params, batch, TX, global_batch=BATCH, budget=BUDGET,
                                 **config)
  checks, _ = step.check(state, *batch)
  return plan, step, checks


def assert_as_priced(checks):
  for check in checks:
    ratios = check.ratios()
    # ZeRO's collectives within a group and the shards' all-reduce across
    # the groups, as compiled, against the cluster model's bytes.
    assert abs(ratios["data"] - 1) <= 0.05, check
    assert check.data[0] > 0
    assert abs(ratios["received"] - 1) <= 0.05, check
    # ZeRO's state sharded over a group's replicas only, as priced.
    assert 0.85 <= ratios["held"] <= 1.15, check


def assert_zero_within_groups(step, groups, group):
  """Each stage's mesh is (groups, group, width), and ZeRO's shards split
  a parameter over the `group` replicas of a group only."""
  for mesh in step.meshes:
    assert dict(mesh.shape) == {"replica": groups, "shard": group, "tensor": 1}
  layout = step.layout
  (i, k) = next((i, k) for i, k in layout.zdim[0].items() if k is not None)
  sharding = layout.grad_sharding(0, i)
  shape = layout.slot_avals[i].shape
  assert sharding.shard_shape(shape)[k] == shape[k] // group


@pytest.mark.filterwarnings("ignore::automap.cluster.ReplicatedWeightsWarning")
@pytest.mark.heavy
def test_zero1_within_two_groups_of_four_replicas_matches_the_jitted_step(caplog):
  caplog.set_level(logging.INFO, logger="automap")
  plan, step, checks = run_and_check(data=8, zero=1, shard_group=4)
  # With the automap logger at INFO, each program's compile (all compiled
  # before the first call) and its first run are logged, once each.
  messages = [r.getMessage() for r in caplog.records]
  compiles = [m for m in messages if m.startswith("automap: pipeline program ")
              and ", compiled in " in m]
  runs = [m for m in messages if ", first run: " in m]
  assert len(compiles) == len(runs) == len(step.programs) == len(step.compiled) > 0
  assert any(m.startswith("automap: pipeline program update of stage 0, first run")
             for m in runs)
  assert sum(m.startswith(f"automap: {len(step.compiled)} pipeline programs compiled in")
             for m in messages) == 1
  assert plan.placement.shard_group == 4 and plan.placement.data_parallel == 8
  assert_zero_within_groups(step, groups=2, group=4)
  assert_as_priced(checks)


@pytest.mark.filterwarnings("ignore::automap.cluster.ReplicatedWeightsWarning")
@pytest.mark.slow
@pytest.mark.parametrize("config, groups", [
    (dict(data=8, zero=3, shard_group=4), 2),
    (dict(data=8, zero=1, shard_group=2), 4),
    (dict(data=8, zero=3, shard_group=2), 4),
    (dict(data=8, zero=2, shard_group=2), 4),
    (dict(pipeline=2, data=4, microbatch=2, zero=3, shard_group=2), 2),
], ids=["zero3-2x4", "zero1-4x2", "zero3-4x2", "zero2-4x2", "pipeline2-zero3-2x2"])
def test_hybrid_plans_match_the_jitted_step_and_their_price(config, groups):
  plan, step, checks = run_and_check(**config)
  assert len(checks) == config.get("pipeline", 1)
  assert_zero_within_groups(step, groups=groups, group=config["shard_group"])
  assert_as_priced(checks)


def test_plans_without_a_shard_group_keep_their_data_tensor_mesh():
  loss, params, batch = zoo.gpt_loss(GPT, BATCH)
  plan = cluster.price_cluster(loss, params, *batch,
                               config=cluster.ClusterConfig(data=8, zero=1),
                               global_batch=BATCH, hardware="cpu", budget=BUDGET)
  step = plan.train_step(loss, TX, params, *batch)
  assert [dict(m.shape) for m in step.meshes] == [{"data": 8, "tensor": 1}]
