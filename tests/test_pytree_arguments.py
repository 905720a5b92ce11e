"""Arguments as users pass them: None leaves, empty containers, static leaves.

An equinox model is a pytree whose leaves are arrays beside functions,
strings and numbers; an `eqx.partition`ed one has None where its static
leaves were. automap holds non-array leaves out of the trace as
`eqx.filter_jit` does, and no spec may ever land on the wrong array because
of a leaf without one.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from random_programs import MESHES, random_programs

import automap
from automap._src.ir import trace as trace_lib
from automap._src.sharding.state import flat_specs

W = jnp.asarray(np.random.default_rng(0).standard_normal((16, 32)), jnp.float32)
X = jnp.asarray(np.random.default_rng(1).standard_normal((8, 16)), jnp.float32)


def _grad(p, x):
  return jax.grad(lambda p: jnp.tanh(x @ p["w"]).sum())(p)


def test_a_none_leaf_shifts_no_spec():
  m = mesh((4, 2))
  with_none = automap.evaluate(_grad, {"a": None, "w": W}, X, mesh=m, hardware="cpu",
                               in_shardings=({"a": None, "w": P()}, P("data", None)))
  without = automap.evaluate(_grad, {"w": W}, X, mesh=m, hardware="cpu",
                             in_shardings=({"w": P()}, P("data", None)))
  # Data parallelism all-reduces the (16, 32) float32 gradient.
  assert with_none.comm_bytes == without.comm_bytes == {("all-reduce", ("data",)): 2048.0}


def test_flat_specs_skip_leaves_without_arrays():
  args = ({"a": None, "b": (), "w": W, "z": {"q": W}}, X)
  specs = flat_specs(({"a": P("data"), "b": None, "w": P("model"), "z": None},
                      P("data")), args)
  assert specs == [P("model"), P(), P("data")]


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["weight", "activation", "name", "heads"], meta_fields=[])
@dataclasses.dataclass
class Layer:
  """An equinox-style module: its activation, name and head count are
  ordinary fields, so pytree leaves beside its weight."""
  weight: jax.Array
  activation: object
  name: str
  heads: int

  def __call__(self, x):
    h = self.activation(x @ self.weight)
    return h.reshape(x.shape[0], self.heads, -1).sum(-1)  # heads read concretely


def _step(layer, x, scale):
  loss, grads = jax.value_and_grad(
      lambda w: (dataclasses.replace(layer, weight=w)(x) * scale).sum())(layer.weight)
  return dataclasses.replace(layer, weight=layer.weight - 0.1 * grads), loss


def test_a_module_with_static_fields_runs_as_written():
  layer = Layer(W, jax.nn.gelu, "dense", 4)
  step = automap.partition(_step, mesh=mesh((4, 2)), hardware="cpu", cache=False,
                           budget=automap.Budget(episodes=4))
  new, loss = step(layer, X, 2.0)
  want_new, want_loss = _step(layer, X, 2.0)  # eagerly: jax.jit takes no functions
  # Static leaves come back as they went in; arrays as the program computes them.
  assert new.activation is jax.nn.gelu and new.name == "dense" and new.heads == 4
  # Eager ops against one compiled program: float32 rounding of the batch's
  # gradient sum, a few 1e-6 on weights of order one.
  np.testing.assert_allclose(new.weight, want_new.weight, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  # The head count shaped the program, so the numbers are static: one plan each.
  assert step.plan.in_paths == ("0/weight", "1")
  step(Layer(W, jax.nn.gelu, "dense", 8), X, 2.0)
  step(Layer(W, jax.nn.gelu, "dense", 8), X, 2.0)
  assert len(step._entries) == 2
  report = step.verify(layer, X, 2.0)
  assert report.max_rel_error < 1e-5 and report.comm_error < 0.05, report.table()


def test_numbers_once_static_stay_static_for_every_signature():
  def f(x, n):  # reads n concretely for matrices only
    return x.reshape(n, -1).sum(0) if x.ndim == 2 else x * n

  g = automap.partition(f, mesh=mesh((8, 1)), hardware="cpu", cache=False,
                        budget=automap.Budget(episodes=2))
  np.testing.assert_allclose(g(X, 4), f(X, 4), rtol=1e-6)
  np.testing.assert_allclose(g(X[0], 4), f(X[0], 4), rtol=1e-6)
  assert g.plan.in_paths == ("0",)


def test_numbers_are_traced_where_the_program_allows():
  plan = automap.search(lambda x, s: x * s, X, 2.0, mesh=mesh((8, 1)), hardware="cpu")
  assert plan.in_paths == ("0", "1") and plan.in_specs[1] == P()


def test_static_leaves_export_no_layout():
  layer = Layer(W, jax.nn.gelu, "dense", 4)
  plan = automap.search(_step, layer, X, 2.0, mesh=mesh((4, 2)), hardware="cpu",
                        budget=automap.Budget(episodes=4))
  specs = plan.specs(layer, at=0)
  assert specs.activation is None and specs.name is None and specs.heads is None
  assert specs.weight == plan.in_specs[0]
  placed = automap.shard_like(layer, plan, mesh((4, 2)), at=0)
  assert placed.activation is jax.nn.gelu and placed.weight.sharding.spec == plan.in_specs[0]
  cost = automap.evaluate(_step, layer, X, 2.0, mesh=mesh((4, 2)), hardware="cpu",
                          in_shardings=(Layer(P(None, "model"), None, None, None), P(), P()))
  assert cost.comm_bytes  # Megatron-style column tiling moves the activation gradient.


def test_an_unhashable_static_leaf_names_its_path():
  class Config:  # Defines equality, so Python drops its hash.
    def __eq__(self, other):
      return isinstance(other, Config)

  with pytest.raises(automap.ArgumentError, match="'1/config'.*Config.*hashable"):
    automap.search(lambda x, c: x, X, {"config": Config()}, mesh=mesh((8, 1)))


# What a user's pytree puts beside its arrays: None and empty containers,
# static leaves (Python numbers are traced, as jax.jit traces them).
NOISE = st.sampled_from([None, (), {}, [], "relu", jax.nn.gelu, ("a", "b"), {"n": None}])


@st.composite
def dressed(draw, n: int):
  """(layout, at): a list of noise with n slots, slot i at index at[i]
  (wrapped in a dict, or not)."""
  layout, at = [], []
  for _ in range(n):
    layout += [draw(NOISE) for _ in range(draw(st.integers(0, 2)))]
    at.append(len(layout))
    layout.append(draw(st.booleans()))
  return layout, at


def _fill(layout, at, values, noise):
  """`layout` with value i in slot i and each noise entry replaced by `noise(entry)`."""
  out = [noise(x) for x in layout]
  for i, j in enumerate(at):
    out[j] = {"leaf": values[i]} if layout[j] else values[i]
  return out


def _spec(shape, m, draw) -> P:
  free, entries = list(m.axis_names), []
  for size in shape:
    axis = draw(st.sampled_from([None] + [a for a in free if size % m.shape[a] == 0]))
    if axis is not None:
      free.remove(axis)
    entries.append(axis)
  return P(*entries)


@settings(max_examples=40)
@given(random_programs(kinds=("unary", "binary", "dot", "reduce")), st.sampled_from(MESHES),
       st.data())
def test_specs_reach_their_arrays_through_any_pytree(prog, mesh_shape, data):
  """`evaluate` of a program whose arrays sit among None, empty containers
  and static leaves prices what the bare program prices, spec for spec."""
  m = jax.make_mesh(mesh_shape, ("a", "b", "c")[:len(mesh_shape)])
  args = prog.args()
  layout, at = data.draw(dressed(len(args)))
  specs = [_spec(x.shape, m, data.draw) for x in args]

  def wrapped(tree):
    return prog.fn(*[tree[j]["leaf"] if layout[j] else tree[j] for j in at])

  tree = _fill(layout, at, args, lambda x: x)
  tree_specs = _fill(layout, at, specs, lambda x: None)  # noise covers no array
  bare = automap.evaluate(prog.fn, *args, mesh=m, hardware="cpu", in_shardings=tuple(specs))
  dressed_cost = automap.evaluate(wrapped, tree, mesh=m, hardware="cpu",
                                  in_shardings=(tree_specs,))
  assert dressed_cost.comm_bytes == bare.comm_bytes
  assert dressed_cost.peak_memory == bare.peak_memory
  traced = trace_lib.trace(wrapped, (tree,))
  assert len(traced.in_paths) == len(args)
  # A prefix spec over the whole tree reaches every array, and nothing else.
  assert flat_specs((P(),), traced.dynamic_args((tree,))) == [P()] * len(args)
