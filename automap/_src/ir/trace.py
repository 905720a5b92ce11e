"""Trace: from a function and example arguments to its jaxpr.

Arguments may be arrays, numpy arrays, Python scalars or
`jax.ShapeDtypeStruct`s, so a model too large for this machine can be planned
without materialising it. Each flat argument keeps the path of its leaf in the
argument pytree (`params/block_0/mlp/wi/kernel`): flax nnx attribute names and
raw pytrees never reach the jaxpr's name stacks, their paths always exist.

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


class ArgumentError(TypeError):
  """An argument leaf that is not an array-like value."""


@dataclasses.dataclass(frozen=True)
class Traced:
  """A traced program.

  jaxpr: the closed jaxpr of `fn(*args)`.
  in_tree / out_tree: pytree structures of the arguments and outputs.
  in_paths: per flat argument, its path in the argument pytree.
  in_avals: per flat argument, its abstract value (shape, dtype).
  out_paths / out_avals: per flat output, its path and abstract value.
  """

  fn: Callable
  jaxpr: jex.ClosedJaxpr
  in_tree: Any
  out_tree: Any
  in_paths: tuple[str, ...]
  in_avals: tuple[Any, ...]
  out_paths: tuple[str, ...]
  out_avals: tuple[Any, ...]

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
    # Shardings name the mesh traced under; its devices are not the program's.
    h.update(_DEVICES.sub("", str(self.jaxpr.jaxpr)).encode())
    return h.hexdigest()[:16]


# How an abstract mesh prints the devices it stands for.
_DEVICES = re.compile(r", device_kind=[^,()]*, num_cores=[^,()]*(, platform=[^,()]*)?")


def signature_of(in_tree, avals) -> tuple:
  """Hashable identity of an argument structure, shapes and dtypes."""
  return (str(in_tree),) + tuple((tuple(a.shape), str(a.dtype), a.weak_type)
                                 for a in avals)


def path_str(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/")


def _aval_of(path, leaf):
  if isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
    return jax.core.ShapedArray(leaf.shape, leaf.dtype)
  if isinstance(leaf, (bool, int, float, complex)):
    # Python numbers are weakly typed under jit: x_bf16 * 2.0 stays bf16.
    return jax.core.ShapedArray((), jax.numpy.asarray(leaf).dtype,
                                weak_type=not isinstance(leaf, bool))
  raise ArgumentError(
      f"argument leaf {path_str(path) or '<root>'!r} is a "
      f"{type(leaf).__name__}, expected a jax.Array, numpy array, Python "
      "number or jax.ShapeDtypeStruct. Mark non-array configuration as static "
      "(close over it, e.g. with functools.partial) instead of passing it.")


def flatten_args(args: tuple) -> tuple[list, Any, tuple[str, ...], tuple]:
  """Flat leaves, tree, leaf paths and avals; errors name a bad leaf's path."""
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


def trace(fn: Callable, args: tuple, mesh=None) -> Traced:
  """Traces `fn(*args)`, under `mesh` (a Mesh, an AbstractMesh or a
  `MeshSpec`) if given. Errors raised by `fn` itself surface unchanged,
  but for explicit-axis sharding, which the Auto view cannot trace."""
  _, in_tree, paths, avals = flatten_args(args)
  specs = jax.tree.unflatten(in_tree, [
      jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals])
  context = contextlib.nullcontext()
  if mesh is not None:
    context = jax.sharding.use_abstract_mesh(_auto_view(mesh))
  try:
    with context:
      # A fresh callable: JAX's trace cache does not key on context outside
      # JAX's own (flax's logical axis rules), so a cached trace may be stale.
      closed, out_shape = jax.make_jaxpr(lambda *a: fn(*a), return_shape=True)(*specs)
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
  return Traced(
      fn=fn,
      jaxpr=closed,
      in_tree=in_tree,
      out_tree=out_tree,
      in_paths=paths,
      in_avals=avals,
      out_paths=tuple(path_str(p) for p, _ in out_with_paths),
      out_avals=tuple(jax.core.ShapedArray(o.shape, o.dtype) for o in out_leaves),
  )
