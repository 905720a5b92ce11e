"""Halo exchanges: the collective-permutes XLA emits to slice or pad a tiled
dim in place, against the compiled program."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from automap._src.cost.halo import windowed_exchange
from automap._src.run import compiled as hlo

ROWS = 4  # a leading dim, whole: each permute moves ROWS elements per index


def compiled_permutes(fn, size: int, shards: int):
  """(elements moved along the tiled dim, source -> target shards) of each
  collective-permute XLA compiles for fn on a [ROWS, size] array whose last
  dim, and fn's result's, are tiled over `shards` devices; and whether any
  other collective appears."""
  mesh = jax.make_mesh((8 // shards, shards), ("data", "model"),
                       axis_types=(AxisType.Auto,) * 2)
  tiled = NamedSharding(mesh, P(None, "model"))
  with jax.set_mesh(mesh):
    compiled = jax.jit(fn, in_shardings=tiled, out_shardings=tiled).lower(
        jax.ShapeDtypeStruct((ROWS, size), jnp.float32)).compile()
  permutes, others = [], []
  for c in hlo.collectives(compiled.as_text(), mesh):
    if c.kind != "collective-permute":
      others.append(c.kind)
      continue
    pairs = re.findall(r"\{(\d+),(\d+)\}", c.line.split("source_target_pairs=")[1])
    shard_pairs = {(int(s) % shards, int(t) % shards) for s, t in pairs}
    permutes.append((c.nbytes // (4 * ROWS), tuple(sorted(shard_pairs))))
  return sorted(permutes), others


def predicted(size, shards, low, high, stride=1):
  found = windowed_exchange(size, shards, low, high, stride)
  assert found is not None
  return sorted((p.size, tuple(sorted(set(p.pairs)))) for p in found)


# (shards, size, start, limit, stride): neighbour exchanges, exchanges that
# skip shards (the compact form), strides, and slices needing nothing.
SLICES = [(2, 192, 0, 64, 1), (2, 192, 64, 128, 1), (2, 192, 128, 192, 1),
          (4, 192, 0, 64, 1), (4, 192, 64, 128, 1), (4, 192, 128, 192, 1),
          (8, 192, 0, 64, 1), (8, 96, 40, 88, 1), (4, 64, 4, 36, 1), (8, 128, 3, 99, 3),
          (4, 96, 1, 48, 2), (2, 64, 0, 32, 1), (8, 64, 0, 64, 2), (4, 48, 8, 16, 1)]


@pytest.mark.parametrize("shards,size,start,limit,stride", SLICES)
def test_a_slice_of_a_tiled_dim_exchanges_halos_as_compiled(shards, size, start, limit,
                                                            stride):
  permutes, others = compiled_permutes(
      lambda x: jax.lax.slice(x, (0, start), (ROWS, limit), (1, stride)), size, shards)
  assert not others
  assert predicted(size, shards, -start, limit - size, stride) == permutes


# (shards, size, low, high): edge pads, crops (negative), and both.
PADS = [(2, 192, 2, 2), (2, 192, 2, 6), (4, 64, 4, 0), (8, 64, 0, 16), (4, 64, -4, 4),
        (8, 96, 3, -3), (4, 32, 12, 4)]


@pytest.mark.parametrize("shards,size,low,high", PADS)
def test_an_edge_pad_of_a_tiled_dim_exchanges_halos_as_compiled(shards, size, low, high):
  permutes, others = compiled_permutes(
      lambda x: jax.lax.pad(x, 0.0, ((0, 0, 0), (low, high, 0))), size, shards)
  assert not others
  assert predicted(size, shards, low, high) == permutes


def test_symmetric_pads_and_aligned_slices_move_nothing():
  assert windowed_exchange(192, 2, 2, 2) == []  # each tile grows on its outer side
  assert windowed_exchange(192, 2, -64, -64) == []  # [64:128]: in place on 2 tiles
  assert windowed_exchange(192, 1, -5, 0) == []
