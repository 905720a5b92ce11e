"""XLA:TPU as the yardstick: automap's predictions beside XLA:TPU's own compile.

Every row compiles one layout of one step for a compile-only TPU slice
(`automap.tpu_mesh`) with `automap.check`, and records automap's price of
it (for XLA:TPU's compiler) beside what XLA:TPU emitted: collective bytes
per device by kind and mesh axes, memory per device (the compiled
allocation against the predicted peak), automap's step time against
XLA:TPU's own `optimal_seconds`, and the compile's wall time. The layouts
are automap's plan (searched for the slice's chip) and the hand-written
experts (`automap.referee.expert_specs`: data parallel, Megatron + DP,
FSDP, where the mesh and program admit them).

Parts, each runnable alone:
- `small`: the fidelity table's programs (`fidelity.cases`) on its (4, 2)
  and (2, 2, 2) meshes, on 8 v5p chips ("v5p-16") and 8 v6e chips ("v6e-8");
- `outside`: other libraries' train steps (`tests/outside_steps.py`, as
  `outside.py` builds them) on 8 v5p chips, (4, 2);
- `pod`: llama shapes as `pod_scale.py` builds them (bf16, AdamW, remat'd
  layers) under MaxText's rules (FSDP over (data, fsdp), Megatron over
  tensor, activations pinned), and automap's plan where `--pod-search`
  asks: Llama-3 8B on 256 v5p chips, 70B-width stacks scanned and unrolled
  on 1,024 v5p chips, Mixtral 8x7B on 256 v5p chips.

Each row is appended to `--out` (JSON lines) as soon as it is measured; a
rerun skips the rows already there. `--table` renders the Markdown table
and its summary from such files.

  python benchmarks/tpu.py --part small --out benchmarks/tpu_rows/small.jsonl
  python benchmarks/tpu.py --part outside --out benchmarks/tpu_rows/outside.jsonl
  python benchmarks/tpu.py --part pod --rows 8b-256 70b-1024-scanned-4 --out ...
  python benchmarks/tpu.py --table benchmarks/tpu_rows/*.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
import time
import traceback
import types
import warnings

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import automap  # noqa: E402
from automap import referee, zoo  # noqa: E402

# (topology, hardware): 8 chips of each generation (v5p names count TensorCores).
SMALL = (("v5p-16", "tpu-v5p"), ("v6e-8", "tpu-v6e"))
SMALL_MESHES = ((4, 2), (2, 2, 2))
OUTSIDE_MESH = ((4, 2), ("data", "model"))
POD_AXES = ("data", "fsdp", "tensor")
# name: (pod_scale model, layers (None: the model's own), unrolled, topology, mesh).
POD = {
    "8b-256": ("8b", None, False, "v5p-512", (1, 64, 4)),
    **{f"70b-1024-{form}-{n}": ("70b", n, form == "unrolled", "v5p-2048", (16, 16, 4))
       for n in (4, 16, 40, 80) for form in ("scanned", "unrolled")},
    "8x7b-256": ("8x7b", None, False, "v5p-512", (1, 32, 8)),
}
AUTOMAP = "automap"
MAXTEXT = "MaxText rules"


def _quiet():
  warnings.simplefilter("ignore")


def _record(check: automap.Check) -> dict:
  """A check's numbers as plain JSON: bytes per device, seconds."""
  out = {"fits": check.fits, "refusal": check.refusal,
         "compile_s": check.compile_seconds,
         "predicted_peak": check.predicted.peak_memory,
         "predicted_step": check.predicted.step_time,
         "predicted_comm": {f"{k} {','.join(a)}": v
                            for (k, a), v in check.predicted.comm_bytes.items() if v}}
  if check.report is not None:
    r = check.report
    out.update(compiled_memory=r.compiled_memory, optimal_seconds=r.compiled_seconds,
               compiled_comm={f"{k} {','.join(a)}": v
                              for (k, a), v in r.compiled_comm_bytes.items() if v})
  return out


class Rows:
  """The JSON lines file: rows already measured, and each new one appended
  (and flushed) as soon as it is measured."""

  def __init__(self, path: str):
    self.path = pathlib.Path(path)
    self.done = {self.key(r) for r in read_rows([self.path])} if self.path.exists() else set()

  @staticmethod
  def key(row: dict) -> tuple:
    return row["part"], row["program"], row["topology"], tuple(row["mesh"]), row["layout"]

  def wanted(self, **row) -> bool:
    return self.key(row) not in self.done

  def add(self, row: dict) -> None:
    self.path.parent.mkdir(parents=True, exist_ok=True)
    with self.path.open("a") as f:
      f.write(json.dumps(row) + "\n")
    self.done.add(self.key(row))
    comm = sum(row.get("compiled_comm", {}).values())
    print(f"  {row['program']} {row['topology']} {tuple(row['mesh'])} {row['layout']}: "
          + (f"error {row['error']}" if "error" in row else
             f"compiled {comm / 2**20:.2f} MiB comm, {row.get('compiled_memory', 0) / 2**20:.1f}"
             f" MiB memory in {row['compile_s']:.1f} s"), file=sys.stderr, flush=True)


def measure_layouts(rows: Rows, base: dict, step, mesh, hardware: str, seconds: float) -> None:
  """automap's plan of `step` and each hand-written expert, compiled on `mesh`."""
  hw = automap.HARDWARE[hardware]
  names = getattr(step, "names", None)
  if rows.wanted(**base, layout=AUTOMAP):
    row = dict(base, layout=AUTOMAP)
    try:
      t0 = time.perf_counter()
      plan = automap.search(step.fn, *step.args, mesh=mesh, hardware=hw, names=names,
                            budget=automap.Budget(seconds=seconds, progress=False))
      row["search_s"] = time.perf_counter() - t0
      row.update(_record(automap.check(step.fn, *step.args, mesh=mesh, plan=plan,
                                       names=names)))
    except Exception as e:  # noqa: BLE001 - the table reports what failed
      row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    rows.add(row)
  experts, traced = referee.expert_specs(step, mesh, hw)
  for name, (specs, _, _) in experts.items():
    if not rows.wanted(**base, layout=name):
      continue
    row = dict(base, layout=name)
    try:
      row.update(_record(automap.check(
          step.fn, *step.args, mesh=mesh, hardware=hw, names=names,
          in_shardings=jax.tree.unflatten(traced.in_tree, specs))))
    except Exception as e:  # noqa: BLE001
      row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    rows.add(row)


def small(rows: Rows, topologies: list[str], seconds: float) -> None:
  import fidelity

  for name, fn, args, meshes in fidelity.cases(quick=False):
    step = types.SimpleNamespace(fn=fn, args=args, names=None)
    for shape in [m for m in meshes if m in SMALL_MESHES]:
      for topology, hardware in SMALL:
        if topology not in topologies:
          continue
        mesh = automap.tpu_mesh(topology, shape, fidelity.NAMES[:len(shape)])
        base = dict(part="small", program=name, topology=topology, mesh=list(shape),
                    axes=list(mesh.axis_names))
        measure_layouts(rows, base, step, mesh, hardware, seconds)


def outside(rows: Rows, topologies: list[str], seconds: float, only: list[str]) -> None:
  import outside as outside_bench

  shape, names = OUTSIDE_MESH
  for build in outside_bench.outside_steps.BUILDERS:
    if only and build.__name__ not in only:
      continue
    for topology, hardware in SMALL:
      if topology not in topologies:
        continue
      base = dict(part="outside", program=build.__name__, topology=topology,
                  mesh=list(shape), axes=list(names))
      try:
        step = build()
      except ModuleNotFoundError as e:
        if rows.wanted(**base, layout=AUTOMAP):
          rows.add(dict(base, layout=AUTOMAP, error=f"needs {e.name}"))
        continue
      base["program"] = step.name
      measure_layouts(rows, base, step, automap.tpu_mesh(topology, shape, names),
                      hardware, seconds)


def pod(rows: Rows, names: list[str], search_seconds: float) -> None:
  import pod_scale

  for name in names:
    model, layers, unrolled, topology, shape = POD[name]
    devices = math.prod(shape)
    config = pod_scale.config_of(model, devices, unrolled)
    moe = bool(config.experts)
    axes = pod_scale.MOE_AXES if moe else POD_AXES
    if layers is not None:
      config = dataclasses.replace(config, layers=layers)
    if not moe:  # the depth rows' layout: weights FSDP over (data, fsdp)
      config = dataclasses.replace(config, fsdp=("data", "fsdp"))
    mesh = automap.tpu_mesh(topology, shape, axes)
    base = dict(part="pod", program=name, topology=topology, mesh=list(shape),
                axes=list(axes), layers=config.layers, unrolled=unrolled)
    if rows.wanted(**base, layout=MAXTEXT):
      row = dict(base, layout=MAXTEXT)
      params, opt, batch = zoo.llama_param_specs(config, mesh)
      step, args = zoo.llama_train_step(config, abstract=True)
      try:
        # The activations' pins bind to the mesh traced under; an abstract
        # one, as a compile-only mesh's devices cannot run the eager setup.
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
          row.update(_record(automap.check(
              step, *args, mesh=mesh, hardware="tpu-v5p",
              in_shardings=(params, opt, {"inputs": batch, "targets": batch}))))
      except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
      rows.add(row)
    if search_seconds > 0 and rows.wanted(**base, layout=AUTOMAP):
      row = dict(base, layout=AUTOMAP)
      try:
        step, args = zoo.llama_train_step(config, constrained=False, abstract=True)
        t0 = time.perf_counter()
        plan = automap.search(step, *args, mesh=mesh, hardware="tpu-v5p",
                              budget=automap.Budget(seconds=search_seconds, progress=False))
        row["search_s"] = time.perf_counter() - t0
        row.update(_record(automap.check(step, *args, mesh=mesh, plan=plan)))
      except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
      rows.add(row)


def read_rows(paths) -> list[dict]:
  out = []
  for path in paths:
    with open(path) as f:
      out.extend(json.loads(line) for line in f if line.strip())
  return out


def _err(predicted: float, compiled: float) -> float | None:
  """predicted / compiled - 1; None where nothing was compiled to compare."""
  if not compiled:
    return 0.0 if not predicted else None
  return predicted / compiled - 1


def _pct(e: float | None) -> str:
  return "n/a" if e is None else f"{e:+.0%}"


def _kinds(row: dict) -> str:
  """Collective bytes by kind and axes, predicted / compiled, MiB."""
  p, c = row.get("predicted_comm", {}), row.get("compiled_comm", {})
  short = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS",
           "all-to-all": "A2A", "collective-permute": "CP"}
  cells = []
  for key in sorted(set(p) | set(c)):
    kind, axes = key.split(" ")
    cells.append(f"{short.get(kind, kind)}({axes}) {p.get(key, 0) / 2**20:.2f}/"
                 f"{c.get(key, 0) / 2**20:.2f}")
  return "; ".join(cells) or "none"


def table(rows: list[dict]) -> list[str]:
  out = ["| part | program | slice | mesh | layout | collectives by kind(axes), MiB "
         "predicted/XLA | comm MiB predicted / XLA (error) | memory MiB predicted / XLA "
         "(error) | step ms automap / XLA optimal (ratio) | search s | compile s |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    head = (f"| {r['part']} | {r['program']} | {r['topology']} | "
            f"{'x'.join(map(str, r['mesh']))} | {r['layout']} |")
    if "error" in r:
      out.append(f"{head} not run: {r['error']} | | | | | |")
      continue
    search = f"{r['search_s']:.0f}" if "search_s" in r else "-"
    if "compiled_memory" not in r:
      out.append(f"{head} refused: {r['refusal']} | | {r['predicted_peak'] / 2**20:,.0f} / "
                 f"refused | | {search} | {r['compile_s']:.0f} |")
      continue
    pc, cc = sum(r["predicted_comm"].values()), sum(r["compiled_comm"].values())
    pm, cm = r["predicted_peak"], r["compiled_memory"]
    ps, xs = r["predicted_step"], r["optimal_seconds"]
    # XLA:TPU gives no optimal_seconds for some programs.
    step = f"{ps * 1e3:.3g} / n/a" if xs is None else (
        f"{ps * 1e3:.3g} / {xs * 1e3:.3g} ({ps / xs:.2f}x)")
    out.append(f"{head} {_kinds(r)} | {pc / 2**20:,.2f} / {cc / 2**20:,.2f} "
               f"({_pct(_err(pc, cc))}) | {pm / 2**20:,.1f} / {cm / 2**20:,.1f} "
               f"({_pct(_err(pm, cm))}) | {step} | {search} | {r['compile_s']:.1f} |")
  return out


def summary(rows: list[dict]) -> list[str]:
  """Per part, chip and layout (automap's plan, the hand-written ones):
  |predicted/compiled - 1| of collective bytes and memory, median and
  worst, and automap's step time over XLA:TPU's `optimal_seconds`."""
  groups: dict[tuple, list[dict]] = {}
  for r in rows:
    if "compiled_memory" in r:
      who = "automap's plan" if r["layout"] == AUTOMAP else "hand-written"
      groups.setdefault((r["part"], r["topology"], who), []).append(r)
  out = []
  for (part, topology, who), rs in groups.items():
    comm = [_err(sum(r["predicted_comm"].values()), sum(r["compiled_comm"].values()))
            for r in rs]
    undefined = sum(e is None for e in comm)
    comm = np.abs([e for e in comm if e is not None])
    memory = np.abs([_err(r["predicted_peak"], r["compiled_memory"]) for r in rs])
    step = [r["predicted_step"] / r["optimal_seconds"] for r in rs if r["optimal_seconds"]]
    exact = int((comm < 1e-9).sum())
    silent = sum(not r["compiled_comm"] and not r["predicted_comm"] for r in rs)
    out.append(
        f"- {part}, {topology}, {who} ({len(rs)} row{'s' * (len(rs) != 1)}): "
        "collective bytes |error| median "
        f"{np.median(comm):.1%}, worst {comm.max():.1%} ({exact} exact, {silent} of them "
        "with no collectives either side"
        + (f"; {undefined} predicted bytes where XLA:TPU compiled none" if undefined else "")
        + f"); memory |error| median {np.median(memory):.1%}, worst {memory.max():.1%}; "
        + (f"step time automap / XLA:TPU optimal_seconds median {np.median(step):.2f}x "
           f"(range {min(step):.2f}x to {max(step):.2f}x" if step else "no optimal_seconds")
        + (f"; XLA:TPU gave no optimal_seconds on {len(rs) - len(step)} row"
           + "s" * (len(rs) - len(step) != 1)
           if len(step) < len(rs) else "") + ").")
  failed = [r for r in rows if "compiled_memory" not in r]
  if failed:
    out.append(f"- not compiled: {len(failed)} rows ("
               + "; ".join(f"{r['program']} {r['layout']}: "
                           + (r.get("error") or f"refused, {r['refusal']}") for r in failed)
               + ").")
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", choices=("small", "outside", "pod"))
  parser.add_argument("--out", help="JSON lines file the rows are appended to")
  parser.add_argument("--table", nargs="*", help="render these JSON lines files instead")
  parser.add_argument("--topology", nargs="*", default=[t for t, _ in SMALL],
                      choices=[t for t, _ in SMALL], help="small and outside: which chips")
  parser.add_argument("--seconds", type=float, default=10.0,
                      help="small and outside: automap's search budget per row")
  parser.add_argument("--steps", nargs="*", default=[],
                      help="outside: these builders of tests/outside_steps.py only (default all)")
  parser.add_argument("--rows", nargs="*", default=list(POD), choices=list(POD),
                      help="pod: which rows")
  parser.add_argument("--pod-search", type=float, default=0.0,
                      help="pod: automap's search budget in seconds (0: MaxText rules only)")
  opts = parser.parse_args()
  if opts.table is not None:
    rows = read_rows(opts.table)
    print("\n".join(table(rows)))
    print()
    print("\n".join(summary(rows)))
    return
  if not opts.part or not opts.out:
    parser.error("give --part and --out, or --table FILES")
  _quiet()
  rows = Rows(opts.out)
  if opts.part == "small":
    small(rows, opts.topology, opts.seconds)
  elif opts.part == "outside":
    outside(rows, opts.topology, opts.seconds, opts.steps)
  else:
    pod(rows, opts.rows, opts.pod_search)


if __name__ == "__main__":
  main()
