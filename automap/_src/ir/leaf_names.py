"""Argument names as their library calls them.

A leaf's default name is its path in the argument pytree
(`params/block_0/mlp/wi/kernel`), which is already the library's own name for
flax, haiku, equinox and HuggingFace parameters. Some libraries keep state in
lists (keras: `stateless_call(trainable, non_trainable, ...)`), where a path
is `0/2/8`; `names=` says what those leaves are called
(`[v.path for v in model.trainable_variables]`).

`names` is a pytree prefix of the arguments whose leaves are strings or None:
a string replaces the key it stands at (`names=("params", "batch")` calls
the arguments so; `names=([...], None)` names the leaves of a list, under
`0/`), a subtree keeping its inner paths below it; None keeps the default.
A container named leaf by leaf also names every other subtree of the same
structure and shapes (an optimizer's moments of those parameters:
`1/0/mu/3` becomes `1/0/mu/dense/kernel`), in the arguments and in the
results; a result at an argument's default path with its shape and dtype
takes that argument's name, so the state a step carries still pairs up.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Sequence

import jax

from automap._src.ir.errors import ArgumentError


def _path_str(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/")


def _is_name(x) -> bool:
  return x is None or isinstance(x, str)


def _under(path: str, prefix: str) -> bool:
  return not prefix or path == prefix or path.startswith(prefix + "/")


def _renamed(path: str, parent: str, prefix: str, name: str) -> str:
  """`path` (under `prefix`, whose last key is below `parent`) with that
  key replaced by `name`."""
  rest = path[len(prefix):].lstrip("/") if prefix else path
  return _join(_join(parent, name), rest)


def _join(prefix: str, rest: str) -> str:
  return f"{prefix}/{rest}" if prefix and rest else prefix or rest


def _signature(tree):
  """Structure and leaf shapes of a subtree, which mirrors must share."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple(tuple(getattr(x, "shape", ())) for x in leaves)


def _named_containers(names, args) -> list[tuple[str, object, list[str]]]:
  """(prefix, args subtree, leaf names) of each maximal container of
  `names` whose every leaf is a string: the subtrees named leaf by leaf."""
  out = []

  def visit(path, n, sub):
    if _is_name(n):
      return
    leaves = jax.tree.leaves(n, is_leaf=_is_name)
    if leaves and all(isinstance(x, str) for x in leaves):
      out.append((_path_str(path), sub, leaves))
      return
    children = jax.tree_util.tree_flatten_with_path(n, is_leaf=lambda x: x is not n)[0]
    for key, child in children:
      visit(path + key, child, _child(sub, key))

  visit((), names, args)
  return out


def _child(tree, key):
  for k, sub in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)[0]:
    if k == key:
      return sub
  raise KeyError(key)


def _mirrors(tree, paths: Sequence[str], containers, taken: set[int]) -> dict[int, str]:
  """Leaf index -> name for subtrees of `tree` with a named container's
  structure and shapes, outside the leaves already `taken`."""
  out: dict[int, str] = {}
  index = {p: i for i, p in enumerate(paths)}
  for _, sub, leaf_names in containers:
    want = _signature(sub)

    def match(x, want=want):
      try:
        return _signature(x) == want
      except TypeError:
        return False

    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=match)[0]:
      if not match(node):
        continue
      prefix = _path_str(path)
      inner = [_path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(node)[0]]
      ids = [index.get(_join(prefix, q)) for q in inner]
      if any(i is None or i in taken or i in out for i in ids):
        continue
      for i, name in zip(ids, leaf_names):
        out[i] = _join(prefix, name)
  return out


_MISSING = object()


def _stored(x, name: str):
  """`x.name` where it is stored on the object (its `__dict__`, a slot or a
  plain class attribute), else `_MISSING`. Never runs the user's code: a
  property or `__getattr__` may raise (an unbound penzai `ParameterSlot`'s
  `.value` does) or compute."""
  try:
    found = inspect.getattr_static(x, name, _MISSING)
    if isinstance(found, types.MemberDescriptorType):  # a slot
      return found.__get__(x, type(x))
  except Exception:  # noqa: BLE001 (an unfilled slot, or a metaclass's own lookup)
    return _MISSING
  return _MISSING if hasattr(type(found), "__get__") else found


def _labelled(x) -> bool:
  """A pytree node its library names itself: penzai's parameter and state
  values carry their `label` beside their `value` (a variable's slot,
  standing in for one, has no value and is not named)."""
  return isinstance(_stored(x, "label"), str) and _stored(x, "value") is not _MISSING


def library_names(args):
  """`names=` as the arguments' own libraries name their leaves (penzai's
  labels, which its pytree paths leave out: `0/7/value/data_array` is
  `transformer/block_0/attention/query.weights`), or None where none do."""
  if not any(_labelled(x) for x in jax.tree.leaves(args, is_leaf=_labelled)):
    return None
  return jax.tree.map(lambda x: x.label if _labelled(x) else None, args, is_leaf=_labelled)


def apply(names, args, in_paths: tuple[str, ...], in_avals, outs, out_paths: tuple[str, ...],
          out_avals) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(argument paths, result paths) with `names` applied. `args` and `outs`
  are the dynamic trees whose flat leaves `in_paths` / `out_paths` name;
  None names leaves as their libraries do (`library_names`)."""
  if names is None:
    names = library_names(args)
  if names is None:
    return in_paths, out_paths
  entries: list[tuple[str, str, str]] = []

  def record(path, n, _):
    if n is not None:
      entries.append((_path_str(path[:-1]), _path_str(path), n))

  try:
    jax.tree_util.tree_map_with_path(record, names, args, is_leaf=_is_name)
  except ValueError as e:
    raise ArgumentError(
        f"names= must be a pytree prefix of the arguments (a string or None "
        f"per leaf or subtree), but its structure does not match them: "
        f"{str(e).replace('tree_map_with_path tree', 'names')}") from None
  bad = [n for n in jax.tree.leaves(names, is_leaf=_is_name)
         if n is not None and (not isinstance(n, str) or not n or n.startswith("/"))]
  if bad:
    raise ArgumentError(f"names= holds {bad[0]!r}; each name must be a non-empty string.")
  new = list(in_paths)
  taken: set[int] = set()
  for parent, prefix, name in entries:
    for i, p in enumerate(in_paths):
      if _under(p, prefix):
        new[i] = _renamed(p, parent, prefix, name)
        taken.add(i)
  containers = _named_containers(names, args)
  for i, name in _mirrors(args, in_paths, containers, taken).items():
    new[i] = name
  _check_unique(new, in_paths, "argument")
  # Results: an argument's default path (same shape and dtype) takes its
  # name, so carried state pairs up; other results mirror the named containers.
  by_default = {(p, tuple(a.shape), str(a.dtype)): n
                for p, a, n in zip(in_paths, in_avals, new) if p != n}
  outs_new = list(out_paths)
  done = set()
  for i, (p, a) in enumerate(zip(out_paths, out_avals)):
    n = by_default.get((p, tuple(a.shape), str(a.dtype)))
    if n is not None:
      outs_new[i] = n
      done.add(i)
  for i, name in _mirrors(outs, out_paths, containers, done).items():
    outs_new[i] = name
  _check_unique(outs_new, out_paths, "result")
  return tuple(new), tuple(outs_new)


def _check_unique(paths: list[str], defaults: Sequence[str], what: str) -> None:
  seen: dict[str, str] = {}
  for p, d in zip(paths, defaults):
    if p in seen:
      raise ArgumentError(
          f"names= gives two {what} leaves the name {p!r} ({seen[p]!r} and {d!r}); "
          "each leaf needs a name of its own.")
    seen[p] = d
