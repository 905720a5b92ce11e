"""Layer stacks as layers: a loss scanning stacked parameters, unrolled.

Large JAX models are written as one `lax.scan` over parameters stacked on a
leading layer dim (flax `nn.scan`, `nnx.scan`, MaxText's decoder). A pipeline
cuts between layers, so the cluster planner and its training step see such a
stack as its layers. `unstack` finds the scans that read a parameter leaf
(directly, or through a dtype cast) as a scanned input whose leading dim is
the scan's length, and returns the same loss over "split" parameters: each
stacked leaf a tuple of its layers' slices, each such scan L calls of its
body, call i under the name scope `<the scan's scope>/<stem>_i`, so that
`naming.layer_of` names the stack's layers `layers_0`, `layers_1`, ... (the
stem is the scope every op of the body shares, flax's scanned module's
name, else "layers"). The
arithmetic is the scan's, one layer at a time; what the body checkpoints
(`nn.remat` inside the scan) it still checkpoints per layer.

A stacked leaf that something other than a stack's scan also reads is
rebuilt whole there (`jnp.stack` of its layers), so the split loss is the
user's loss for any program; a pipeline stage doing so holds every layer of it.

`Stacks.shallow(kept)` is the same loss with each stack running only the
layers `kept` names (its first few and its last, each under its own name),
the carry handed from one kept layer to the next: what a deep stack's
pricing needs of it, since its layers are one body. It is refused
(`Untwinnable`) wherever something needs the stack whole: a stacked leaf read
outside its scan, a scan whose per-layer outputs are stacked, a stack of
another length.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex

from automap._src.ir.naming import TRANSFORMS
from automap._src.ir.walk import INLINE

# Elementwise casts MaxText-style models apply to their stacked weights
# before scanning them: applied to each layer's slice instead.
_CASTS = ("convert_element_type", "copy", "copy_p")


class Untwinnable(Exception):
  """A loss that needs a stack whole, which a shallow twin does not hold."""


class _Layers(tuple):
  """A stacked value held as its layers' slices (a split parameter)."""

  def whole(self) -> jax.Array:
    return jnp.stack(list(self))


class _Kept(_Layers):
  """Some of a stack's layers (`Stacks.shallow`): never whole."""

  def whole(self) -> jax.Array:
    raise Untwinnable("a stacked leaf is read whole outside its scan")


class SplitLeaves(Sequence):
  """The flat leaves of a split pytree (`Stacks.leaves`): leaf k is a
  parameter leaf or one layer of a stacked leaf, sliced when read; `rows`
  reads consecutive layers of one stacked leaf as one slice."""

  def __init__(self, stacked: Sequence, lengths: Sequence[int | None]):
    self.stacked = list(stacked)
    self.where = []  # split leaf -> (stacked leaf, layer or None)
    for u, n in enumerate(lengths):
      self.where += [(u, j) for j in range(n)] if n else [(u, None)]

  def __len__(self) -> int:
    return len(self.where)

  def __getitem__(self, k: int):
    u, j = self.where[k]
    return self.stacked[u] if j is None else _layer(self.stacked[u], j)

  def rows(self, flat: Sequence[int]):
    """Leaves `flat` as one slice of their stacked leaf where they are its
    consecutive layers, else None."""
    at = [self.where[k] for k in flat]
    u, first = at[0]
    if first is None or at != [(u, first + k) for k in range(len(at))]:
      return None
    return self.stacked[u][first:first + len(at)]


def _whole(x):
  return x.whole() if isinstance(x, _Layers) else x


@dataclasses.dataclass(frozen=True)
class Stacks:
  """A loss's layer stacks, and the loss over their split parameters.

  Attributes:
    treedef: the structure of the user's parameters.
    lengths: per flat parameter leaf, its stack's layer count (None: not
      a stack's parameter).
    fn: the user's `loss_fn(params, *batch)`.
    kept: the layers each stack runs (`shallow`); None: all of them.
  """

  treedef: Any
  lengths: tuple[int | None, ...]
  fn: Callable
  kept: tuple[int, ...] | None = None

  @property
  def layers(self) -> int:
    """Layers of the longest stack."""
    return max(n for n in self.lengths if n)

  def split(self, params: Any) -> Any:
    """The user's parameters with each stacked leaf a tuple of its layers
    (arrays sliced, `jax.ShapeDtypeStruct`s without their leading dim); of
    the `kept` layers only where some are."""
    leaves = self.treedef.flatten_up_to(params)
    return jax.tree.unflatten(self.treedef, [
        tuple(_layer(x, i) for i in (self.kept or range(n))) if n else x
        for x, n in zip(leaves, self.lengths)])

  def leaves(self, params: Any) -> SplitLeaves:
    """`split(params)`'s flat leaves, each layer sliced only when read."""
    return SplitLeaves(self.treedef.flatten_up_to(params), self.lengths)

  def shallow(self, kept: Sequence[int]) -> Stacks:
    """The stacks running only the layers `kept` (ascending, within every
    stack's length): `loss_fn` takes `split` parameters holding those
    layers, and raises `Untwinnable` where the loss needs a stack whole."""
    kept = tuple(kept)
    if list(kept) != sorted(set(kept)) or not kept or kept[0] < 0 or any(
        n and kept[-1] >= n for n in self.lengths):
      raise ValueError(f"kept must be ascending layers of every stack, got {kept}")
    return dataclasses.replace(self, kept=kept)

  def join(self, split: Any) -> Any:
    """`split`'s inverse: each tuple of layers stacked again, on the devices
    and in the layout of its first layer."""
    parts = self.treedef.flatten_up_to(split)
    return jax.tree.unflatten(self.treedef, [
        _stacked(x) if n else x for x, n in zip(parts, self.lengths)])

  def loss_fn(self, split: Any, *batch: Any) -> Any:
    """The user's loss on split parameters, each stack unrolled."""
    parts = self.treedef.flatten_up_to(split)
    avals = [jax.ShapeDtypeStruct((n, *jnp.shape(x[0])), jnp.result_type(x[0])) if n
             else jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
             for x, n in zip(parts, self.lengths)]
    batch_avals = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
                   for x in jax.tree.leaves(batch)]
    closed, out_tree = _traced(self.fn, self.treedef, jax.tree.structure(batch),
                               tuple(avals), tuple(batch_avals))
    held = _Layers if self.kept is None else _Kept
    args = [held(x) if n else x for x, n in zip(parts, self.lengths)]
    outs = _eval(closed, [*args, *jax.tree.leaves(batch)], self.kept)
    return jax.tree.unflatten(out_tree, [_whole(x) for x in outs])


def unstack(loss_fn: Callable, params: Any, batch: Sequence[Any]) -> Stacks | None:
  """`loss_fn(params, *batch)`'s layer stacks (None: it scans none).

  Args:
    loss_fn: the user's loss.
    params: its parameters (arrays or `jax.ShapeDtypeStruct`s).
    batch: its batch leaves, as `loss_fn` takes them.

  Returns:
    A `Stacks`, whose `loss_fn(split(params), *batch)` is the loss.
  """
  treedef = jax.tree.structure(params)
  leaves = jax.tree.leaves(params)
  closed = jax.make_jaxpr(loss_fn)(params, *batch)
  lengths: list[int | None] = [None] * len(leaves)
  _find(closed.jaxpr, {v: k for k, v in enumerate(closed.jaxpr.invars[:len(leaves)])}, lengths)
  if not any(lengths):
    return None
  return Stacks(treedef, tuple(lengths), loss_fn)


def _find(jaxpr, origin: dict, lengths: list) -> None:
  """Marks in `lengths` the parameter leaves (`origin`: var -> leaf) that a
  scan reads as a scanned input of its length."""
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in INLINE:
      sub = eqn.params[INLINE[name]]
      sub = sub.jaxpr if isinstance(sub, jex.ClosedJaxpr) else sub
      _find(sub, {v: origin[a] for a, v in zip(eqn.invars, sub.invars)
                  if isinstance(a, jex.Var) and a in origin}, lengths)
    elif name in _CASTS and isinstance(eqn.invars[0], jex.Var) and eqn.invars[0] in origin:
      origin[eqn.outvars[0]] = origin[eqn.invars[0]]
    elif name == "scan" and eqn.params["length"] > 1:
      n = eqn.params["length"]
      for a in eqn.invars[eqn.params["num_consts"] + eqn.params["num_carry"]:]:
        if isinstance(a, jex.Var) and a in origin and a.aval.shape[:1] == (n,):
          lengths[origin[a]] = lengths[origin[a]] or n


@functools.lru_cache(maxsize=64)
def _traced(fn: Callable, treedef, batch_treedef, avals: tuple, batch_avals: tuple):
  params = jax.tree.unflatten(treedef, avals)
  batch = jax.tree.unflatten(batch_treedef, batch_avals)
  closed, shape = jax.make_jaxpr(fn, return_shape=True)(params, *batch)
  return closed, jax.tree.structure(shape)


def _eval(closed, args: Sequence, kept: tuple[int, ...] | None = None) -> list:
  """`closed` on `args`, stacks unrolled (to their `kept` layers where
  given), every other equation as it is."""
  jaxpr = closed.jaxpr if isinstance(closed, jex.ClosedJaxpr) else closed
  env = dict(zip(jaxpr.constvars, closed.consts if isinstance(closed, jex.ClosedJaxpr) else ()))
  env.update(zip(jaxpr.invars, args))

  def read(atom):
    return atom.val if isinstance(atom, jex.Literal) else env[atom]

  for eqn in jaxpr.eqns:
    ins = [read(a) for a in eqn.invars]
    name = eqn.primitive.name
    split = any(isinstance(x, _Layers) for x in ins)
    if split and name in INLINE:
      with _scope(eqn):
        outs = _eval(eqn.params[INLINE[name]], ins, kept)
    elif split and name == "scan" and _scans_layers(eqn, ins, kept):
      with _scope(eqn):
        outs = _unrolled(eqn, ins, kept)
    elif split and name in _CASTS and isinstance(ins[0], _Layers):
      outs = [type(ins[0])(_cast(eqn, x) for x in ins[0])]
    else:
      outs = _bind(eqn, [_whole(x) for x in ins])
    env.update((v, x) for v, x in zip(eqn.outvars, outs) if not isinstance(v, jex.DropVar))
  return [read(a) for a in jaxpr.outvars]


def _scans_layers(eqn, ins: Sequence, kept: tuple[int, ...] | None) -> bool:
  n, first = eqn.params["length"], eqn.params["num_consts"] + eqn.params["num_carry"]
  held = n if kept is None else len(kept)
  return any(isinstance(x, _Layers) and len(x) == held for x in ins[first:])


def _unrolled(eqn, ins: Sequence, kept: tuple[int, ...] | None = None) -> list:
  """A scan as `length` calls of its body (of its `kept` layers only, the
  carry handed from each to the next), call i under the name scope
  `<stem>_i`."""
  p = eqn.params
  stem = _stem(p["jaxpr"].jaxpr)
  nc, nk, n = p["num_consts"], p["num_carry"], p["length"]
  if kept is not None and (kept[-1] >= n or len(p["jaxpr"].out_avals) > nk):
    raise Untwinnable(f"a stack of {n} layers, or one whose layers' outputs are stacked")
  consts = [_whole(x) for x in ins[:nc]]
  carry = [_whole(x) for x in ins[nc:nc + nk]]
  xs = ins[nc + nk:]
  ys: list[list] = [None] * n
  # Position k of a split leaf holds layer order[k].
  order = range(n) if kept is None else kept
  for k, i in (reversed(list(enumerate(order))) if p["reverse"] else enumerate(order)):
    x_i = [x[k] if isinstance(x, _Layers) else jax.lax.index_in_dim(x, i, keepdims=False)
           for x in xs]
    with jax.named_scope(f"{stem}_{i}"):
      outs = [_whole(y) for y in _eval(p["jaxpr"], [*consts, *carry, *x_i])]
    carry, ys[i] = outs[:nk], outs[nk:]
  stacked = [jnp.stack(col) for col in zip(*ys)] if ys and ys[0] else []
  return [*carry, *stacked]


def _stem(jaxpr) -> str:
  """The first name-scope component every op of the body shares, else "layers"."""
  firsts = set()

  def visit(jaxpr, scope: str) -> None:
    for eqn in jaxpr.eqns:
      inner = "/".join(p for p in (scope, str(eqn.source_info.name_stack)) if p)
      subs = list(jex.jaxprs_in_params(eqn.params))
      for sub in subs:
        visit(sub, inner)
      if not subs:
        firsts.add(TRANSFORMS.sub("", inner.split("/")[0]))

  visit(jaxpr, "")
  return firsts.pop() if len(firsts) == 1 and "" not in firsts else "layers"


def _cast(eqn, x):
  if eqn.primitive.name == "convert_element_type":
    return jax.lax.convert_element_type(x, eqn.params["new_dtype"])
  return x


def _bind(eqn, ins: Sequence) -> list:
  """One equation on its operands' values, under its own name scope."""
  variables = [v for v in eqn.invars if isinstance(v, jex.Var)]
  values = [x for v, x in zip(eqn.invars, ins) if isinstance(v, jex.Var)]
  results = [v for v in eqn.outvars if not isinstance(v, jex.DropVar)]
  info = jex.DebugInfo("unstacked loss", "equation",
                       tuple(f"x{k}" for k in range(len(variables))),
                       tuple(f"y{k}" for k in range(len(results))))
  jaxpr = jex.Jaxpr((), variables, results, [eqn], eqn.effects, info)
  made = iter(jex.jaxpr_as_fun(jex.ClosedJaxpr(jaxpr, ()))(*values))
  return [None if isinstance(v, jex.DropVar) else next(made) for v in eqn.outvars]


@contextlib.contextmanager
def _scope(eqn):
  """The equation's own name scope, entered component by component."""
  with contextlib.ExitStack() as stack:
    for part in str(eqn.source_info.name_stack).split("/"):
      if part:
        stack.enter_context(jax.named_scope(part))
    yield


def _layer(x, i: int):
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
  return x[i]


def _stacked(layers: Sequence):
  first = layers[0]
  if isinstance(first, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct((len(layers), *first.shape), first.dtype)
  where = getattr(first, "sharding", None)
  if where is not None:
    layers = [jax.device_put(x, where) for x in layers]
  return jnp.stack(layers)


__all__ = ["SplitLeaves", "Stacks", "Untwinnable", "unstack"]
