"""Optimizer-state offload run as a training step: the state in pinned host
memory between steps, brought to the devices for each update. Numerics
against the unpartitioned jitted step, and each stage's held bytes against
the plan's price, which leaves the offloaded state off the device."""

from __future__ import annotations

import dataclasses
import types

import jax
import optax
import pytest
from helpers import assert_trains_as_jitted

import automap
from automap import cluster
from automap._src.models import gpt, zoo

GPT = gpt.GPTConfig(vocab=64, seq=8, hidden=32, heads=2, layers=4)
BATCH = 16
BUDGET = automap.Budget(episodes=8)
TX = optax.adam(1e-2, eps=1e-3)  # eps above rounding noise, as test_executor.py
# The cpu spec states no host link; offload is priced across one of 10 GB/s.
HARDWARE = dataclasses.replace(automap.HARDWARE["cpu"], host_bandwidth=1e10)


def price(**config):
  loss, params, batch = zoo.gpt_loss(GPT, BATCH)
  plan = cluster.price_cluster(loss, params, *batch, config=cluster.ClusterConfig(**config),
                               global_batch=BATCH, hardware=HARDWARE, budget=BUDGET)
  return plan, loss, params, batch


def memory_kinds(state) -> set[str]:
  return {a.sharding.memory_kind for a in jax.tree.leaves(state.opt_state)}


def run_and_check(**config):
  """Three optimizer steps of the offloading plan against the jitted step,
  the state on the host after each, then one checked step."""
  plan, loss, params, batch = price(offload="optimizer", **config)
  assert plan.placement.offload == "optimizer"
  step = plan.train_step(loss, TX, params, *batch)
  def on_host(state):
    assert memory_kinds(state) == {"pinned_host"}

  state = assert_trains_as_jitted(step, loss, TX, params, batch, each=on_host)
  checks, state = step.check(state, *batch)
  assert memory_kinds(state) == {"pinned_host"}
  return step, checks


def assert_as_priced(checks):
  for check in checks:
    ratios = check.ratios()
    # The update's crossings of the host link are no collectives: the data
    # axes carry the sync as without offload. A last stage's copy of the
    # tied embedding is priced with a sync of its own, where the run sums
    # its gradient on the owning stage (5% of this small GPT's last stage).
    assert abs(ratios["data"] - 1) <= 0.06, check
    assert abs(ratios["received"] - 1) <= 0.05, check
    # Held on a device: parameters, gradients and activations, the
    # optimizer state not, as priced.
    assert 0.85 <= ratios["held"] <= 1.15, check


@pytest.mark.filterwarnings("ignore::automap.cluster.ReplicatedWeightsWarning")
@pytest.mark.heavy
def test_the_offloaded_state_of_eight_replicas_matches_the_jitted_step():
  step, checks = run_and_check(data=8)
  assert len(checks) == 1
  assert_as_priced(checks)


@pytest.mark.filterwarnings("ignore::automap.cluster.ReplicatedWeightsWarning")
@pytest.mark.slow
@pytest.mark.parametrize("config", [
    dict(data=2, tensor=2, pipeline=2, zero=1, microbatch=4),
    dict(data=4, zero=3),
], ids=["data2-tensor2-pipeline2-zero1", "data4-zero3"])
def test_offloading_plans_match_the_jitted_step_and_their_price(config):
  step, checks = run_and_check(**config)
  assert len(checks) == config.get("pipeline", 1)
  assert_as_priced(checks)


@pytest.mark.filterwarnings("ignore::automap.cluster.ReplicatedWeightsWarning")
def test_without_offload_the_optimizer_state_stays_on_the_devices():
  plan, loss, params, batch = price(data=8)
  state = plan.train_step(loss, TX, params, *batch).init(params)
  assert memory_kinds(state) == {"device"}


@pytest.mark.filterwarnings("ignore::automap.cluster.ReplicatedWeightsWarning")
def test_devices_without_pinned_host_memory_are_refused_by_name():
  plan, loss, params, batch = price(data=8, offload="optimizer")
  device_memory = types.SimpleNamespace(kind="device")
  devices = [types.SimpleNamespace(id=k, platform="fake", process_index=0,
                                   addressable_memories=lambda: [device_memory])
             for k in range(8)]
  with pytest.raises(cluster.PlacementError,
                     match="'pinned_host' memory, which the 'fake' backend's device 0 lacks"):
    plan.train_step(loss, TX, params, *batch, devices=devices)
