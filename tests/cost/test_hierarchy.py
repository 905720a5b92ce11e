"""Collectives over devices on two levels of links (nodes or slices)."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import automap
from automap._src.cluster.placement.rings import Ring
from automap._src.cost.collectives import ALL_GATHER, ALL_REDUCE, ring_seconds, staged_seconds
from automap._src.cost.model import CostModel
from automap._src.ir import graph as graph_lib
from automap._src.ir import trace as trace_lib
from automap._src.sharding.mesh import MeshSpec


def two_levels(per_node: int = 4) -> automap.Hardware:
  """Links within a node 10x the network's, no latency."""
  return dataclasses.replace(automap.HARDWARE["h100"], link_bandwidth=1e10, link_latency=0.0,
                             network_bandwidth=1e9, network_latency=0.0,
                             devices_per_node=per_node)


def test_a_group_with_several_members_per_node_runs_within_then_across():
  """8 contiguous devices on 2 nodes of 4: within each node on its links,
  then across in 4 rings of a quarter each. Data parallelism beside
  4-wide tensor groups (one member per node) is one ring on the network."""
  ring = Ring(two_levels())
  assert ring.levels(8, 0, 7) == [(4, 1e10, 0.0), (2, 1e9, 0.0)]
  assert ring.gather(8e9, 8, 0, 7) == pytest.approx(
      3 / 4 * 8e9 / 1e10 + 1 / 2 * 2e9 / 1e9)
  assert ring.reduce(8e9, 8, 0, 7) == pytest.approx(
      staged_seconds(ALL_REDUCE, 8e9, 8, [(4, 1e10, 0.0), (2, 1e9, 0.0)]))
  assert ring.levels(2, 0, 4) == [(2, 1e9, 0.0)]
  assert ring.reduce(8e9, 2, 0, 4) == pytest.approx(ring_seconds(ALL_REDUCE, 8e9, 2, 1e9, 0.0))
  assert ring.levels(4, 0, 3) == [(4, 1e10, 0.0)]


def test_a_mesh_axis_across_nodes_is_priced_in_two_levels():
  """On a (2, 4) mesh of 2 nodes of 2: the minor axis stays in a node; the
  major one (stride 4) crosses with one device per node; over both, the
  group gathers within the node first. A (8,) axis over 4 nodes of 2 is
  two levels on its own."""
  x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
  g = graph_lib.build(trace_lib.trace(lambda x: x * 2, (x,)))
  model = CostModel(g, MeshSpec(("a", "b"), (2, 4)), two_levels(per_node=2))
  b, a, both = 0b10, 0b01, 0b11
  assert model.comm_time(ALL_GATHER, a, 1e9) == pytest.approx(
      ring_seconds(ALL_GATHER, 1e9, 2, 1e9, 0.0))
  assert model.comm_time(ALL_GATHER, b, 1e9) == pytest.approx(
      staged_seconds(ALL_GATHER, 1e9, 4, [(2, 1e10, 0.0), (2, 1e9, 0.0)]))
  assert model.comm_time(ALL_GATHER, both, 1e9) == pytest.approx(
      staged_seconds(ALL_GATHER, 1e9, 8, [(2, 1e10, 0.0), (2, 1e9, 0.0), (2, 1e9, 0.0)]))
  flat = CostModel(g, MeshSpec(("x",), (8,)), two_levels(per_node=2))
  assert flat.comm_time(ALL_GATHER, 1, 1e9) == pytest.approx(
      staged_seconds(ALL_GATHER, 1e9, 8, [(2, 1e10, 0.0), (4, 1e9, 0.0)]))
  assert flat.comm_time(ALL_GATHER, 1, 1e9) < ring_seconds(ALL_GATHER, 1e9, 8, 1e9, 0.0) / 1.5


def stub_mesh(groups, attr):
  """A mesh-like object whose devices say which slice or host they are on."""
  import types

  import numpy as np

  devices = np.empty(len(groups), object)
  for i, g in enumerate(groups):
    devices[i] = types.SimpleNamespace(id=i, **{attr: g})
  return types.SimpleNamespace(devices=devices.reshape(2, -1))


def test_slices_and_hosts_are_read_from_the_meshs_devices():
  from automap._src.cost.hardware import on_mesh

  v5p, h100 = automap.HARDWARE["tpu-v5p"], automap.HARDWARE["h100"]
  # create_hybrid_device_mesh's layout: the axis crossing slices outermost.
  assert on_mesh(v5p, stub_mesh([0] * 4 + [1] * 4, "slice_index")).devices_per_node == 4
  assert on_mesh(h100, stub_mesh([0] * 2 + [1] * 2 + [2] * 2 + [3] * 2,
                                 "process_index")).devices_per_node == 2
  # One slice, hosts on a TPU (ICI spans them), or devices that do not say.
  assert on_mesh(v5p, stub_mesh([0] * 8, "slice_index")) is v5p
  assert on_mesh(v5p, stub_mesh([0] * 4 + [1] * 4, "process_index")) is v5p
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  assert on_mesh(h100, mesh) is h100 and on_mesh(v5p, mesh) is v5p
  with pytest.warns(UserWarning, match="not runs of consecutive devices"):
    assert on_mesh(v5p, stub_mesh([0, 1] * 4, "slice_index")) is v5p
