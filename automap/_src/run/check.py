"""Does it fit? A step's layout compiled for a mesh (a TPU slice from
`automap.tpu_mesh`, on any machine), its allocation against the device's
memory, and what the compiler emitted beside what automap predicted."""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from typing import Any

import jax

from automap._src.cost.hardware import Hardware, get_hardware, on_mesh
from automap._src.cost.model import Cost
from automap._src.cost.program import Program
from automap._src.cost.tracker import Tracker
from automap._src.plan import build, planner
from automap._src.plan.plan import Plan
from automap._src.run import apply as apply_lib
from automap._src.run import verify as verify_lib
from automap._src.run.compiled import compiled_memory
from automap._src.run.referee import compile_layout
from automap._src.sharding import annotations
from automap._src.sharding.mesh import MeshError, MeshSpec
from automap._src.sharding.state import flat_specs

_GiB = 2**30
# XLA:TPU refuses a program whose buffers exceed the device's memory, and
# says by how much: "... required for HLO temporaries (22.36G) exceeds
# available HBM (15.75G)".
_OUT_OF_MEMORY = re.compile(r"RESOURCE_EXHAUSTED|[Rr]an out of memory")
_AVAILABLE = re.compile(r"available HBM \(([0-9.]+)([KMGT])\)")


@dataclasses.dataclass(frozen=True)
class Check:
  """A layout compiled for a mesh, against the device's memory.

  Attributes:
    layout: what was compiled: "automap's plan" or "your layout".
    mesh: the mesh, in words (its devices' kind, axes and sizes).
    hardware: the device spec that priced it; its `hbm_capacity` is the
      memory the allocation is held against.
    predicted: automap's price of the layout, for the compiler used.
    report: the compiled program read beside the prediction; None where
      the compiler refused it for memory.
    compile_seconds: wall time of the compile.
    refusal: the compiler's own message where it ran out of memory.
  """

  layout: str
  mesh: str
  hardware: Hardware
  predicted: Cost
  report: verify_lib.Report | None
  compile_seconds: float
  refusal: str | None = None

  @property
  def capacity(self) -> float:
    """Device memory, bytes: the compiler's own figure where it refused
    (what it leaves for the program), else the hardware's HBM."""
    if self.refusal:
      m = _AVAILABLE.search(self.refusal)
      if m:
        return float(m.group(1)) * 2 ** (10 * "KMGT".index(m.group(2)) + 10)
    return self.hardware.hbm_capacity

  @property
  def fits(self) -> bool:
    """Whether the compiled program's device allocation (arguments,
    results less aliased, temporaries) fits the device's memory."""
    return self.report is not None and self.report.compiled_memory <= self.capacity

  @property
  def compiled_memory(self) -> float | None:
    """Bytes per device the compiled program allocates; None if refused."""
    return None if self.report is None else self.report.compiled_memory

  def table(self) -> str:
    """The check, readably: fits or not, memory, collectives, step time."""
    predicted = self.predicted.peak_memory / _GiB
    lines = [f"{self.layout} on {self.mesh}, priced as {self.hardware.name}"]
    if self.report is None:
      lines.append(f"fits: NO: the compiler refused it: {self.refusal}")
      lines.append(f"automap predicted {predicted:.2f} GiB per device")
    else:
      used = self.report.compiled_memory / _GiB
      lines.append(
          f"fits: {'yes' if self.fits else 'NO'}: {used:.2f} GiB of "
          f"{self.capacity / _GiB:.2f} GiB per device ({used / (self.capacity / _GiB):.0%}); "
          f"automap predicted {predicted:.2f} GiB")
      lines.append(self.report.table())
    if self.report is not None and self.report.compiled_seconds is None:
      lines.append(f"step time (s): automap {self.predicted.step_time:.3e}")
    lines.append(f"compiled in {self.compile_seconds:.1f} s")
    return "\n".join(lines)


def describe(mesh: jax.sharding.Mesh) -> str:
  """A mesh in words: its devices' kind and count, and its axes."""
  devices = mesh.devices.flat
  slices = {getattr(d, "slice_index", None) for d in devices} - {None}
  many = f" in {len(slices)} slices" if len(slices) > 1 else ""
  axes = " x ".join(f"{n}={s}" for n, s in mesh.shape.items())
  return f"{mesh.devices.size} {devices[0].device_kind} devices{many} ({axes})"


def _compile(build_compiled: Callable[[], jax.stages.Compiled]
             ) -> tuple[jax.stages.Compiled | None, str | None, float]:
  """(compiled, None, seconds), or (None, the compiler's message, seconds)
  where it ran out of device memory."""
  t0 = time.perf_counter()
  try:
    compiled = build_compiled()
  except Exception as e:  # XLA's refusal is a runtime error of its own type.
    if not _OUT_OF_MEMORY.search(str(e)):
      raise
    message = next((line for line in str(e).splitlines() if _OUT_OF_MEMORY.search(line)),
                   str(e).splitlines()[0])
    return None, message.strip(), time.perf_counter() - t0
  return compiled, None, time.perf_counter() - t0


def check(fn: Callable, *args: Any, mesh: jax.sharding.Mesh, plan: Plan | None = None,
          in_shardings: Any = None, hardware: str | Hardware | None = None,
          names: Any = None, layout_rules: Any = None) -> Check:
  """Compiles a layout of `fn(*args)` for `mesh` and holds it against the
  device's memory: automap's plan, or a layout written by hand.

  On a TPU slice from `automap.tpu_mesh` this is XLA:TPU's own compile, on
  any machine: "does this step fit on 1,024 v5p chips, and what will
  XLA:TPU emit?". The arguments may be `jax.ShapeDtypeStruct`s.

  Args:
    fn: the step.
    *args: its arguments (arrays or ShapeDtypeStructs).
    mesh: a concrete mesh (a compile-only one from `automap.tpu_mesh`, or
      this machine's devices).
    plan: automap's plan of the step for this mesh's shape; or
    in_shardings: a layout written by hand, as `automap.evaluate` takes it
      (a pytree prefix of PartitionSpecs). Neither: the layout the
      arguments state (their NamedShardings or flax metadata), else
      replicated.
    hardware: the device spec to price with and hold memory against
      (default: the plan's, else the catalogue's entry for the mesh's
      devices, `automap.hardware_for_devices`, else "tpu-v4").
    names: as for `automap.search`.
    layout_rules: as for `automap.evaluate`.

  Returns:
    The `Check`: `fits`, the compiled allocation against the device's
    memory, collectives by kind and axes predicted beside compiled, the
    compiler's own time estimate, and the compile's wall time.

  Raises:
    TypeError: both `plan` and `in_shardings` given.
    automap.MeshError: `mesh` is abstract, or the plan is for another
      mesh shape.
    automap.PlanError: the plan was made for another program.
  """
  if plan is not None and in_shardings is not None:
    raise TypeError("check takes plan= (automap's plan) or in_shardings= (your layout), "
                    "not both.")
  if not isinstance(mesh, jax.sharding.Mesh):
    raise MeshError(f"check compiles, so mesh must be a concrete jax.sharding.Mesh "
                    f"(automap.tpu_mesh('v5p-256', ...) for a TPU slice), got "
                    f"{type(mesh).__name__}.")
  hw = _hardware(hardware, plan, mesh)
  compiler = verify_lib.compiler_of(mesh)
  if plan is not None:
    if MeshSpec.of(mesh) != plan.mesh:
      raise MeshError(f"mesh {MeshSpec.of(mesh)} differs from the plan's {plan.mesh}.")
    traced = planner.trace(fn, args, mesh, names=names)
    verify_lib.check_fingerprint(plan, traced)
    program = Program.build(traced, plan.mesh, hw, compiler=compiler,
                            constraints=plan.program_constraints)
    predicted = Tracker(program.model, build.state_of(program, plan)).cost()
    compiled, refusal, seconds = _compile(
        lambda: apply_lib.compile_with_plan(traced, mesh, plan, args))
    layout = "automap's plan"
  else:
    traced = planner.trace(fn, args, mesh, names=names)
    program = Program.build(traced, MeshSpec.of(mesh), hw, compiler=compiler)
    dynamic = traced.dynamic_args(args)
    if in_shardings is None:
      stated = annotations.read(dynamic, traced.in_paths, program.mesh, rules=layout_rules)
      specs = [jax.sharding.PartitionSpec() if s is None else s for s in stated.specs]
    else:
      specs = flat_specs(in_shardings, dynamic)
    predicted = Tracker(program.model, program.state_from_specs(specs)).cost()
    compiled, refusal, seconds = _compile(
        lambda: compile_layout(traced, mesh, specs, args))
    layout = "your layout"
  report = None if compiled is None else verify_lib.read_compiled(compiled, mesh, predicted)
  return Check(layout, describe(mesh), hw, predicted, report, seconds, refusal)


def compile_plan_for(traced, mesh: jax.sharding.Mesh, args: tuple):
  """A `plan.guard.CompilePlan` for `traced` on `mesh`: a plan compiled,
  (its device allocation, None), or (None, the compiler's refusal) where it
  ran out of memory."""

  def compile_plan(plan: Plan) -> tuple[float | None, str | None]:
    compiled, refusal, _ = _compile(
        lambda: apply_lib.compile_with_plan(traced, mesh, plan, args))
    return (None, refusal) if compiled is None else (compiled_memory(compiled)[0], None)
  return compile_plan


def _hardware(hardware, plan, mesh) -> Hardware:
  """The given spec; else the plan's; else the mesh's devices' entry."""
  if hardware is None and plan is not None:
    hardware = plan.hardware
  return on_mesh(get_hardware(hardware, mesh), mesh)


__all__ = ["Check", "check", "compile_plan_for", "describe"]
