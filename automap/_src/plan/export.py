"""Export: a plan in the forms other JAX code consumes.

A plan names its arguments by pytree path (`0/params/block_0/mlp/wi/kernel`).
Export matches a user's own pytree (params, an optimizer state, a train
state's field) against those paths and returns PartitionSpecs shaped like
it, places arrays on the plan, or restates the plan as flax/MaxText-style
logical-axis rules where the plan is expressible that way. Every `plan`
argument is an `automap.Plan` (plan/plan.py, whose methods call these).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from automap._src.ir.trace import is_array, path_str
from automap._src.plan.errors import PlanError

# One mesh-axis assignment of an array dimension: None, an axis name, or a
# tuple of axis names (as in a PartitionSpec entry).
Axes = None | str | tuple[str, ...]


def _paths(tree, is_leaf=None) -> tuple[list[str], list[Any], Any]:
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
  return [path_str(p) for p, _ in with_paths], [x for _, x in with_paths], treedef


def _join(prefix: str, path: str) -> str:
  return f"{prefix}/{path}" if path else prefix


def _prefixes(plan_paths: tuple[str, ...], paths: list[str]) -> list[str]:
  """Prefixes P of the plan's argument paths with P/p a plan path for every p."""
  have = set(plan_paths)
  first = paths[0]
  found = []
  for full in plan_paths:
    if first and not full.endswith("/" + first) and full != first:
      continue
    prefix = full[:len(full) - len(first)].rstrip("/") if first else full
    if prefix and all(_join(prefix, p) in have for p in paths):
      found.append(prefix)
  return list(dict.fromkeys(found))


def _resolve(plan, paths: list[str], at: int | str | None, what: str) -> list[int]:
  """Index into the plan's arguments of each of `paths`, under prefix `at`:
  matched against the plan's names, else (a tree as the function took it,
  where `names=` renamed its leaves) against their pytree paths."""
  if not paths:
    raise PlanError(f"{what} has no leaves to match against the plan.")
  if plan.tree_paths:
    try:
      return _resolve_in(plan.tree_paths, plan, paths, at, what)
    except PlanError:
      pass
  return _resolve_in(plan.in_paths, plan, paths, at, what)


def _resolve_in(plan_paths: tuple[str, ...], plan, paths: list[str],
                at: int | str | None, what: str) -> list[int]:
  if isinstance(at, int) and not isinstance(at, bool):
    prefix = str(at)
  elif isinstance(at, str) and at:
    prefix = at.strip("/")
  elif at is None:
    found = _prefixes(plan_paths, paths)
    # A whole argument (a bare index) beats a sub-tree that happens to share
    # its structure, as an optimizer's moments share the params'.
    whole = [p for p in found if p.isdigit()]
    found = whole or found
    if len(found) != 1:
      where = ("no argument of the plan has them" if not found
               else f"it matches {found}")
      raise PlanError(
          f"cannot tell which argument of the plan {what} is: {where}. Pass "
          f"at= an argument index (0 for the first) or a path prefix such as "
          f"{(found or [plan.in_paths[0].split('/')[0]])[0]!r}.")
    prefix = found[0]
  else:
    raise TypeError(f"at must be an argument index, a path prefix or None, got {at!r}.")
  index = {p: i for i, p in enumerate(plan_paths)}
  missing = [p for p in paths if _join(prefix, p) not in index]
  if missing:
    near = [p for p in plan_paths if p.startswith(prefix + "/") or p == prefix][:3]
    raise PlanError(
        f"{what} does not match the plan's argument {prefix!r}: no leaf "
        f"{_join(prefix, missing[0])!r} ({len(missing)} of {len(paths)} leaves "
        f"unmatched; the plan has e.g. {near}). Pass the same pytree the planned "
        "function took, or at= the right argument.")
  return [index[_join(prefix, p)] for p in paths]


def specs(plan, tree, at: int | str | None = None):
  """PartitionSpecs for `tree`'s leaves, in `tree`'s structure.

  `tree` is one argument of the planned function, or a sub-tree of one (a
  train state's params): its leaves are matched by path under `at`, an
  argument index or path prefix (default: the one argument that holds every
  leaf). Leaves may be arrays or `jax.ShapeDtypeStruct`s; shapes are checked.
  """
  # Static leaves (an equinox model's functions) and Python numbers (scalars,
  # traced or static) have no layout: None.
  paths, leaves, treedef = _paths(_arrays_of(tree))
  idx = _resolve(plan, paths, at, "the tree")
  for p, leaf, i in zip(paths, leaves, idx):
    shape = getattr(leaf, "shape", None)
    if shape is not None and tuple(shape) != tuple(plan.in_shapes[i]):
      raise PlanError(
          f"leaf {p!r} has shape {tuple(shape)}, the plan's {plan.in_paths[i]!r} "
          f"has {tuple(plan.in_shapes[i])}; the plan is for another model size.")
  return jax.tree.unflatten(treedef, [plan.in_specs[i] for i in idx])


def shard_like(tree: Any, plan: Any, mesh: Mesh | None = None,
               at: int | str | None = None) -> Any:
  """`tree` placed on the plan's shardings, as `jax.device_put` does.

  Args:
    tree: one argument of the planned function, or a sub-tree of one (a
      train state's params), its leaves matched by path under `at`.
    plan: the `automap.Plan` whose argument shardings to take.
    mesh: the mesh to place on (default: one of the plan's axis names and
      sizes over the local devices).
    at: an argument index or path prefix (default: the one argument that
      holds every leaf).

  Returns:
    `tree` with each array placed on its sharding; non-array leaves as they
    were.

  Raises:
    automap.PlanError: `mesh` has other axes or sizes than the plan's, or
      `tree` does not match the plan's arguments.
  """
  if mesh is None:
    mesh = jax.make_mesh(plan.mesh.axis_sizes, plan.mesh.axis_names)
  elif tuple(mesh.axis_names) != plan.mesh.axis_names or tuple(
      mesh.devices.shape) != plan.mesh.axis_sizes:
    raise PlanError(
        f"mesh has axes {dict(zip(mesh.axis_names, mesh.devices.shape))}, the plan "
        f"is for {dict(zip(plan.mesh.axis_names, plan.mesh.axis_sizes))}.")
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs(plan, tree, at),
                           is_leaf=lambda x: isinstance(x, PartitionSpec))
  placed = iter(jax.tree.leaves(jax.device_put(_arrays_of(tree), shardings)))
  return jax.tree.map(lambda x: next(placed) if is_array(x, numbers=False) else x, tree)


def _arrays_of(tree):
  """`tree` with None in place of its leaves that are not arrays."""
  return jax.tree.map(lambda x: x if is_array(x, numbers=False) else None, tree)


@dataclasses.dataclass(frozen=True)
class LogicalRules:
  """A plan as logical-axis rules.

  Attributes:
    rules: (logical name, mesh axes) pairs in precedence order, for
      `flax.linen.logical_axis_rules` / `logical_to_mesh_axes` or MaxText's
      `logical_axis_rules`.
    mismatches: leaf path -> (the plan's spec, the spec the rules give) where
      the rules cannot reproduce the plan: empty when the plan is expressible.
  """

  rules: tuple[tuple[str, Axes], ...]
  mismatches: dict[str, tuple[PartitionSpec, PartitionSpec]]

  @property
  def exact(self) -> bool:
    return not self.mismatches


def _names_of(leaf) -> tuple[str | None, ...]:
  if isinstance(leaf, PartitionSpec):
    leaf = tuple(leaf)
  if not isinstance(leaf, tuple) or not all(n is None or isinstance(n, str) for n in leaf):
    raise TypeError(
        f"logical names must be PartitionSpecs or tuples of names (str or None), one "
        f"per array dimension, got {leaf!r}.")
  return leaf


def _entry(spec: PartitionSpec, dim: int) -> Axes:
  e = tuple(spec)[dim] if dim < len(spec) else None
  if isinstance(e, tuple) and len(e) == 1:
    return e[0]
  return e


def _canonical(spec: PartitionSpec, rank: int) -> tuple[Axes, ...]:
  return tuple(_entry(spec, d) for d in range(rank))


def logical_rules(plan, names, at: int | str | None = None) -> LogicalRules:
  """The plan restated as logical-axis rules.

  `names` gives each parameter's logical dimension names: a pytree of
  PartitionSpecs or tuples, as `flax.linen.get_partition_spec` returns for
  parameters made with `nn.with_logical_partitioning`, or those boxed
  parameters themselves. Each name's most common layout (by bytes) comes
  first, the others as fallbacks flax takes when the first one's mesh axes
  are taken; the rules are checked against every leaf and the leaves they
  cannot reproduce are reported in `mismatches`.
  """
  from flax import linen as nn  # flax only when asked for

  if any(isinstance(x, nn.meta.AxisMetadata) for x in jax.tree.leaves(
      names, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))):
    names = nn.get_partition_spec(names)
  def is_leaf(x) -> bool:
    return isinstance(x, PartitionSpec) or (
        isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x))

  paths, leaves, _ = _paths(names, is_leaf=is_leaf)
  idx = _resolve(plan, paths, at, "names")
  rows = []
  for p, leaf, i in zip(paths, leaves, idx):
    rank = len(plan.in_shapes[i])
    dims = _names_of(leaf)
    if dims and len(dims) != rank:
      raise PlanError(
          f"names for {p!r} give {len(dims)} dimensions, the array has {rank}.")
    dims = dims or (None,) * rank
    size = 1
    for n in plan.in_shapes[i]:
      size *= n
    rows.append((p, dims, _canonical(plan.in_specs[i], rank), size))
  weight: dict[tuple[str, Axes], int] = defaultdict(int)
  for _, dims, axes, size in rows:
    for name, a in zip(dims, axes):
      if name is not None:
        weight[(name, a)] += size
  # Heaviest first; a name only ever unsharded needs no rule.
  sharded = {name for (name, a) in weight if a is not None}
  rules = sorted((k for k in weight if k[0] in sharded),
                 key=lambda k: (-weight[k], k[0], str(k[1])))

  def missed(rules) -> tuple[int, dict]:
    out, lost = {}, 0
    for p, dims, axes, size in rows:
      got = nn.logical_to_mesh_axes(dims, rules)
      if _canonical(got, len(dims)) != axes:
        out[p] = (PartitionSpec(*axes), got)
        lost += size
    return lost, out

  # Where a name has several layouts, flax takes the first whose mesh axes
  # are free: try each order of that name's rules in its slots.
  best = missed(rules)
  for name in dict.fromkeys(n for n, _ in rules):
    slots = [i for i, (n, _) in enumerate(rules) if n == name]
    if len(slots) < 2 or not best[0]:
      continue
    for order in itertools.islice(itertools.permutations([rules[i] for i in slots]), 1, 120):
      trial = list(rules)
      for i, r in zip(slots, order):
        trial[i] = r
      got = missed(trial)
      if got[0] < best[0]:
        rules, best = trial, got
  return LogicalRules(tuple(rules), best[1])
