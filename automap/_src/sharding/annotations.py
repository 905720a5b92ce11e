"""Your layout: the argument layouts a program's author already wrote down.

Per argument leaf, the first of these that states one:
- `layout=` given to the planner: a pytree prefix of the arguments with
  PartitionSpec / NamedSharding / None leaves (as `jax.jit`'s
  `in_shardings`), a mapping of argument-path pattern (fnmatch, as
  `Hints.fixed`) -> spec, or a keras `LayoutMap` (regex keys, looked up by
  the leaf's name and each suffix of it, so `2/0/mu/mlp/up/kernel` finds the
  entry of `mlp/up/kernel`, as keras lays out a variable's optimizer slots);
- flax metadata around the leaf: linen `Partitioned` / `LogicallyPartitioned`
  names (`nn.with_partitioning`, `nn.with_logical_partitioning`), nnx
  Variable metadata (`nnx.with_partitioning`: `out_sharding`, or
  `sharding_names` / `sharding` in older flax);
- the leaf's own placement: a `jax.Array` or `jax.ShapeDtypeStruct` with a
  `NamedSharding` over a mesh of the planned mesh's axis names and sizes
  (what `jax.device_put`, a jitted init's `out_shardings` or flax's eager
  sharding left it with).

Names that are not mesh axes are logical and resolve through `rules`
((logical, mesh axes) pairs: given, else flax's `nn.logical_axis_rules`
active now, else a box's own), with flax's own `logical_to_mesh_axes`, so
the layout is the one the user's library would run.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from automap._src.ir.trace import path_str
from automap._src.sharding.mesh import MeshError, MeshSpec


class LayoutError(MeshError):
  """A layout the arguments state that does not fit the mesh planned on."""


class LayoutWarning(UserWarning):
  """The arguments' own layout could not be read; it is not priced."""


@dataclasses.dataclass(frozen=True)
class Layout:
  """The layout the arguments state, per flat argument (None: none stated).

  source: where it was read ("layout=" or "annotations").
  """

  specs: tuple[PartitionSpec | None, ...]
  source: str

  @property
  def stated(self) -> bool:
    return any(s is not None for s in self.specs)

  def digest(self) -> str:
    """What a cached plan's "your layout" depends on."""
    return hashlib.sha256(repr((self.source, self.specs)).encode()).hexdigest()[:16]


def _is_box(x) -> bool:
  from flax import nnx
  from flax.core import meta

  return isinstance(x, (meta.AxisMetadata, nnx.Variable))


def _box_names(box):
  """(names, own rules) a flax box states for its value, or (None, None)."""
  from flax import nnx

  if isinstance(box, nnx.Variable):
    metadata = box.get_metadata()
    for key in ("out_sharding", "sharding_names", "sharding"):
      names = metadata.get(key)
      if names is not None:
        return tuple(names), None
    return None, None
  names = getattr(box, "names", None)
  return (None, None) if names is None else (tuple(names), getattr(box, "rules", None))


def _placed(leaf, mesh: MeshSpec) -> PartitionSpec | None:
  """The spec of a leaf placed with a NamedSharding on a mesh like `mesh`."""
  sharding = getattr(leaf, "sharding", None)
  if not isinstance(sharding, NamedSharding):
    return None
  theirs = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_sizes))
  ours = dict(zip(mesh.axis_names, mesh.axis_sizes))
  if any(ours.get(n) != s for n, s in theirs.items() if s > 1):
    return None  # Placed for another mesh: no layout on this one.
  return sharding.spec


def _axes_of(value, where: str) -> tuple:
  """A spec-like value's per-dim entries."""
  if isinstance(value, NamedSharding):
    return tuple(value.spec)
  if isinstance(value, PartitionSpec):
    return tuple(value)
  axes = getattr(value, "axes", None)  # keras TensorLayout
  if axes is not None:
    return tuple(axes)
  if isinstance(value, (tuple, list)):
    return tuple(value)
  raise LayoutError(
      f"layout= gives {where} the value {value!r}; expected a PartitionSpec, a "
      "NamedSharding, a tuple of mesh or logical axis names, or a keras TensorLayout.")


def _resolve(names: Sequence, mesh: MeshSpec, rules, where: str) -> PartitionSpec:
  """`names` (mesh axes, logical names or None per dim) as a spec on `mesh`,
  without trailing whole dims (`P(None,)` is `P()`)."""
  names = tuple(names)
  while names and names[-1] is None:
    names = names[:-1]
  axes = set(mesh.axis_names)
  flat = [n for e in names if e is not None
          for n in (e if isinstance(e, tuple) else (e,))]
  if all(n in axes for n in flat):
    return PartitionSpec(*names)
  if not rules:
    unknown = next(n for n in flat if n not in axes)
    raise LayoutError(
        f"{where} is laid out as {tuple(names)}, naming {unknown!r}, which is no "
        f"axis of the mesh planned on {mesh.axis_names}: a logical axis name. Give "
        "the rules that map logical names to mesh axes (layout_rules=[(logical, "
        "mesh axes), ...], or plan under flax's nn.logical_axis_rules).")
  import flax.linen as nn

  spec = nn.logical_to_mesh_axes(names, rules)
  bad = [n for e in spec if e is not None for n in (e if isinstance(e, tuple) else (e,))
         if n not in axes]
  if bad:
    raise LayoutError(
        f"{where} is laid out as {tuple(names)}; the rules map it to {spec}, naming "
        f"{bad[0]!r}, which is no axis of the mesh planned on {mesh.axis_names}.")
  return _resolve(tuple(spec), mesh, (), where)


def _active_rules():
  import flax.linen as nn

  return tuple(nn.get_logical_axis_rules())


def read(args, paths: Sequence[str], mesh: MeshSpec, layout=None,
         rules=None) -> Layout:
  """The layout `args` (the dynamic argument tree, whose flat leaves
  `paths` name) state on `mesh`: from `layout` if given, else from their
  annotations. A LayoutError names a leaf whose layout cannot be read."""
  rules = tuple(rules) if rules is not None else _active_rules()
  if layout is not None:
    return Layout(_given(args, paths, mesh, layout, rules), "layout=")
  with_paths = jax.tree_util.tree_flatten_with_path(args, is_leaf=_is_box)[0]
  specs: list[PartitionSpec | None] = []
  for path, node in with_paths:
    if not _is_box(node):
      spec = _placed(node, mesh)
      specs.append(None if spec is None else _resolve(tuple(spec), mesh, rules, _at(path)))
      continue
    names, own_rules = _box_names(node)
    for leaf in jax.tree.leaves(node):  # A box's value: usually one array.
      if names is None or len(names) != len(getattr(leaf, "shape", ())):
        spec = _placed(leaf, mesh)
        specs.append(None if spec is None else _resolve(tuple(spec), mesh, rules, _at(path)))
      else:
        specs.append(_resolve(names, mesh, rules or own_rules, _at(path)))
  if len(specs) != len(paths):  # pragma: no cover - the two flattenings agree
    raise AssertionError(f"{len(specs)} layouts for {len(paths)} arguments")
  return Layout(tuple(specs), "annotations")


def _at(path) -> str:
  return f"argument {path_str(path) or '<root>'!r}"


def _given(args, paths: Sequence[str], mesh: MeshSpec, layout, rules) -> tuple:
  if hasattr(layout, "_layout_map") or type(layout).__name__ == "LayoutMap":
    return tuple(_keras_lookup(layout, p, mesh, rules) for p in paths)
  if isinstance(layout, Mapping):
    out = []
    for p in paths:
      hits = [k for k in layout if fnmatch.fnmatchcase(p, k)]
      if len(hits) > 1:
        raise LayoutError(
            f"layout= patterns {hits} all match argument {p!r}; make them disjoint.")
      out.append(None if not hits else _resolve(
          _axes_of(layout[hits[0]], f"argument {p!r}"), mesh, rules, f"argument {p!r}"))
    return tuple(out)
  is_spec = lambda x: x is None or isinstance(x, (PartitionSpec, NamedSharding))  # noqa: E731
  try:
    flat = jax.tree_util.tree_map(lambda s, sub: [s] * len(jax.tree.leaves(sub)),
                                  layout, args, is_leaf=is_spec)
  except ValueError as e:
    raise LayoutError(
        f"layout= must be a pytree prefix of the arguments with a PartitionSpec, "
        f"NamedSharding or None per leaf or subtree (as jax.jit's in_shardings), a "
        f"mapping of argument-path pattern -> spec, or a keras LayoutMap: {e}") from None
  per_leaf = [s for group in jax.tree.leaves(flat, is_leaf=lambda x: isinstance(x, list))
              for s in group]
  return tuple(None if s is None else _resolve(_axes_of(s, f"argument {p!r}"), mesh, rules,
                                               f"argument {p!r}")
               for s, p in zip(per_leaf, paths))


def _keras_lookup(layout_map, path: str, mesh: MeshSpec, rules) -> PartitionSpec | None:
  parts = path.split("/")
  for i in range(len(parts)):
    try:
      found = layout_map[("/".join(parts[i:]))]
    except ValueError as e:  # keras: several keys match
      raise LayoutError(f"layout= (a keras LayoutMap) for argument {path!r}: {e}") from None
    if found is not None:
      return _resolve(_axes_of(found, f"argument {path!r}"), mesh, rules,
                      f"argument {path!r}")
  return None
