"""Plan: the chosen shardings of one program on one mesh, and their cost.

A plan is plain data: flat PartitionSpecs of the arguments and results, the
constraints on intermediates (by value id in the program's linearisation),
the predicted cost and the search statistics. It round-trips through JSON
and is tied to its program by a fingerprint, so a stale plan is never applied
to a changed program.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from typing import Any

import jax
from jax.sharding import PartitionSpec

from automap._src.cost.hardware import Hardware
from automap._src.cost.model import Cost
from automap._src.plan import explain, export
from automap._src.plan.errors import PlanError
from automap._src.plan.report import LayerRow
from automap._src.sharding.mesh import MeshSpec

SCHEMA = "automap.plan/1"


def spec_to_json(spec: PartitionSpec) -> list:
  return [list(e) if isinstance(e, tuple) else e for e in spec]


def spec_from_json(entries: list) -> PartitionSpec:
  return PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in entries])


@dataclasses.dataclass(frozen=True)
class Yardstick:
  """An expert strategy priced on the plan's program and mesh.

  cost: its predicted cost.
  differs: argument path -> its PartitionSpec, where it differs from the plan's.
  """

  cost: Cost
  differs: dict[str, PartitionSpec]

  def to_json(self) -> dict:
    return {"cost": self.cost.to_json(),
            "differs": [[p, spec_to_json(s)] for p, s in self.differs.items()]}

  @classmethod
  def from_json(cls, d: dict) -> Yardstick:
    return cls(Cost.from_json(d["cost"]),
               {p: spec_from_json(s) for p, s in d["differs"]})


@dataclasses.dataclass(frozen=True)
class Plan:
  """Shardings for one program signature on one mesh.

  Attributes:
    mesh: axis names and sizes the plan is for.
    hardware: the hardware spec the cost was predicted on.
    fingerprint: digest of the program the plan belongs to.
    in_paths: per flat argument, its pytree path, or the name `names=` gave
      it.
    out_paths: per flat output, likewise.
    tree_paths: per flat argument, its pytree path where `names=` renamed
      any (export matches trees by either); empty when in_paths are those.
    in_shapes: per flat argument, its shape.
    in_specs: per flat argument, its PartitionSpec.
    out_specs: per flat output, its PartitionSpec.
    constraints: value id -> PartitionSpec for intermediates.
    reshards: (op's first result id, operand position) -> the layout that
      operand takes on entry to the op, where it differs from its own.
    natural: value id -> the layout its op computes it in, where that differs
      from its own (the constraint to its own layout follows).
    inferred: value id -> the layout the search priced for an intermediate
      the rewritten program cannot constrain (inside a custom-derivative or
      rematerialised call, bound whole): XLA infers those; `verify`
      re-prices the plan with them as searched.
    cost: predicted cost under the cost model.
    collectives: predicted (scope, kind, axes, bytes, count) per op scope.
    memory_limit: the bytes per device the search was held to (None: none).
    layers: per layer, its compute and communication seconds and its share
      of the peak memory (`report.LayerRow`), in program order.
    yardsticks: expert strategy name -> its cost on the same program and
      mesh, and the argument layouts where it differs from the plan.
    program_constraints: what the plan did with the program's own layout
      constraints ("keep": compiled as written; "hints", "ignore": removed
      from the rewritten program, whose layouts are the plan's alone).
    stats: search statistics (strategy, episodes, evaluations, actions, ...),
      what the inputs and seed determine: the saved JSON is the same bytes
      run after run.
    timings: wall seconds of the run that made this object ("search",
      "to_best", "refine", "plan": trace to jitted function); not saved.
  """

  mesh: MeshSpec
  hardware: Hardware
  fingerprint: str
  in_paths: tuple[str, ...]
  out_paths: tuple[str, ...]
  in_shapes: tuple[tuple[int, ...], ...]
  in_specs: tuple[PartitionSpec, ...]
  out_specs: tuple[PartitionSpec, ...]
  constraints: dict[int, PartitionSpec]
  reshards: dict[tuple[int, int], PartitionSpec]
  natural: dict[int, PartitionSpec]
  cost: Cost
  collectives: tuple[tuple[str, str, tuple[str, ...], float, int], ...]
  stats: dict[str, Any]
  memory_limit: float | None = None
  layers: tuple[LayerRow, ...] = ()
  yardsticks: dict[str, Yardstick] = dataclasses.field(default_factory=dict)
  inferred: dict[int, PartitionSpec] = dataclasses.field(default_factory=dict)
  program_constraints: str = "keep"
  tree_paths: tuple[str, ...] = ()
  in_tree: Any = dataclasses.field(default=None, compare=False, repr=False)
  out_tree: Any = dataclasses.field(default=None, compare=False, repr=False)
  timings: dict[str, float] = dataclasses.field(default_factory=dict, compare=False,
                                                repr=False)

  @property
  def in_shardings(self):
    """PartitionSpecs in the structure of the arguments."""
    return _tree(self.in_tree, self.in_paths, self.in_specs)

  @property
  def out_shardings(self):
    """PartitionSpecs in the structure of the results."""
    return _tree(self.out_tree, self.out_paths, self.out_specs)

  def to_json(self) -> dict:
    return {
        "schema": SCHEMA,
        "mesh": {"axis_names": list(self.mesh.axis_names),
                 "axis_sizes": list(self.mesh.axis_sizes)},
        "hardware": dataclasses.asdict(self.hardware),
        "fingerprint": self.fingerprint,
        "in": [[p, list(shape), spec_to_json(s)] for p, shape, s in
               zip(self.in_paths, self.in_shapes, self.in_specs)],
        "out": [[p, spec_to_json(s)] for p, s in zip(self.out_paths, self.out_specs)],
        "constraints": [[v, spec_to_json(s)]
                        for v, s in sorted(self.constraints.items())],
        "reshards": [[v, p, spec_to_json(s)]
                     for (v, p), s in sorted(self.reshards.items())],
        "natural": [[v, spec_to_json(s)] for v, s in sorted(self.natural.items())],
        "inferred": [[v, spec_to_json(s)] for v, s in sorted(self.inferred.items())],
        "program_constraints": self.program_constraints,
        "cost": self.cost.to_json(),
        "collectives": [[s, k, list(a), b, n] for s, k, a, b, n in self.collectives],
        "stats": self.stats,
        "memory_limit": self.memory_limit,
        "layers": [r.to_json() for r in self.layers],
        "yardsticks": {k: y.to_json() for k, y in self.yardsticks.items()},
    } | ({"tree_paths": list(self.tree_paths)} if self.tree_paths else {})

  @classmethod
  def from_json(cls, d: dict) -> Plan:
    if not isinstance(d, dict) or d.get("schema") != SCHEMA:
      raise PlanError(
          f"not an automap plan of schema {SCHEMA!r} (found "
          f"{d.get('schema') if isinstance(d, dict) else type(d).__name__!r}). "
          "Re-create it with this version of automap.")
    try:
      return cls(
          mesh=MeshSpec(tuple(d["mesh"]["axis_names"]),
                        tuple(d["mesh"]["axis_sizes"])),
          hardware=Hardware.from_json(d["hardware"]), fingerprint=d["fingerprint"],
          in_paths=tuple(p for p, _, _ in d["in"]),
          out_paths=tuple(p for p, _ in d["out"]),
          in_shapes=tuple(tuple(shape) for _, shape, _ in d["in"]),
          in_specs=tuple(spec_from_json(s) for _, _, s in d["in"]),
          out_specs=tuple(spec_from_json(s) for _, s in d["out"]),
          constraints={int(v): spec_from_json(s) for v, s in d["constraints"]},
          reshards={(int(v), int(p)): spec_from_json(s)
                    for v, p, s in d["reshards"]},
          natural={int(v): spec_from_json(s) for v, s in d["natural"]},
          inferred={int(v): spec_from_json(s) for v, s in d.get("inferred", ())},
          program_constraints=d.get("program_constraints", "keep"),
          cost=Cost.from_json(d["cost"]),
          collectives=tuple((s, k, tuple(a), b, n)
                            for s, k, a, b, n in d["collectives"]),
          stats=dict(d["stats"]), memory_limit=d.get("memory_limit"),
          layers=tuple(LayerRow.from_json(r) for r in d.get("layers", ())),
          yardsticks={k: Yardstick.from_json(y)
                      for k, y in d.get("yardsticks", {}).items()},
          tree_paths=tuple(d.get("tree_paths", ())))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
      raise PlanError(f"malformed plan: {e!r}") from e

  def save(self, path: str | os.PathLike) -> None:
    """Writes the plan as JSON, atomically (no half-written file)."""
    path = os.fspath(path)
    # A temporary of its own per writer, renamed over the target: readers
    # and concurrent writers only ever see whole files.
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".",
                               suffix=".tmp", dir=os.path.dirname(path) or ".")
    try:
      with os.fdopen(fd, "w") as f:
        json.dump(self.to_json(), f, indent=1, sort_keys=True)
      os.chmod(tmp, 0o644)
      os.replace(tmp, path)
    except BaseException:
      with contextlib.suppress(OSError):
        os.remove(tmp)
      raise

  @classmethod
  def load(cls, path: str | os.PathLike) -> Plan:
    try:
      with open(path) as f:
        d = json.load(f)
    except json.JSONDecodeError as e:
      raise PlanError(f"{os.fspath(path)!r} is not valid JSON: {e}") from e
    return cls.from_json(d)

  def specs(self, tree, at: int | str | None = None):
    """PartitionSpecs shaped like `tree`: one argument of the planned
    function (params, an optimizer state) or a sub-tree of one; `at` picks
    the argument by index or path prefix when the leaves alone don't."""
    return export.specs(self, tree, at)

  def logical_rules(self, names, at: int | str | None = None):
    """The plan as flax/MaxText logical-axis rules, given each parameter's
    logical dimension names; a `LogicalRules` with the leaves they miss."""
    return export.logical_rules(self, names, at)

  def explain(self) -> str:
    """A readable account: parameter layouts, collectives and cost."""
    return explain.explain(self)

  def plot(self, path: str | os.PathLike) -> None:
    """Writes a PNG of per-layer time and memory (needs matplotlib)."""
    explain.plot(self, path)


def _tree(tree, paths, specs):
  if tree is not None:
    return jax.tree.unflatten(tree, list(specs))
  return dict(zip(paths, specs))  # A loaded plan: keyed by leaf path.
