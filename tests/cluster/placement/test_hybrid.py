"""Hybrid sharding (HSDP): ZeRO within a slice or node, data parallelism
across them, priced as XLA partitions it."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import automap
from automap import cluster
from automap._src.cost.collectives import ALL_GATHER, ALL_REDUCE, ring_seconds, staged_seconds
from automap._src.run.compiled import collectives
from automap.cluster import Layer, LayerCost, LayerGraph


def flat(bandwidth: float, network: float, per_slice: int) -> automap.Hardware:
  """Links within a slice and a network across, no latency."""
  return automap.Hardware(name="flat", flops=1e12, fp32_flops=1e12, hbm_bandwidth=1e12,
                          hbm_capacity=1e12, link_bandwidth=bandwidth, link_latency=0.0,
                          network_bandwidth=network, network_latency=0.0,
                          devices_per_node=per_slice)


def test_xla_reduces_within_the_slice_then_syncs_the_shard_across_slices():
  """8 CPU devices as 2 slices of 4: parameters sharded over the slice's
  axis, the batch over both. The compiled step gathers parameters and
  reduces gradients within each slice, and only each device's shard
  (1/4 of the gradients) crosses between slices: what the cluster model
  prices for `shard_group=4`."""
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("slice", "fsdp"))
  params = {"w1": jnp.zeros((64, 256)), "w2": jnp.zeros((256, 64))}
  grads = sum(w.size * w.dtype.itemsize for w in params.values())

  def step(p, x):
    g = jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)(p)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

  shard = {k: NamedSharding(mesh, P("fsdp", None)) for k in params}
  rows = NamedSharding(mesh, P(("slice", "fsdp")))
  compiled = jax.jit(step, in_shardings=(shard, rows), out_shardings=shard).lower(
      params, jnp.zeros((16, 64))).compile()
  found = collectives(compiled.as_text(), mesh)
  across = [c for c in found if c.axes == ("slice",)]
  assert [c.kind for c in across] == ["all-reduce"]
  assert across[0].nbytes == grads / 4
  # Nothing gradient-sized spans both levels (the loss's scalar mean does).
  assert all(c.nbytes <= 8 for c in found if c.axes == ("slice", "fsdp"))
  gathers = [c for c in found if c.kind == "all-gather"]
  assert gathers and all(c.axes == ("fsdp",) for c in gathers)


def test_hybrid_sharding_shards_within_a_slice_and_syncs_shards_across():
  """8 replicas on 2 slices of 4 (links 10x the network): ZeRO 3 within each
  slice (HSDP) holds 1/4 of the state and gathers over the slice's links;
  the slices all-reduce their shards' gradients once, over the network.
  ZeRO 3 over all 8 holds 1/8 but runs every gather across the network
  too."""
  hw = flat(bandwidth=1e10, network=1e9, per_slice=4)
  graph = LayerGraph.chain([Layer("b0", {1: LayerCost(1.0, 2.0, 2e9, 0.0)})])
  hybrid, flat_zero = (cluster.price_placement(
      graph, cluster.ClusterConfig(data=8, microbatch=1, zero=3, shard_group=g), global_batch=8,
      hardware=hw, optimizer="sgd", overlap=False) for g in (4, None))
  assert hybrid.shard_group == 4 and flat_zero.shard_group is None
  (h,), (f,) = hybrid.stages, flat_zero.stages
  # sgd: parameters and gradients, sharded 4 and 8 ways.
  assert h.memory == pytest.approx(2 * 2e9 / 4 + 2e9 * 3 / 4)
  assert f.memory == pytest.approx(2 * 2e9 / 8 + 2e9 * 7 / 8)
  # Per microbatch a reduce-scatter and two gathers; the sync: the shards'
  # all-reduce across the 2 slices.
  assert h.zero_total == pytest.approx(3 * ring_seconds(ALL_GATHER, 2e9, 4, 1e10, 0.0))
  assert h.sync_total == pytest.approx(ring_seconds(ALL_REDUCE, 2e9 / 4, 2, 1e9, 0.0))
  # Over both slices a gather runs within each slice, then across in 4 rings
  # of a quarter of the array each (`rings.Ring.levels`).
  across = staged_seconds(ALL_GATHER, 2e9, 8, [(4, 1e10, 0.0), (2, 1e9, 0.0)])
  assert f.zero_total == pytest.approx(3 * across)
  assert across < ring_seconds(ALL_GATHER, 2e9, 8, 1e9, 0.0) / 2
  assert f.sync_total == 0.0
  assert hybrid.time < flat_zero.time
  assert "within groups of 4 replicas (hybrid)" in cluster.ClusterPlan(
      hybrid, 1, 8, 8, "flat", {}).explain()
  assert type(hybrid).from_json(hybrid.to_json()) == hybrid


@pytest.mark.parametrize("fields, match", [
    (dict(data=8, zero=3, shard_group=3), "shard_group must be a positive int dividing data=8"),
    (dict(data=8, zero=0, shard_group=4), "zero=0 shards nothing"),
])
def test_bad_shard_groups_name_the_field(fields, match):
  with pytest.raises(cluster.PlacementError, match=match):
    cluster.ClusterConfig(**fields)


def test_the_planner_shards_within_slices_when_the_network_is_slow():
  """8 devices in 2 slices of 4, a layer whose state needs sharding and a
  network 100x slower than the slice's links: the planner keeps ZeRO's
  collectives inside each slice (HSDP) and syncs shards across; with
  hybrid=False it shards over all 8 and pays the network on every gather."""
  graph = LayerGraph.chain([Layer("b0", {1: LayerCost(1.0, 2.0, 4e9, 0.0)})])
  hw = flat(bandwidth=1e11, network=1e9, per_slice=4)
  options = dict(devices=8, microbatches=8, hardware=hw, optimizer="sgd", zero=(3,),
                 memory_limit=6e9, data_parallel=8)
  hybrid = cluster.place(graph, **options)
  flat_zero = cluster.place(graph, **options, hybrid=False)
  assert hybrid.shard_group == 4 and flat_zero.shard_group is None
  assert hybrid.time < flat_zero.time
  assert max(s.memory for s in hybrid.stages) <= 6e9


def test_a_shard_group_of_one_is_refused():
  with pytest.raises(cluster.PlacementError, match="shard_group=1.*shards nothing"):
    cluster.ClusterConfig(data=4, zero=1, shard_group=1)
