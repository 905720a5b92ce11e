"""Trace: from a function and example arguments to its jaxpr.

Arguments may be arrays, numpy arrays, Python scalars or
`jax.ShapeDtypeStruct`s, so a model too large for this machine can be planned
without materialising it. Every other leaf (a function, a string, a config
object: what an equinox model carries beside its arrays) is static, held
out of the trace as `eqx.filter_jit` holds it (`Static`); so is a Python
number the program needs concretely (a shape, a branch), as there. Results
may carry static leaves too; they come back as the trace made them.

Each flat argument keeps the path of its leaf in the argument pytree
(`params/block_0/mlp/wi/kernel`): flax nnx attribute names and raw pytrees
never reach the jaxpr's name stacks, their paths always exist.

Given the mesh planned on, the function is traced with that mesh in context
(an abstract mesh of Auto axes, the view the rewritten program runs on), as
`jax.jit` traces it under `jax.set_mesh`: `with_sharding_constraint` with a
bare PartitionSpec resolves against it, and flax's logical constraints,
which are no-ops without a mesh, resolve under the rules active then.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex
from jax.sharding import AbstractMesh, AxisType

from automap._src.ir import constraints as constraints_lib
from automap._src.ir import leaf_names as names_lib
from automap._src.ir.errors import ArgumentError

# Leaves traced as `jax.jit` traces them; every other leaf is static.
_ARRAYS = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)
_NUMBERS = (bool, int, float, complex)


@dataclasses.dataclass(frozen=True)
class Static:
  """The static leaves of a pytree: the whole tree's structure, and the
  index among its leaves and value of each leaf held out of the trace.

  The traced ("dynamic") tree is the same tree with None at those leaves,
  as `eqx.partition` makes it, so its leaves keep their paths.
  """

  tree: Any
  where: tuple[int, ...] = ()
  values: tuple = ()

  def key(self) -> tuple:
    """Hashable identity: equal for equal structures and static values."""
    return (str(self.tree), self.where, self.values)

  def merge(self, dynamic):
    """The whole tree from its dynamic part (a tree, or its flat leaves)."""
    if not self.where:
      return dynamic
    leaves = iter(dynamic if isinstance(dynamic, list) else jax.tree.leaves(dynamic))
    at = dict(zip(self.where, self.values))
    return self.tree.unflatten([at[i] if i in at else next(leaves)
                                for i in range(self.tree.num_leaves)])


def is_array(leaf, numbers: bool = True) -> bool:
  """Whether a leaf is traced (an array, or a Python number if `numbers`)."""
  return isinstance(leaf, _ARRAYS) or (numbers and isinstance(leaf, _NUMBERS))


def split(tree, what: str = "argument", numbers: bool = True):
  """(dynamic tree, `Static`) of `tree`: array leaves (and Python numbers,
  if `numbers`) stay; every other leaf is held static and must be hashable,
  since it identifies the program traced. Errors name the leaf's path."""
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
  where, values, kept = [], [], []
  for i, (path, leaf) in enumerate(with_paths):
    if is_array(leaf, numbers):
      kept.append(leaf)
      continue
    try:
      hash(leaf)
    except TypeError:
      raise ArgumentError(
          f"{what} leaf {path_str(path) or '<root>'!r} is a {type(leaf).__name__}, "
          "which is not an array, so automap holds it static as eqx.filter_jit "
          "does; static leaves identify the program traced and must be "
          "hashable. Make its type hashable (a frozen dataclass, a tuple), "
          "register it as a pytree of arrays, or close over it "
          "(functools.partial).") from None
    where.append(i)
    values.append(leaf)
    kept.append(None)
  static = Static(treedef, tuple(where), tuple(values))
  return (treedef.unflatten(kept) if where else tree), static


@dataclasses.dataclass(frozen=True)
class Traced:
  """A traced program.

  jaxpr: the closed jaxpr of `fn(*args)`.
  in_tree / out_tree: pytree structures of the arguments and outputs.
  in_paths: per flat argument, its path in the argument pytree.
  in_avals: per flat argument, its abstract value (shape, dtype).
  out_paths / out_avals: per flat output, its path and abstract value.
  tree_paths: per flat argument, its pytree path where `names=` renamed
    any (in_paths are then the names); empty otherwise.
  """

  fn: Callable
  jaxpr: jex.ClosedJaxpr
  in_tree: Any
  out_tree: Any
  in_paths: tuple[str, ...]
  in_avals: tuple[Any, ...]
  out_paths: tuple[str, ...]
  out_avals: tuple[Any, ...]
  # The static leaves of the arguments and results, held out of the trace:
  # in_tree / out_tree are the dynamic trees (None where a leaf is static).
  in_static: Static | None = None
  out_static: Static | None = None
  tree_paths: tuple[str, ...] = ()
  # (dynamic result leaf, dynamic argument leaf) pairs where a Python-number
  # argument is returned as it came: the call's own number goes back.
  passthrough: tuple[tuple[int, int], ...] = ()

  def dynamic_args(self, args: tuple) -> tuple:
    """The arguments the traced program takes: `args` without its static
    leaves (which must be those traced with)."""
    dynamic, static = split(args, numbers=self.numbers_traced)
    if self.in_static is not None and static.key() != self.in_static.key():
      raise ArgumentError(
          "the static (non-array) leaves of these arguments differ from those "
          "the program was traced with; trace it again for them.")
    return dynamic

  @property
  def numbers_traced(self) -> bool:
    """Whether Python-number arguments are traced (as jax.jit traces them),
    not static (because the program needs them concretely)."""
    return self.in_static is None or not any(
        isinstance(v, _NUMBERS) for v in self.in_static.values)

  def dynamic_fn(self) -> Callable:
    """`fn` as the traced program sees it: from the dynamic arguments to the
    dynamic results (for `jax.jit`, which takes no static leaves)."""
    if self.in_static is None and self.out_static is None:
      return self.fn
    merge = (lambda a: a) if self.in_static is None else self.in_static.merge
    return lambda *a: split(self.fn(*merge(a)), "result", numbers=False)[0]

  def results(self, outs, dynamic_args: tuple | None = None):
    """The program's results from the dynamic ones it computes, with the
    call's own Python numbers (`dynamic_args`) where it returns them as
    they came, as `eqx.filter_jit` does."""
    if self.passthrough and dynamic_args is not None:
      leaves, tree = jax.tree.flatten(outs)
      given = jax.tree.leaves(dynamic_args)
      for out, arg in self.passthrough:
        leaves[out] = given[arg]
      outs = tree.unflatten(leaves)
    return outs if self.out_static is None else self.out_static.merge(outs)

  def fingerprint(self) -> str:
    """Stable digest of the program: equations, shapes, dtypes, structure."""
    return self._digest

  def without_constraints(self) -> Traced:
    """The same program with its layout constraints removed."""
    return dataclasses.replace(self, jaxpr=constraints_lib.strip(self.jaxpr))

  @functools.cached_property
  def _digest(self) -> str:  # Printing a large jaxpr takes a tenth of a second.
    h = hashlib.sha256()
    h.update(str(self.in_tree).encode())
    if self.in_static is not None:  # The structure around static leaves.
      h.update(str(self.in_static.tree).encode())
    # Shardings name the mesh traced under; its devices are not the program's.
    h.update(_DEVICES.sub("", str(self.jaxpr.jaxpr)).encode())
    return h.hexdigest()[:16]


# How an abstract mesh prints the devices it stands for.
_DEVICES = re.compile(r", device_kind=[^,()]*, num_cores=[^,()]*(, platform=[^,()]*)?")


def signature_of(in_tree, avals, static: Static | None = None) -> tuple:
  """Hashable identity of an argument structure, shapes, dtypes and static
  leaves."""
  return ((str(in_tree), None if static is None else static.key())
          + tuple((tuple(a.shape), str(a.dtype), a.weak_type) for a in avals))


def path_str(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/")


def _aval_of(path, leaf):
  if isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
    return jax.core.ShapedArray(leaf.shape, leaf.dtype)
  if isinstance(leaf, (bool, int, float, complex)):
    # Python numbers are weakly typed under jit: x_bf16 * 2.0 stays bf16. Their
    # dtype by promotion alone: making an array would run on the mesh in
    # context, which a compile-only TPU mesh cannot.
    return jax.core.ShapedArray((), jax.numpy.result_type(leaf),
                                weak_type=not isinstance(leaf, bool))
  raise ArgumentError(
      f"argument leaf {path_str(path) or '<root>'!r} is a "
      f"{type(leaf).__name__}, expected a jax.Array, numpy array, Python "
      "number or jax.ShapeDtypeStruct (hold other leaves static: `split`).")


def flatten_args(args: tuple) -> tuple[list, Any, tuple[str, ...], tuple]:
  """Flat leaves, tree, leaf paths and avals of the array leaves of `args`
  (a dynamic tree: `split` holds other leaves out); errors name a bad leaf's
  path."""
  with_paths, tree = jax.tree_util.tree_flatten_with_path(args)
  leaves = [leaf for _, leaf in with_paths]
  avals = tuple(_aval_of(p, leaf) for p, leaf in with_paths)
  paths = tuple(path_str(p) for p, _ in with_paths)
  return leaves, tree, paths, avals


def _auto_view(mesh) -> AbstractMesh:
  """`mesh` (a Mesh, AbstractMesh or anything with axis names and sizes) as
  an abstract mesh of Auto axes, on the same devices where it names them
  (a program's `shard_map` over that mesh must find it in context)."""
  names = tuple(mesh.axis_names)
  auto = {n: AxisType.Auto for n in names}
  if isinstance(mesh, (jax.sharding.Mesh, AbstractMesh)):
    return mesh.abstract_mesh.update_axis_types(auto)
  return AbstractMesh(tuple(mesh.axis_sizes), names, axis_types=(AxisType.Auto,) * len(names))


# What JAX raises where a program needs a traced value concretely.
_CONCRETE = (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError,
             jax.errors.TracerBoolConversionError)


def trace(fn: Callable, args: tuple, mesh=None, numbers: bool | None = None,
          names=None) -> Traced:
  """Traces `fn(*args)`, under `mesh` (a Mesh, an AbstractMesh or a
  `MeshSpec`) if given. Static leaves are held out (`split`). Python
  numbers are traced (`numbers=True`) or static (False); by default traced
  as `jax.jit` traces them unless the program needs one concretely, then
  held static as `eqx.filter_jit` holds them. Errors raised by `fn` itself
  surface unchanged, but for explicit-axis sharding, which the Auto view
  cannot trace. `names` renames argument leaves (`names.apply`)."""
  if numbers is not None:
    return _trace(fn, args, mesh, numbers, names)
  try:
    return _trace(fn, args, mesh, True, names)
  except (*_CONCRETE, TypeError) as e:
    # A traced shape is a TypeError ("concrete values of integer type").
    if (not isinstance(e, _CONCRETE) and "concrete" not in str(e)) or not any(
        isinstance(leaf, _NUMBERS) for leaf in jax.tree.leaves(args)):
      raise
  return _trace(fn, args, mesh, False, names)


def _trace(fn: Callable, args: tuple, mesh, numbers: bool, names) -> Traced:
  dynamic, in_static = split(args, numbers=numbers)
  _, in_tree, paths, avals = flatten_args(dynamic)
  specs = jax.tree.unflatten(in_tree, [
      jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals])
  out_static, passthrough = [], []
  numbers_at = [i for i, leaf in enumerate(jax.tree.leaves(dynamic))
                if isinstance(leaf, _NUMBERS)]

  def body(*traced):  # A fresh callable: see below.
    # A Python number a result holds is a constant of the trace: static.
    dynamic_out, static = split(fn(*in_static.merge(traced)), "result", numbers=False)
    out_static.append(static)
    flat = jax.tree.leaves(traced)
    numbers = {id(flat[i]): i for i in numbers_at}
    passthrough.extend((j, numbers[id(leaf)])
                       for j, leaf in enumerate(jax.tree.leaves(dynamic_out))
                       if id(leaf) in numbers)
    return dynamic_out

  context = contextlib.nullcontext()
  if mesh is not None:
    context = jax.sharding.use_abstract_mesh(_auto_view(mesh))
  try:
    with context:
      # JAX's trace cache does not key on context outside JAX's own (flax's
      # logical axis rules), so a cached trace of the same callable may be stale.
      closed, out_shape = jax.make_jaxpr(body, return_shape=True)(*specs)
  except ValueError as e:
    if "reshard" not in str(e) or "Auto" not in str(e):
      raise
    raise ValueError(
        "automap plans a program on an Auto-axis view of the mesh, where "
        "explicit-axis sharding (jax.sharding.reshard) cannot be traced. State "
        "the layout with jax.lax.with_sharding_constraint instead: automap "
        "honours it as the compiled program does.") from e
  out_with_paths, out_tree = jax.tree_util.tree_flatten_with_path(out_shape)
  out_leaves = [leaf for _, leaf in out_with_paths]
  out_avals = tuple(jax.core.ShapedArray(o.shape, o.dtype) for o in out_leaves)
  named, out_paths = names_lib.apply(
      names, dynamic, paths, avals, out_shape,
      tuple(path_str(p) for p, _ in out_with_paths), out_avals)
  return Traced(
      fn=fn,
      jaxpr=closed,
      in_tree=in_tree,
      out_tree=out_tree,
      in_paths=named,
      in_avals=avals,
      out_paths=out_paths,
      out_avals=out_avals,
      in_static=in_static if in_static.where else None,
      out_static=out_static[0] if out_static[0].where else None,
      tree_paths=paths if named != paths else (),
      passthrough=tuple(passthrough),
  )
