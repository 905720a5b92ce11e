"""Sharding states: for every value and mesh axis, the dimension the axis
tiles, and their conversion to and from PartitionSpecs.

A state says, for every value and every mesh axis, which dimension of the
value the axis tiles (or -1: the value is whole along that axis).

Shape letters: V values, A mesh axes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from automap._src.ir.graph import Graph
from automap._src.sharding.mesh import MeshError, MeshSpec

UNSHARDED = -1
State = np.ndarray  # [V, A] int8: the dim each axis tiles, or UNSHARDED.


def empty_state(graph: Graph, mesh: MeshSpec) -> State:
  return np.full((graph.num_values, mesh.num_axes), UNSHARDED, np.int8)


def tile_count(state: State, mesh: MeshSpec, v: int, d: int) -> int:
  """How many tiles dimension d of value v is cut into."""
  return math.prod(s for a, s in enumerate(mesh.axis_sizes) if state[v, a] == d)


def spec_of(state: State, mesh: MeshSpec, v: int, rank: int) -> PartitionSpec:
  """The PartitionSpec of value v (axes of a dim in mesh order)."""
  return spec_from_row(state[v], mesh, rank)


def spec_from_row(row: Sequence[int], mesh: MeshSpec, rank: int) -> PartitionSpec:
  """The PartitionSpec of a per-axis row of tiled dims."""
  entries: list = [None] * rank
  for a, d in enumerate(row):
    if d >= 0:
      name = mesh.axis_names[a]
      entries[d] = name if entries[d] is None else (
          (entries[d] if isinstance(entries[d], tuple) else (entries[d],))
          + (name,))
  while entries and entries[-1] is None:
    entries.pop()
  return PartitionSpec(*entries)


def set_spec(state: State, mesh: MeshSpec, v: int, shape: Sequence[int],
             spec, where: str) -> None:
  """Writes a PartitionSpec into the state, validating it against the value."""
  if spec is None:
    spec = PartitionSpec()
  if not isinstance(spec, PartitionSpec):
    raise MeshError(f"{where}: expected a PartitionSpec, got {spec!r}.")
  if len(spec) > len(shape):
    raise MeshError(
        f"{where}: PartitionSpec {spec} has {len(spec)} entries but the value "
        f"has rank {len(shape)} (shape {tuple(shape)}). Give at most one "
        "entry per dimension.")
  state[v] = UNSHARDED
  for d, entry in enumerate(spec):
    if entry is None:
      continue
    names = entry if isinstance(entry, tuple) else (entry,)
    order = [mesh.axis_index(name, where) for name in names]
    if order != sorted(order):
      raise MeshError(
          f"{where}: dimension {d} of {spec} lists mesh axes {names} out of "
          f"mesh order {mesh.axis_names}; automap tiles a dimension major to "
          "minor in mesh order. Reorder them, or build the mesh with its axes "
          "in the order you want.")
    for name in names:
      a = mesh.axis_index(name, where)
      if state[v, a] != UNSHARDED:
        raise MeshError(f"{where}: mesh axis {name!r} appears twice in {spec}.")
      state[v, a] = d
    tiles = tile_count(state, mesh, v, d)
    if shape[d] % tiles:
      raise MeshError(
          f"{where}: dimension {d} of size {shape[d]} is not divisible by the "
          f"{tiles} tiles of mesh axes {names} in {spec}. Choose axes whose "
          "sizes divide it, or leave that dimension unsharded (None).")


def concat(parts: Iterable) -> np.ndarray:
  """Lists of changed values (arrays or sequences of ints) as one [n] int64."""
  parts = [np.asarray(p, np.int64) for p in parts]
  return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _is_spec_leaf(x) -> bool:
  return x is None or isinstance(x, (PartitionSpec, NamedSharding))


def flat_specs(in_shardings, args: tuple, what: str = "in_shardings") -> list:
  """Flat PartitionSpecs for the array leaves of `args` from a (prefix)
  pytree of specs. A None spec is replicated, as under `jax.jit` with a mesh
  in context; a None (or static) argument leaf has no array, so takes none."""
  out = []

  def cover(s, sub):  # Called in leaf order: each spec once per array under it.
    s = s.spec if isinstance(s, NamedSharding) else (PartitionSpec() if s is None else s)
    out.extend([s] * len(jax.tree.leaves(sub)))

  try:
    jax.tree_util.tree_map(cover, in_shardings, args, is_leaf=_is_spec_leaf)
  except (ValueError, TypeError) as e:
    raise MeshError(
        f"{what} must be a pytree of PartitionSpecs matching the arguments "
        f"(or a prefix of them): {e}") from None
  return out
