"""What XLA compiled: the collectives of the partitioned HLO (kind, result
bytes, replica groups mapped back to mesh axes) and its `memory_analysis()`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any

import numpy as np

from automap._src.run import hlo

if TYPE_CHECKING:
  import jax

_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_GROUPS_LIST = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(
    r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
# Shardy's form: replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b'}
_GROUPS_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((?:\[([0-9,]+)\]"
    r"(?:T\(([0-9,]+)\))?|([0-9,]+))\))?\s*\{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[0-9,]*\},?)*)\}")
# Ops a value passes through unchanged in its bytes' meaning: views, and
# copies (an async copy-start / copy-done pair moves it between memories).
_VIEWS = ("bitcast", "copy", "reshape", "get-tuple-element")
_COPIES = ("bitcast", "copy", "reshape", "copy-start", "copy-done")
_SLICES = ("dynamic-slice", "slice")
# XLA:TPU runs a collective across slices (over the data-centre network) as
# host transfers to its Megascale runtime: a send / recv pair per device,
# the recv's frontend attributes naming the collective it is part of.
_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="([A-Z_]+)"')
_MEGASCALE_KINDS = {"ALL_REDUCE": "all-reduce", "ALL_GATHER": "all-gather",
                    "REDUCE_SCATTER": "reduce-scatter", "ALL_TO_ALL": "all-to-all",
                    "ONE_TO_ONE": "collective-permute"}


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of the compiled program, per device.

  Attributes:
    kind: "all-reduce", "all-gather", "reduce-scatter", "all-to-all" or
      "collective-permute" (an asynchronous `-start` counts as its kind; an
      all-reduce whose fused computation keeps one device's slice of it, as
      XLA:TPU emits a reduce-scatter, counts as "reduce-scatter").
    nbytes: bytes of its result on one device (every array of a combined,
      tuple collective).
    axes: mesh axes its replica groups span (empty: a group of one device).
    line: its instruction in the HLO text, stripped.
    trips: times it runs per call: the trip counts of the while loops
      around it multiplied (1 outside loops, or where neither XLA's
      `known_trip_count` nor the loop's condition says).
    dtype: the element type it moves (its first array's).
    converted_from: the element type its operand was converted from just
      before it (XLA:TPU gathers an f32 weight as bf16 where the dot that
      reads it runs in bf16), or None.
    combined: how many arrays it moves (more than one: collectives a
      combiner merged into one tuple collective).
    sliced_nbytes: for an all-reduce whose every reader slices it (a
      reduce-scatter the compiler did not form), the bytes the slices keep;
      None otherwise.
    form: how it was written: "" (in place), "async" (a start / done pair),
      "all-reduce-scatter fusion" (XLA:TPU's reduce-scatter: an all-reduce
      and a dynamic-slice fused into one collective), or "megascale" (XLA:TPU's
      collective across slices, a host transfer over the data-centre
      network: its axes those that cross slices).
  """

  kind: str
  nbytes: int
  axes: tuple[str, ...]
  line: str
  trips: int = 1
  dtype: str = ""
  converted_from: str | None = None
  combined: int = 1
  sliced_nbytes: int | None = None
  form: str = ""


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
  size = int(np.prod(shape))
  if any(i >= size or i < 0 for group in groups for i in group):
    raise ValueError(
        f"a replica group names device {max(max(g) for g in groups if g)}, but the mesh has "
        f"{size}: the program was compiled on another mesh.")
  varying = np.zeros(len(shape), bool)
  for group in groups:
    coords = np.array([np.unravel_index(i, shape) for i in group])
    if len(coords) > 1:
      varying |= (coords != coords[0]).any(axis=0)
  return tuple(n for n, v in zip(mesh.axis_names, varying) if v)


def _slice_axes(mesh) -> tuple[str, ...]:
  """The mesh axes along which devices' slices differ (none on one slice)."""
  devices = np.asarray(mesh.devices)
  slices = np.vectorize(lambda d: getattr(d, "slice_index", None) or 0)(devices)
  return tuple(n for i, n in enumerate(mesh.axis_names)
               if (np.diff(slices, axis=i) != 0).any())


def _megascale(instruction: hlo.Instruction, mesh, runs: int) -> Collective | None:
  """A collective across slices, read off its recv (the bytes that arrive)."""
  kind = _MEGASCALE.search(instruction.line)
  if instruction.opcode != "recv" or not kind:
    return None
  payload = hlo.tuple_elements(instruction.shape)[0]
  types = hlo.arrays(payload)
  return Collective(_MEGASCALE_KINDS.get(kind.group(1), "collective-permute"),
                    hlo.shape_bytes(payload), _slice_axes(mesh), instruction.line.strip(), runs,
                    dtype=types[0][0] if types else "", form="megascale")


def _kind(opcode: str) -> tuple[str, bool] | None:
  """(collective kind, asynchronous) of an opcode; None for other ops."""
  if opcode in _KINDS:
    return opcode, False
  if opcode.endswith("-start") and opcode[:-len("-start")] in _KINDS:
    return opcode[:-len("-start")], True
  return None


def _result_shape(instruction: hlo.Instruction, kind: str, is_async: bool) -> str:
  """The part of a collective's shape that is its result: an async start's
  shape holds its operands too, (operands, results[, contexts]), except an
  all-reduce-start's, which is its result alone."""
  if not is_async or kind == "all-reduce":
    return instruction.shape
  elements = hlo.tuple_elements(instruction.shape)
  return elements[1] if len(elements) > 1 else instruction.shape


def _source(module: hlo.Module, computation: str, name: str, depth: int = 0
            ) -> tuple[str, hlo.Instruction] | None:
  """The instruction that makes `name`, looked through fusions to their
  root and through views (bitcasts, copies) to what they view."""
  made = module.by_name(computation).get(name)
  if made is None or depth > 8:
    return None
  if made.opcode == "fusion":
    called = hlo.called_computations(made)
    root = module.root(called[0]) if called else None
    if root is not None:
      return _source(module, called[0], root.name, depth + 1) or (computation, made)
  if made.opcode in _COPIES and made.operands:
    return _source(module, computation, made.operands[0], depth + 1) or (computation, made)
  return computation, made


def _converted_from(module: hlo.Module, computation: str, instruction: hlo.Instruction
                    ) -> str | None:
  for operand in instruction.operands:
    found = _source(module, computation, operand)
    if found is None or found[1].opcode != "convert" or not found[1].operands:
      continue
    where, convert = found
    source = module.by_name(where).get(convert.operands[0])
    types = hlo.arrays(source.shape) if source is not None else []
    if types:
      return types[0][0]
  return None


def _scattered(module: hlo.Module, computation: str, instruction: hlo.Instruction,
               callers: dict) -> str | None:
  """The shape one device keeps where an all-reduce is XLA:TPU's form of a
  reduce-scatter: the root of a computation that a fusion calls, a
  dynamic-slice (through views) of the all-reduce."""
  root = module.root(computation)
  caller = callers.get(computation)
  if root is None or caller is None or caller[1].opcode != "fusion":
    return None
  names = {instruction.name}
  for i in module.computations[computation]:
    if i.opcode in _VIEWS and i.operands and i.operands[0] in names:
      names.add(i.name)
  if root.opcode == "dynamic-slice" and root.operands and root.operands[0] in names:
    return root.shape
  return None


def _parameter(module: hlo.Module, computation: str, index: int) -> str | None:
  """The name of a computation's `parameter(index)`."""
  for i in module.computations.get(computation, ()):
    if i.opcode == "parameter" and re.search(rf"parameter\({index}\)", i.line):
      return i.name
  return None


def _kept_bytes(module: hlo.Module, computation: str, name: str, depth: int = 0
                ) -> tuple[int, bool]:
  """(bytes its readers keep, whether every reader slices) of value `name`:
  readers followed through views, get-tuple-elements (a combined
  collective's arrays one by one) and into the fusions that read it."""
  readers = module.users(computation, name)
  made = module.by_name(computation).get(name)
  whole = hlo.shape_bytes(made.shape) if made is not None else 0
  if not readers or depth > 6:
    return whole, False
  kept, sliced = 0, True
  for reader in readers:
    if reader.opcode in _SLICES and reader.operands[0] == name:
      kept += hlo.shape_bytes(reader.shape)
      continue
    if reader.opcode in _VIEWS:
      inner, all_sliced = _kept_bytes(module, computation, reader.name, depth + 1)
    elif reader.opcode == "fusion" and hlo.called_computations(reader):
      fused = hlo.called_computations(reader)[0]
      parameter = _parameter(module, fused, reader.operands.index(name))
      inner, all_sliced = (_kept_bytes(module, fused, parameter, depth + 1)
                           if parameter else (whole, False))
    else:
      inner, all_sliced = whole, False
    kept, sliced = kept + inner, sliced and all_sliced
  return kept, sliced


def _sliced_bytes(module: hlo.Module, computation: str, instruction: hlo.Instruction
                  ) -> int | None:
  """Bytes kept where readers slice an all-reduce's result (every array of
  a combined one that its readers slice counts its slices, the rest whole);
  None where no reader slices."""
  arrays = hlo.tuple_elements(instruction.shape)
  if len(arrays) == 1:
    kept, sliced = _kept_bytes(module, computation, instruction.name)
    return kept if sliced else None
  parts = {}
  for reader in module.users(computation, instruction.name):
    index = re.search(r"index=([0-9]+)", reader.attributes)
    if reader.opcode == "get-tuple-element" and index:
      parts[int(index.group(1))] = _kept_bytes(module, computation, reader.name)
  if not any(sliced for _, sliced in parts.values()):
    return None
  return sum(parts[i][0] if i in parts and parts[i][1] else hlo.shape_bytes(a)
             for i, a in enumerate(arrays))


def collectives(hlo_text: str, mesh: jax.sharding.Mesh) -> list[Collective]:
  """Every collective in compiled HLO text, with its mesh axes and how many
  times it runs per call (`Collective.trips`).

  Reads each backend's scheduled module: in-place collectives and async
  start / done pairs (counted once, at the start), combined tuple
  collectives, collectives inside while loops (their trip counts), inside
  fusions (XLA:TPU's all-reduce-scatter fusion, read as the reduce-scatter
  it is) and async wrappers, XLA:TPU's collectives across slices (host
  transfers to its Megascale runtime), and replica groups as explicit
  lists, iota forms or Shardy's mesh form.

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
  module = hlo.Module.parse(hlo_text)
  runs, callers = module.runs(), module.callers()
  found = []
  for computation, instruction in module.instructions():
    kind = _kind(instruction.opcode)
    if kind is None:
      across = _megascale(instruction, mesh, runs.get(computation, 1))
      if across is not None:
        found.append(across)
      continue
    kind, is_async = kind
    result = _result_shape(instruction, kind, is_async)
    form, sliced = "async" if is_async else "", None
    if kind == "all-reduce":
      scattered = _scattered(module, computation, instruction, callers)
      if scattered is not None:
        kind, result, form = "reduce-scatter", scattered, "all-reduce-scatter fusion"
      else:
        sliced = _sliced_bytes(module, computation, instruction)
    types = hlo.arrays(result)
    found.append(Collective(
        kind, hlo.shape_bytes(result), _axes_of_groups(_groups(instruction.line), mesh),
        instruction.line.strip(), runs.get(computation, 1),
        dtype=types[0][0] if types else "",
        converted_from=_converted_from(module, computation, instruction),
        combined=max(len(types), 1), sliced_nbytes=sliced, form=form))
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
  """Bytes per device the compiled program allocates in device memory:
  arguments, results (less those aliased to arguments) and temporaries,
  from XLA's `memory_analysis()`; host memory (`compiled_host_memory`) apart.

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


def compiled_host_memory(stats: Any) -> float:
  """Bytes per device the program holds in host memory (offloaded
  activations, `pinned_host` arguments), as `compiled_memory` counts device
  memory.

  Args:
    stats: a compiled program's `memory_analysis()` (the second value
      `compiled_memory` returns), or None.

  Returns:
    Host arguments + outputs - aliased + temporaries, in bytes; 0 where the
    analysis has no host figures.
  """
  if stats is None:
    return 0.0
  parts = [getattr(stats, f"host_{k}_size_in_bytes", 0) or 0
           for k in ("argument", "output", "alias", "temp")]
  return float(parts[0] + parts[1] - parts[2] + parts[3])


def compiled_seconds(compiled: jax.stages.Compiled) -> float | None:
  """The backend's own estimate of one call's time.

  XLA:TPU's `cost_analysis()["optimal_seconds"]`: it leaves collectives out
  (an all-reduce is estimated as an elementwise op over its input).

  Args:
    compiled: a compiled program.

  Returns:
    Seconds; None on backends that give no estimate (XLA:CPU).
  """
  value = compiled_costs(compiled).get("optimal_seconds")
  return float(value) if value is not None and value > 0 else None


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
