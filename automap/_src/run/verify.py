"""Verify: what XLA actually compiled, next to what the cost model predicted.

Reads the collectives of the compiled, partitioned HLO (kind, result bytes,
replica groups mapped back to mesh axes), its `memory_analysis()`, and runs
the partitioned and unpartitioned functions to compare numerics.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from automap._src.cost.model import KINDS, Cost

_COLLECTIVE = re.compile(
    r"\s(?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|"
    r"collective-permute)(?:-start)?\(")
_ARRAY = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(
    r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
# Shardy's form: replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b'}
_GROUPS_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((?:\[([0-9,]+)\]"
    r"(?:T\(([0-9,]+)\))?|([0-9,]+))\))?\s*\{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[0-9,]*\},?)*)\}")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
                "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
                "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of the compiled program, per device.

  kind: all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute.
  nbytes: bytes of its result on one device.
  axes: mesh axes its replica groups span.
  """

  kind: str
  nbytes: int
  axes: tuple[str, ...]
  line: str


def _shape_bytes(text: str) -> int:
  total = 0
  for dtype, dims in _ARRAY.findall(text):
    n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
    total += n * _DTYPE_BYTES.get(dtype, 4)
  return total


def _iota(shape: str, transpose: str | None) -> np.ndarray:
  dims = [int(x) for x in shape.split(",")]
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  return ids.transpose([int(x) for x in transpose.split(",")]) if transpose else ids


def _groups(line: str) -> list[list[int]]:
  m = _GROUPS_MESH.search(line)
  if m:
    axes = re.findall(r"'([^']*)'=([0-9]+)", m.group(1))
    names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
    if m.group(2):
      ids = _iota(m.group(2), m.group(3))
    elif m.group(4):
      ids = np.array([int(x) for x in m.group(4).split(",")])
    else:  # Devices in mesh order.
      ids = np.arange(int(np.prod(sizes)))
    ids = ids.reshape(sizes)
    grouped = [names.index(n) for n in re.findall(r"'([^']*)'", m.group(5))]
    rest = [i for i in range(len(names)) if i not in grouped]
    size = int(np.prod([sizes[i] for i in grouped])) if grouped else 1
    return ids.transpose(rest + grouped).reshape(-1, size).tolist()
  m = _GROUPS_IOTA.search(line)
  if m:
    shape = [int(x) for x in m.group(1).split(",")]
    return _iota(m.group(2), m.group(3)).reshape(shape).tolist()
  m = _GROUPS_LIST.search(line)
  if m and m.group(1):
    return [[int(x) for x in g.split(",") if x]
            for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]
  m = _PAIRS.search(line)
  if m:
    return [[int(x) for x in g.split(",") if x]
            for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]
  return []


def _axes_of_groups(groups: list[list[int]], mesh) -> tuple[str, ...]:
  """Mesh axes along which the members of a replica group differ."""
  shape = tuple(mesh.devices.shape)
  if not groups:  # One group of every device.
    return tuple(n for n, s in zip(mesh.axis_names, shape) if s > 1)
  varying = np.zeros(len(shape), bool)
  for group in groups:
    coords = np.array([np.unravel_index(i, shape) for i in group])
    if len(coords) > 1:
      varying |= (coords != coords[0]).any(axis=0)
  return tuple(n for n, v in zip(mesh.axis_names, varying) if v)


def collectives(hlo_text: str, mesh) -> list[Collective]:
  """Every collective in compiled HLO text, with its mesh axes."""
  found = []
  for line in hlo_text.splitlines():
    m = _COLLECTIVE.search(line)
    if not m or "=" not in line[:m.start()]:
      continue
    shape = line[:m.start()].split("=", 1)[1]  # "%name = <shape> kind(...)"
    if m.group(0).endswith("-start(") and m.group("kind") != "all-reduce":
      # Async all-gather / permute / ...: (operand, result, [contexts]).
      arrays = _ARRAY.findall(shape)
      shape = "{}[{}]".format(*arrays[1]) if len(arrays) > 1 else shape
    found.append(Collective(m.group("kind"), _shape_bytes(shape),
                            _axes_of_groups(_groups(line), mesh), line.strip()))
  return found


def summarize(found: list[Collective]) -> dict[tuple[str, tuple[str, ...]], float]:
  out: dict[tuple[str, tuple[str, ...]], float] = {}
  for c in found:
    out[(c.kind, c.axes)] = out.get((c.kind, c.axes), 0) + c.nbytes
  return out


@dataclasses.dataclass(frozen=True)
class Report:
  """Predicted vs compiled, and numerics vs the unpartitioned function.

  predicted / compiled_comm_bytes: {(kind, axes): bytes per device}.
  collectives: each compiled collective.
  compiled_memory: argument + output + temp bytes per device
    (`memory_analysis()`), predicted_memory: the cost model's peak.
  max_abs_error / max_rel_error: over every output leaf, None if not run;
    worst_leaf: the path of the leaf with the largest relative error.
  """

  predicted: Cost
  compiled_comm_bytes: dict[tuple[str, tuple[str, ...]], float]
  collectives: tuple[Collective, ...]
  compiled_memory: float
  memory_stats: Any
  max_abs_error: float | None
  max_rel_error: float | None
  worst_leaf: str | None = None

  @property
  def predicted_comm_bytes(self) -> float:
    return self.predicted.total_comm_bytes

  @property
  def compiled_total_comm_bytes(self) -> float:
    return float(sum(v for (k, _), v in self.compiled_comm_bytes.items()
                     if k in KINDS))

  @property
  def comm_error(self) -> float:
    """Relative error of the predicted total collective bytes."""
    c, p = self.compiled_total_comm_bytes, self.predicted_comm_bytes
    return abs(p - c) / max(c, 1.0)

  @property
  def memory_error(self) -> float:
    return abs(self.predicted.peak_memory - self.compiled_memory) / max(
        self.compiled_memory, 1.0)

  def table(self) -> str:
    keys = sorted(set(self.compiled_comm_bytes) | set(self.predicted.comm_bytes))
    rows = [f"{'collective':<16}{'axes':<18}{'predicted':>14}{'compiled':>14}"]
    for k in keys:
      rows.append(f"{k[0]:<16}{','.join(k[1]) or '-':<18}"
                  f"{self.predicted.comm_bytes.get(k, 0):>14,.0f}"
                  f"{self.compiled_comm_bytes.get(k, 0):>14,.0f}")
    rows.append(f"{'peak memory':<34}{self.predicted.peak_memory:>14,.0f}"
                f"{self.compiled_memory:>14,.0f}")
    if self.max_rel_error is not None:
      rows.append(f"numerics: max abs error {self.max_abs_error:.3g}, "
                  f"max rel error {self.max_rel_error:.3g}"
                  + (f" (at {self.worst_leaf})" if self.max_rel_error and self.worst_leaf
                     else ""))
    return "\n".join(rows)


def compiled_memory(compiled) -> tuple[float, Any]:
  stats = compiled.memory_analysis()
  if stats is None:
    return float("nan"), None
  total = (stats.argument_size_in_bytes + stats.output_size_in_bytes
           - stats.alias_size_in_bytes + stats.temp_size_in_bytes)
  return float(total), stats


def leaf_errors(expected, actual) -> list[tuple[str, float, float]]:
  """(path, max abs error, relative error) of each output leaf.

  Relative to the leaf's scale, floored at rounding of the largest result.
  Integer, boolean and PRNG-key leaves must match exactly; a mismatch (or a
  NaN on one side only) counts as an infinite error.
  """
  e_leaves, e_tree = jax.tree_util.tree_flatten_with_path(expected)
  a_leaves, a_tree = jax.tree.flatten(actual)
  if e_tree != a_tree:
    raise ValueError(f"output structures differ: {e_tree} vs {a_tree}")
  pairs = []
  for (path, e), a in zip(e_leaves, a_leaves):
    name = jax.tree_util.keystr(path) or "(the output)"
    if jax.dtypes.issubdtype(getattr(e, "dtype", np.float64), jax.dtypes.prng_key):
      e, a = jax.random.key_data(e), jax.random.key_data(a)
    e, a = np.asarray(e), np.asarray(a)
    if e.size == 0:
      continue
    if not jnp.issubdtype(e.dtype, jnp.inexact):  # exact leaves: no error or all of it
      pairs.append((name, 0.0 if np.array_equal(e, a) else math.inf))
      continue
    eps = float(jnp.finfo(e.dtype).eps)
    e, a = e.astype(np.float64), a.astype(np.float64)
    if not np.array_equal(np.isnan(e), np.isnan(a)):
      pairs.append((name, math.inf))  # a NaN one side only
      continue
    pairs.append((name, (np.nan_to_num(e, nan=0.0), np.nan_to_num(a, nan=0.0), eps)))
  # Relative to each leaf's scale (elementwise ratios explode near zero),
  # but no finer than rounding (64 ulps) at the scale of the largest result:
  # a leaf that is pure rounding noise (a gradient that is zero in exact
  # arithmetic, like an attention key bias's) differs between any two
  # summation orders.
  overall = max((float(np.abs(x[0]).max()) for _, x in pairs if isinstance(x, tuple)),
                default=0.0)
  out = []
  for name, x in pairs:
    if not isinstance(x, tuple):  # already an error
      out.append((name, x, x))
      continue
    e, a, eps = x
    diff = float(np.abs(e - a).max())
    scale = max(float(np.abs(e).max()), 64 * overall * eps, 1e-30)
    out.append((name, diff, diff / scale))
  return out


def worst_error(errors: list[tuple[str, float, float]]) -> tuple[float, float, str | None]:
  """(max abs error, max relative error, the leaf it is in) of `leaf_errors`."""
  worst, _, max_rel = max(errors, key=lambda e: e[2], default=(None, 0.0, 0.0))
  return max((d for _, d, _ in errors), default=0.0), max_rel, worst


def compare_numerics(expected, actual) -> tuple[float, float]:
  """Max abs and relative error over the output leaves (`leaf_errors`)."""
  return worst_error(leaf_errors(expected, actual))[:2]
