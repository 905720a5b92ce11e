"""Context parallelism run as a training step: each sample's sequence split
over part of every stage's devices. Numerics against the unpartitioned
jitted step, and each stage's compiled collectives and held bytes against
the plan's price."""

from __future__ import annotations

import jax
import numpy as np
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
  checked step; returns the step and its checks."""
  loss, params, batch = zoo.gpt_loss(GPT, BATCH)
  plan, step, state = stated_run(loss, params, batch, TX, global_batch=BATCH, budget=BUDGET,
                                 **config)
  checks, _ = step.check(state, *batch)
  return step, checks


def assert_as_priced(checks):
  for check in checks:
    ratios = check.ratios()
    # Within a stage: the tensor group's collectives, the keys and values
    # gathered over the context group, and its partial weight gradients
    # summed; across the replicas, the data-parallel sync.
    assert check.tensor[0] > 0
    assert abs(ratios["tensor"] - 1) <= 0.05, check
    assert abs(ratios["data"] - 1) <= 0.05, check
    assert abs(ratios["received"] - 1) <= 0.05, check
    assert 0.85 <= ratios["held"] <= 1.15, check


def assert_sequence_split(step, context, tensor, data):
  """Each stage's mesh is (data, context, tensor), and a microbatch's tokens
  arrive split along the sequence over "context"."""
  for mesh in step.meshes:
    assert dict(mesh.shape) == {"data": data, "context": context, "tensor": tensor}
    tokens = step.batch_avals[0].shape
    shard = jax.tree.leaves(step.programs[("forward", 0)][1])
    assert any(a.shape == (BATCH // step.M, *tokens[1:]) and
               a.sharding.shard_shape(a.shape)[1] == tokens[1] // context for a in shard)


@pytest.mark.filterwarnings("ignore::automap.cluster.ReplicatedWeightsWarning")
@pytest.mark.slow
def test_the_sequence_split_over_two_of_four_stage_devices_matches_the_jitted_step():
  step, checks = run_and_check(context=2, tensor=2, data=2)
  assert_sequence_split(step, context=2, tensor=2, data=2)
  assert_as_priced(checks)


@pytest.mark.filterwarnings("ignore::automap.cluster.ReplicatedWeightsWarning")
@pytest.mark.slow
@pytest.mark.parametrize("config, tensor", [
    (dict(context=4, data=2), 1),
    (dict(context=2, pipeline=2, data=2, microbatch=2), 1),
    (dict(context=2, tensor=2, data=2, zero=1), 2),
], ids=["context4-data2", "pipeline2-context2", "zero1-context2-tensor2"])
def test_context_parallel_plans_match_the_jitted_step_and_their_price(config, tensor):
  step, checks = run_and_check(**config)
  assert len(checks) == config.get("pipeline", 1)
  assert_sequence_split(step, config["context"], tensor, config["data"])
  assert_as_priced(checks)


@pytest.mark.heavy
@pytest.mark.filterwarnings("ignore::automap.cluster.ReplicatedWeightsWarning")
def test_the_stage_mesh_puts_the_tensor_group_minor():
  # As the planner's stage mesh lays a stage's width devices: (context,
  # width / context), consecutive devices one tensor group.
  loss, params, batch = zoo.gpt_loss(GPT, BATCH)
  plan = cluster.price_cluster(loss, params, *batch,
                               config=cluster.ClusterConfig(context=2, tensor=2, data=2),
                               global_batch=BATCH, hardware="cpu", budget=BUDGET)
  step = plan.train_step(loss, TX, params, *batch)
  (mesh,) = step.meshes
  assert mesh.axis_names == ("data", "context", "tensor")
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  assert ids.tolist() == np.arange(8).reshape(2, 2, 2).tolist()
