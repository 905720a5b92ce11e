"""Explain: a plan as text a JAX engineer reads in a minute."""

from __future__ import annotations

from collections import defaultdict

from jax.sharding import PartitionSpec

from automap._src.ir.naming import layer_of


def format_bytes(n: float) -> str:
  """Bytes in binary units, e.g. "1.5 GiB" (whole bytes below 1 KiB)."""
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:,.1f} {unit}" if unit != "B" else f"{n:,.0f} B"
    n /= 1024
  raise AssertionError("unreachable")


def format_spec(spec: PartitionSpec) -> str:
  return "P(" + ", ".join("None" if e is None else repr(e) for e in spec) + ")"


def _ms(seconds: float) -> str:
  return f"{seconds * 1e3:.3f} ms"


def _axes_of(plan) -> dict[str, tuple[float, float]]:
  """Mesh axes (joined by "+" where a collective spans several) -> their
  (seconds, bytes)."""
  c = plan.cost
  out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
  for key, nbytes in c.comm_bytes.items():
    row = out["+".join(key[1]) or "-"]
    row[0] += c.comm_seconds.get(key, 0.0)
    row[1] += nbytes
  return {k: (t, b) for k, (t, b) in sorted(out.items())}


def _summary(plan) -> list[str]:
  mesh = ", ".join(f"{n}={s}" for n, s in zip(plan.mesh.axis_names, plan.mesh.axis_sizes))
  c = plan.cost
  lines = [f"automap plan for mesh ({mesh}) on {plan.hardware.name}"]
  if plan.hardware.compiler.async_collectives:
    lines += [
        f"  step time {_ms(c.step_time)} = compute {_ms(c.compute_time)} + communication "
        f"{_ms(c.exposed_comm_time)} exposed of {_ms(c.comm_time)}",
        "  plans ranked by the overlapped clock: collectives beside the compute that does "
        "not need them, as XLA's latency-hiding scheduler runs them "
        f"(serial sum {_ms(c.serial_step_time)})"]
  else:
    lines += [
        f"  step time {_ms(c.step_time)} = compute {_ms(c.compute_time)} "
        f"+ communication {_ms(c.comm_time)}",
        f"  plans ranked by the serial clock: {plan.hardware.compiler.name} runs each "
        "collective in place"]
  lines.append(f"  {c.flops / 1e9:.3f} GFLOP and {format_bytes(c.memory_traffic)} of HBM "
               "traffic per device")
  if c.step_time > 0:
    achieved, peak = c.flops / c.step_time, plan.hardware.flops
    lines.append(f"  {achieved / 1e12:,.2f} TFLOP/s per device, MFU {achieved / peak:.1%} of "
                 f"{plan.hardware.name}'s {peak / 1e12:,.0f} TFLOP/s peak")
  for axes, (t, nbytes) in _axes_of(plan).items():
    lines.append(f"    communication over {axes:<14} {_ms(t)}, {format_bytes(nbytes)}")
  limit = ("no memory limit" if plan.memory_limit is None else
           f"{c.peak_memory / plan.memory_limit:.0%} of the "
           f"{format_bytes(plan.memory_limit)} limit")
  lines.append(f"  peak memory {format_bytes(c.peak_memory)} per device ({limit}), "
               f"arguments {format_bytes(c.argument_memory)}")
  return lines


def _yardsticks(plan) -> list[str]:
  if not plan.yardsticks:
    return []
  c = plan.cost
  lines = ["", "against the expert strategies (same cost model):",
           f"  {'strategy':<26} {'step time':>12} {'compute':>12} {'exposed comm':>12} "
           f"{'peak memory':>12}  layouts",
           f"  {'automap':<26} {_ms(c.step_time):>12} {_ms(c.compute_time):>12} "
           f"{_ms(c.exposed_comm_time):>12} {format_bytes(c.peak_memory):>12}"]
  n = len(plan.in_paths)
  for name, y in plan.yardsticks.items():
    k = y.cost
    speed = k.step_time / c.step_time if c.step_time else float("nan")
    lines.append(
        f"  {name:<26} {_ms(k.step_time):>12} {_ms(k.compute_time):>12} "
        f"{_ms(k.exposed_comm_time):>12} {format_bytes(k.peak_memory):>12}  "
        f"{len(y.differs)} of {n} differ; automap {speed:.2f}x faster")
  for name, y in plan.yardsticks.items():
    if not y.differs:
      continue
    lines += ["", f"where automap differs from {name} (first 12):",
              f"  {'argument':<48} {'automap':<30} {name}"]
    specs = dict(zip(plan.in_paths, plan.in_specs))
    for path, spec in list(y.differs.items())[:12]:
      lines.append(f"  {path:<48} {format_spec(specs[path]):<30} {format_spec(spec)}")
  return lines


def _front(plan) -> list[str]:
  """The time/memory front the search saw: each point faster than every
  point of lower peak."""
  points = plan.stats.get("front") or []
  if len(points) < 2:
    return []
  fastest = points[0][0]
  lines = ["", "time/memory front of the plans searched (faster, or less memory):",
           f"  {'step time':>12} {'peak memory':>12}"]
  for t, peak in points:
    mark = "  <- the plan" if abs(t - plan.cost.step_time) <= 1e-12 + 1e-9 * t and abs(
        peak - plan.cost.peak_memory) <= 1 else ""
    lines.append(f"  {_ms(t):>12} {format_bytes(peak):>12}  {t / fastest:.3f}x{mark}")
  chosen = plan.stats.get("least_memory")
  if chosen:
    lines.append(f"  (the least peak within the time tolerance of the fastest, "
                 f"{_ms(chosen['step_time'])})")
  return lines


def _layers(plan) -> list[str]:
  if not plan.layers:
    return []
  lines = ["", "per layer (per device; memory is the peak's make-up):",
           f"  {'layer':<24} {'compute':>12} {'comm':>12} {'resident':>12} "
           f"{'temporaries':>12}"]
  for r in plan.layers:
    lines.append(f"  {r.name:<24} {_ms(r.compute):>12} {_ms(r.comm):>12} "
                 f"{format_bytes(r.resident):>12} {format_bytes(r.temporary):>12}")
  return lines


def explain(plan) -> str:
  lines = _summary(plan) + _yardsticks(plan) + _front(plan) + _layers(plan)
  lines += ["", "arguments (grouped by layer):"]
  groups: dict[str, list[str]] = defaultdict(list)
  for path, shape, spec in zip(plan.in_paths, plan.in_shapes, plan.in_specs):
    parts = path.split("/")
    group = "/".join(parts[:2]) if len(parts) > 2 else parts[0]
    groups[group].append(f"    {path:<48} {str(tuple(shape)):<18} {format_spec(spec)}")
  for group, rows in groups.items():
    lines.append(f"  {group}")
    lines.extend(rows)
  lines += ["", "collectives per device (by layer):"]
  per_layer: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0])
  for scope, kind, axes, nbytes, count in plan.collectives:
    acc = per_layer[(layer_of(scope), kind, axes)]
    acc[0] += nbytes
    acc[1] += count
  if not per_layer:
    lines.append("  none")
  for (layer, kind, axes), (nbytes, count) in sorted(per_layer.items()):
    lines.append(f"  {layer:<24} {kind:<15} over {','.join(axes):<12} "
                 f"x{count:<4} {format_bytes(nbytes)}")
  stats = dict(plan.stats)
  actions = stats.pop("actions", None)
  stats.pop("front", None)
  if stats:
    lines += ["", "search: " + ", ".join(f"{k}={v}" for k, v in stats.items())]
  if actions:
    lines += ["actions taken:"] + [f"  {i + 1}. {a}" for i, a in enumerate(actions)]
  return "\n".join(lines)


def plot(plan, path) -> None:
  """Writes a PNG of per-layer time (compute, communication) and memory
  (resident, temporaries at the peak) per device."""
  try:
    import matplotlib
  except ImportError:
    raise ImportError(
        "Plan.plot needs matplotlib: pip install matplotlib (or automap[bench]).") from None
  matplotlib.use("Agg")  # files only: no display needed
  from matplotlib import pyplot as plt

  if not plan.layers:
    raise ValueError("this plan has no per-layer breakdown; search it again to plot it.")
  names = [r.name for r in plan.layers]
  x = range(len(names))
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6.0, 0.45 * len(names) + 2), 6),
                                    sharex=True)
  compute = [r.compute * 1e3 for r in plan.layers]
  comm = [r.comm * 1e3 for r in plan.layers]
  top.bar(x, compute, label="compute")
  top.bar(x, comm, bottom=compute, label="communication")
  top.set_ylabel("ms per step")
  top.legend()
  resident = [r.resident / 2**20 for r in plan.layers]
  temporary = [r.temporary / 2**20 for r in plan.layers]
  bottom.bar(x, resident, label="resident (params, optimizer state)")
  bottom.bar(x, temporary, bottom=resident, label="temporaries at the peak")
  bottom.set_ylabel("MiB per device")
  bottom.legend()
  bottom.set_xticks(list(x), names, rotation=60, ha="right", fontsize=8)
  mesh = " x ".join(f"{n}={s}" for n, s in zip(plan.mesh.axis_names, plan.mesh.axis_sizes))
  top.set_title(f"automap plan on {mesh} ({plan.hardware.name}): "
                f"{plan.cost.step_time * 1e3:.3f} ms per step")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
