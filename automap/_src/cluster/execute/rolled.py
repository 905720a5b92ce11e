"""Runs of identical layers in a chunk, run as one `lax.scan`.

A scanned stack reaches the cut unrolled (`ir/stacks.py`), so each stage
would compile its layers one by one. Consecutive layers of a chunk that
compute alike, each from the one before, are rolled back into one scan over
their parameters stacked: the stage compiles one layer's program however many
it holds. A step's state holds such a run's parameters stacked where nothing
else reads them (`step_state.StateLayout`), so the stage's programs take one
argument per weight of the layer.

Layers roll together when their equations match one by one (primitive,
parameters, literal operands, operand and result types) and their inputs
line up by position: the previous layer's results (the carry), parameters
(stacked, one slice per layer), or one value every layer reads alike (the
mask the embedding made, a constant). Only the last layer's carry may be read
after the run. Anything else (a layer reading its own position, a value
from a layer two back) leaves the layers unrolled, as written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.extend import core as jex

_MIN = 2  # layers worth a scan


@dataclasses.dataclass(frozen=True)
class Run:
  """Layers `first` .. `first + count - 1` of a chunk (indices into its
  segments), run as one scan of the first's equations.

  carry: the first layer's ids of the values each layer takes from the one
    before; carry_out: the first layer's ids of what it hands on, in the
    same order; last_out: the last layer's ids of those (what the chunk reads
    after the run).
  stacked: per parameter position, its id in each layer.
  shared: ids every layer reads alike.
  """

  first: int
  count: int
  carry: tuple[int, ...]
  carry_out: tuple[int, ...]
  last_out: tuple[int, ...]
  stacked: tuple[tuple[int, ...], ...]
  shared: tuple[int, ...]


def runs(cut, chunk) -> tuple[Run, ...]:
  """The chunk's runs of identical layers (`Run`), in order."""
  segments = chunk.segments
  params = {cut.param_ids[i] for i in chunk.params}
  later = cut.read_after(chunk.index)
  signatures = [_signature(cut, s) for s in segments]
  found: list[Run] = []
  k = 0
  while k < len(segments):
    n = 1
    while k + n < len(segments) and signatures[k + n] == signatures[k]:
      n += 1
    while n >= _MIN:
      run = _run(cut, segments, k, n, params, later)
      if run is not None:
        found.append(run)
        break
      n -= 1
    k += max(n, 1)
  return tuple(found)


def _signature(cut, segment: Sequence[int]) -> tuple:
  """What a layer computes, independent of its value ids."""
  sig = []
  for o in segment:
    eqn = cut.ops[o].eqn
    params = tuple(sorted((k, str(v)) for k, v in eqn.params.items()))
    literals = tuple((k, _literal(a)) for k, a in enumerate(eqn.invars)
                     if isinstance(a, jex.Literal))
    sig.append((eqn.primitive.name, params, literals,
                tuple(str(a.aval) for a in eqn.invars), tuple(str(v.aval) for v in eqn.outvars)))
  return tuple(sig)


def _literal(atom) -> Any:
  value = np.asarray(atom.val)
  return (value.dtype.str, value.shape, value.tobytes())


def _needs(cut, segment: Sequence[int]) -> tuple[list[int], list[int]]:
  """(what the layer reads from outside it, in order of first use; what it
  makes, in order)."""
  made = [i for o in segment for i in cut.ops[o].outs if i >= 0]
  inside = set(made)
  needs: list[int] = []
  for o in segment:
    for i in cut.ops[o].ins:
      if i not in inside and i not in needs:
        needs.append(i)
  return needs, made


def _run(cut, segments, k: int, n: int, params: set[int], later) -> Run | None:
  layers = [_needs(cut, segments[j]) for j in range(k, k + n)]
  width = len(layers[0][0])
  if any(len(needs) != width for needs, _ in layers):
    return None
  makes = [set(m) for _, m in layers]
  carry_at, stacked_at, shared_at = [], [], []
  for p in range(width):
    ids = [needs[p] for needs, _ in layers]
    from_previous = [ids[j] in makes[j - 1] for j in range(1, n)]
    if all(from_previous):
      carry_at.append(p)
    elif any(from_previous):
      return None
    elif all(i in params for i in ids) and len(set(ids)) == n:
      stacked_at.append(p)
    elif all(i == ids[0] or _same_const(cut, i, ids[0]) for i in ids):
      shared_at.append(p)
    else:
      return None
  if not carry_at:
    return None
  # What layer j hands layer j + 1, as positions among the values it makes:
  # the same positions for every layer, and nothing else read after it.
  positions = None
  for j in range(n - 1):
    made = layers[j][1]
    taken = [made.index(layers[j + 1][0][p]) for p in carry_at]
    if positions is None:
      positions = taken
    if taken != positions:
      return None
    handed = {made[q] for q in positions}
    if {i for i in made if i in later[k + j]} - handed or handed & later[k + j + 1]:
      return None  # read later than by the next layer
  last = layers[-1][1]
  if {i for i in last if i in later[k + n - 1]} - {last[q] for q in positions}:
    return None
  first_needs, first_made = layers[0]
  return Run(k, n, tuple(first_needs[p] for p in carry_at),
             tuple(first_made[q] for q in positions), tuple(last[q] for q in positions),
             tuple(tuple(needs[p] for needs, _ in layers) for p in stacked_at),
             tuple(first_needs[p] for p in shared_at))


def _same_const(cut, a: int, b: int) -> bool:
  if a not in cut.consts or b not in cut.consts:
    return False
  x, y = np.asarray(cut.consts[a]), np.asarray(cut.consts[b])
  return x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x, y)


__all__ = ["Run", "runs"]
