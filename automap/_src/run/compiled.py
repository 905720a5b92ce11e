"""What XLA compiled: the collectives of the partitioned HLO (kind, result
bytes, replica groups mapped back to mesh axes) and its `memory_analysis()`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
  import jax

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
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s.*\{\s*$")
_WHILE_BODY = re.compile(r"\swhile\(.*body=%?([^\s,]+)")
_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"([0-9]+)"')
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[0-9,]*\},?)*)\}")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
                "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
                "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of the compiled program, per device.

  Attributes:
    kind: "all-reduce", "all-gather", "reduce-scatter", "all-to-all" or
      "collective-permute" (an asynchronous `-start` counts as its kind).
    nbytes: bytes of its result on one device.
    axes: mesh axes its replica groups span (empty: a group of one device).
    line: its instruction in the HLO text, stripped.
    trips: times it runs per call: the known trip counts of the while loops
      around it multiplied (1 outside loops, or where XLA does not know one).
  """

  kind: str
  nbytes: int
  axes: tuple[str, ...]
  line: str
  trips: int = 1


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


def _instructions(lines: list[str]):
  """(computation, line) of every instruction line of HLO text."""
  current = ""
  for line in lines:
    header = _HEADER.match(line)
    if header and not line.startswith(" "):
      current = header.group(1)
    else:
      yield current, line


def _loop_trips(lines: list[str]) -> dict[str, int]:
  """{computation: times it runs per call} for while bodies: their known
  trip counts (`known_trip_count`), nested loops multiplied."""
  parent: dict[str, tuple[str, int]] = {}
  for current, line in _instructions(lines):
    body = _WHILE_BODY.search(line)
    if body:
      n = _KNOWN_TRIPS.search(line)
      parent[body.group(1)] = (current, int(n.group(1)) if n else 1)

  def trips(name: str, depth: int = 0) -> int:
    if name not in parent or depth > len(parent):
      return 1
    caller, n = parent[name]
    return n * trips(caller, depth + 1)
  return {name: trips(name) for name in parent}


def collectives(hlo_text: str, mesh: jax.sharding.Mesh) -> list[Collective]:
  """Every collective in compiled HLO text, with its mesh axes and how many
  times it runs per call (`Collective.trips`).

  Args:
    hlo_text: the partitioned program's HLO, `compiled.as_text()` of a
      `jax.stages.Compiled`.
    mesh: the mesh it was compiled on; replica groups are read back as the
      axes of this mesh whose coordinates vary within a group.

  Returns:
    One `Collective` per collective instruction, in the text's order.

  Raises:
    ValueError: a replica group names a device `mesh` lacks (the program
      was compiled on another mesh).
  """
  found = []
  lines = hlo_text.splitlines()
  loops = _loop_trips(lines)
  for current, line in _instructions(lines):
    m = _COLLECTIVE.search(line)
    if not m or "=" not in line[:m.start()]:
      continue
    shape = line[:m.start()].split("=", 1)[1]  # "%name = <shape> kind(...)"
    if m.group(0).endswith("-start(") and m.group("kind") != "all-reduce":
      # Async all-gather / permute / ...: (operand, result, [contexts]).
      arrays = _ARRAY.findall(shape)
      shape = "{}[{}]".format(*arrays[1]) if len(arrays) > 1 else shape
    found.append(Collective(m.group("kind"), _shape_bytes(shape),
                            _axes_of_groups(_groups(line), mesh), line.strip(),
                            loops.get(current, 1)))
  return found


def summarize(found: list[Collective]) -> dict[tuple[str, tuple[str, ...]], float]:
  """Result bytes per device summed by (kind, mesh axes), as
  `automap.Report.compiled_comm_bytes` and `automap.Cost.comm_bytes` key them.

  Args:
    found: collectives, as `collectives` returns them.

  Returns:
    {(kind, axes): bytes}; each collective counted once (its `trips` not
    multiplied in).
  """
  out: dict[tuple[str, tuple[str, ...]], float] = {}
  for c in found:
    out[(c.kind, c.axes)] = out.get((c.kind, c.axes), 0) + c.nbytes
  return out


def compiled_memory(compiled: jax.stages.Compiled) -> tuple[float, Any]:
  """Bytes per device the compiled program allocates: arguments, results
  (less those aliased to arguments) and temporaries, from XLA's
  `memory_analysis()`.

  Args:
    compiled: a compiled program (`jax.jit(f).lower(...).compile()`).

  Returns:
    (bytes, the `memory_analysis()` object); (nan, None) where the backend
    gives no analysis.
  """
  stats = compiled.memory_analysis()
  if stats is None:
    return float("nan"), None
  total = (stats.argument_size_in_bytes + stats.output_size_in_bytes
           - stats.alias_size_in_bytes + stats.temp_size_in_bytes)
  return float(total), stats


def compiled_costs(compiled) -> dict:
  """XLA's own accounting of the compiled program per device
  (`cost_analysis()`, the first module's where jax returns a list)."""
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else {}
  return analysis or {}


def compiled_traffic(compiled) -> float:
  """Bytes the compiled program reads and writes in HBM per device, by
  XLA's own accounting (each fusion's operands and results, each
  collective's; a loop body once)."""
  return float(compiled_costs(compiled).get("bytes accessed", 0.0))
