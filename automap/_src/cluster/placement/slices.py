"""The cluster a plan is for, however it is named: a device count, a
sequence of devices, a mesh, or a TPU slice's name ("v5p-16"), resolved
once to its size, its devices in order, and the hardware that prices them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from automap._src.cluster.errors import PlacementError
from automap._src.cost.hardware import Hardware, get_hardware, hardware_for_devices
from automap._src.sharding import topology

# What `plan_cluster`, `price_cluster` and `train_step` take as the cluster.
Cluster = int | str | jax.sharding.Mesh | Sequence[Any]


def size(cluster: Cluster, name: str = "devices") -> int:
  """The devices a cluster has; a slice's name needs no compiler.

  Raises:
    PlacementError: a count that is not a positive int, an empty sequence,
      or an unknown slice name (the message lists the known ones).
  """
  if isinstance(cluster, str):
    try:
      return topology.parse_slice(cluster).num_devices
    except topology.TopologyError as e:
      raise PlacementError(f"{name}: {e}") from e
  if isinstance(cluster, jax.sharding.Mesh):
    return cluster.devices.size
  if isinstance(cluster, (bool, np.bool_)) or (
      not isinstance(cluster, (int, np.integer)) and not isinstance(cluster, Sequence)):
    raise PlacementError(
        f"{name} must be a positive int, a TPU slice's name ('v5p-16'), a jax Mesh or a "
        f"sequence of devices, got {cluster!r}.")
  count = len(cluster) if isinstance(cluster, Sequence) else int(cluster)
  if count < 1:
    raise PlacementError(f"{name} must be a positive int or name some devices, got {cluster!r}.")
  return count


def hardware(cluster: Cluster | None, given: str | Hardware | None) -> Hardware:
  """The hardware to price with: `given`, else the cluster's own (a slice's
  chip, or the catalogue entry of its devices' kind), else the default."""
  if given is not None or cluster is None:
    return get_hardware(given)
  size(cluster)  # refused here, before anything reads it
  if isinstance(cluster, (int, np.integer)):
    return get_hardware(None)
  if isinstance(cluster, str):
    return get_hardware(topology.parse_slice(cluster).hardware)
  found = hardware_for_devices(cluster)
  return found if found is not None else get_hardware(None)


def fitting(cluster: Cluster, needed: int, what: str) -> int:
  """The cluster's size, where it holds the `needed` devices `what` uses.

  Raises:
    PlacementError: a cluster of fewer devices, named as given.
  """
  count = size(cluster)
  if count < needed:
    named = (f"the slice {cluster!r}" if isinstance(cluster, str) else
             "devices=" + str(cluster) if isinstance(cluster, (int, np.integer)) else
             "the cluster given")
    raise PlacementError(
        f"devices: {what} uses {needed} devices; {named} has {count}. Give a slice or mesh "
        f"of at least {needed} devices, or a smaller split.")
  return count


def devices(cluster: Cluster | None) -> list:
  """The cluster's devices in order: `jax.devices()` for None, a mesh's in
  its row-major order, a slice's compile-only devices in `automap.tpu_mesh`'s
  one-axis order (neighbours on the torus next to each other), so that each
  stage's block of consecutive devices is near itself.

  Raises:
    PlacementError: a device count (devices are needed here).
    automap.MeshError: a slice name libtpu is needed for and is missing.
  """
  if cluster is None:
    return list(jax.devices())
  if isinstance(cluster, str):
    return list(topology.tpu_mesh(cluster).devices.flat)
  if isinstance(cluster, jax.sharding.Mesh):
    return list(cluster.devices.flat)
  if isinstance(cluster, (int, np.integer)):
    raise PlacementError(
        f"devices: a count ({cluster}) names no devices to run or compile on; pass the "
        "devices, a jax Mesh, or a TPU slice's name ('v5p-16').")
  return list(cluster)


def compile_only(devices: Sequence[Any]) -> bool:
  """Whether the devices can only compile (a TPU slice's from libtpu)."""
  return bool(devices) and topology.compile_only(
      jax.sharding.Mesh(np.array(devices, dtype=object), ("devices",)))


__all__ = ["Cluster", "compile_only", "devices", "fitting", "hardware", "size"]
