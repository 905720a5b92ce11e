"""The mesh a plan is for: axis names and sizes, and its errors."""

from __future__ import annotations

import dataclasses
import math

import jax


class MeshError(ValueError):
  """A mesh, mesh axis or PartitionSpec that does not fit the program."""


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  """The mesh shape a plan is for: axis names and sizes, major to minor."""

  axis_names: tuple[str, ...]
  axis_sizes: tuple[int, ...]

  @classmethod
  def of(cls, mesh) -> MeshSpec:
    if isinstance(mesh, MeshSpec):
      return mesh
    if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
      raise MeshError(
          f"mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh((4, 2), "
          f"('data', 'model'))), got {type(mesh).__name__}.")
    names = tuple(str(n) for n in mesh.axis_names)
    sizes = tuple(int(mesh.shape[n]) for n in mesh.axis_names)
    if not names or math.prod(sizes) < 1:
      raise MeshError(f"mesh must have at least one axis, got {mesh}.")
    return cls(names, sizes)

  @property
  def num_axes(self) -> int:
    return len(self.axis_names)

  @property
  def num_devices(self) -> int:
    return math.prod(self.axis_sizes)

  def axis_index(self, name: str, where: str) -> int:
    try:
      return self.axis_names.index(name)
    except ValueError:
      raise MeshError(
          f"{where} names mesh axis {name!r}, but the mesh has axes "
          f"{self.axis_names}. Use one of those names.") from None
