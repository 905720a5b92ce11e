"""Optimizer state offloaded to host memory (MaxText's
`optimizer_memory_host_offload`): off the device, across the host link
twice per step."""


import jax.numpy as jnp
import pytest

import automap
from automap import cluster
from automap.cluster import Layer, LayerCost, LayerGraph

PARAMS = 2e9  # bytes of one layer's parameters per device


def flat(host: float | None = 1e10) -> automap.Hardware:
  return automap.Hardware(name="flat", flops=1e12, fp32_flops=1e12, hbm_bandwidth=1e12,
                          hbm_capacity=1e12, link_bandwidth=1e11, link_latency=0.0,
                          network_bandwidth=1e10, network_latency=0.0, devices_per_node=8,
                          host_bandwidth=host)


def graph() -> LayerGraph:
  return LayerGraph.chain([Layer("b0", {1: LayerCost(1.0, 2.0, PARAMS, 0.0)})])


def priced(zero: int, offload: str, data: int = 4):
  config = cluster.ClusterConfig(data=data, zero=zero, offload=offload)
  return cluster.price_placement(graph(), config, global_batch=data, hardware=flat(),
                                 optimizer="adam", overlap=False)


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_the_offloaded_state_leaves_the_device_and_crosses_the_host_link(zero):
  on, off = priced(zero, "none"), priced(zero, "optimizer")
  state = 2.0 * PARAMS / (4 if zero >= 1 else 1)  # Adam: two moments per parameter byte
  (a,), (b,) = on.stages, off.stages
  assert a.memory - b.memory == pytest.approx(state)
  # Read for the update and written back: twice per step, after the backward.
  assert b.sync_total - a.sync_total == pytest.approx(2 * state / 1e10)
  assert off.time - on.time == pytest.approx(2 * state / 1e10)
  assert off.offload == "optimizer" and on.offload == "none"
  assert type(off).from_json(off.to_json()) == off


def test_hardware_without_a_host_link_figure_is_refused_before_tracing():
  config = cluster.ClusterConfig(data=4, offload="optimizer")
  with pytest.raises(cluster.PlacementError, match="states no host link bandwidth"):
    cluster.price_placement(graph(), config, global_batch=4, hardware=flat(host=None))

  def untraceable(params, x):
    raise AssertionError("traced before the config was checked")

  with pytest.raises(cluster.PlacementError, match="'tpu-v5p' states no host link"):
    cluster.price_cluster(untraceable, jnp.zeros((8, 8)), jnp.zeros((4, 8)), config=config,
                          global_batch=4, hardware="tpu-v5p")


def test_the_gpu_catalogue_states_its_pcie_links():
  assert automap.HARDWARE["h100"].host_bandwidth == 64e9
  assert automap.HARDWARE["a100"].host_bandwidth == 32e9
  assert automap.HARDWARE["tpu-v5p"].host_bandwidth is None


def test_an_unknown_offload_names_the_field():
  with pytest.raises(cluster.PlacementError, match="ClusterConfig.offload must be one of"):
    cluster.ClusterConfig(offload="params")

