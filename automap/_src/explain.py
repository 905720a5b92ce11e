"""Explain: a plan as text a JAX engineer reads in a minute."""

from __future__ import annotations

import re
from collections import defaultdict

from jax.sharding import PartitionSpec

_TRANSFORMS = re.compile(r"^(?:[a-z_]+\(|\))+|\)+")


def layer_of(scope: str, depth: int = 1) -> str:
  """`transpose(jvp(GPT))/block_1/mlp/wi` -> `block_1` (depth 1)."""
  parts = [p for p in (_TRANSFORMS.sub("", s) for s in scope.split("/")) if p]
  # Drop a leading model-class name (GPT, Model...) that every op shares.
  if len(parts) > 1 and parts[0][:1].isupper():
    parts = parts[1:]
  return "/".join(parts[:depth]) or "(top level)"


def _fmt_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:,.1f} {unit}" if unit != "B" else f"{n:,.0f} B"
    n /= 1024
  raise AssertionError("unreachable")


def format_spec(spec: PartitionSpec) -> str:
  return "P(" + ", ".join("None" if e is None else repr(e) for e in spec) + ")"


def explain(plan) -> str:
  mesh = ", ".join(f"{n}={s}" for n, s in zip(plan.mesh.axis_names,
                                              plan.mesh.axis_sizes))
  c = plan.cost
  lines = [
      f"automap plan for mesh ({mesh}) on {plan.hardware.name}",
      f"  step time {c.step_time * 1e3:.3f} ms = compute "
      f"{c.compute_time * 1e3:.3f} ms + communication {c.comm_time * 1e3:.3f} ms",
      f"  peak memory {_fmt_bytes(c.peak_memory)} per device "
      f"(arguments {_fmt_bytes(c.argument_memory)}), "
      f"{c.flops / 1e9:.3f} GFLOP per device",
      "", "arguments (grouped by layer):"]
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
                 f"x{count:<4} {_fmt_bytes(nbytes)}")
  stats = dict(plan.stats)
  actions = stats.pop("actions", None)
  if stats:
    lines += ["", "search: " + ", ".join(f"{k}={v}" for k, v in stats.items())]
  if actions:
    lines += ["actions taken:"] + [f"  {i + 1}. {a}" for i, a in enumerate(actions)]
  return "\n".join(lines)
