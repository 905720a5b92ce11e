"""Training loops: a step's outputs go back in as its next inputs.

Non-array leaves come back as they went in (same type, equal value), arrays
come back where arrays went, and feeding them back never re-plans. Each
library's loop runs ten steps beside its own jit with equal numerics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mesh
from hypothesis import given, settings
from hypothesis import strategies as st

import automap

QUICK = dict(hardware="cpu", cache=False, budget=automap.Budget(episodes=2, progress=False))


def _same_leaves(got, want, atol: float = 1e-6):
  got_leaves, got_tree = jax.tree.flatten(got, is_leaf=lambda x: x is None)
  want_leaves, want_tree = jax.tree.flatten(want, is_leaf=lambda x: x is None)
  assert got_tree == want_tree
  for g, w in zip(got_leaves, want_leaves):
    if isinstance(w, jax.Array):
      assert isinstance(g, jax.Array)
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=atol, rtol=1e-5)
    else:
      assert type(g) is type(w) and g == w


_static = st.one_of(st.none(), st.booleans(), st.integers(-3, 3),
                    st.floats(-2, 2, allow_nan=False), st.sampled_from(["relu", "gelu"]),
                    st.just(()), st.just({}))
_array = st.sampled_from([(8,), (8, 4), (16, 2)]).map(
    lambda shape: jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) / 10)
_trees = st.recursive(
    st.one_of(_static, _array),
    lambda children: st.one_of(st.lists(children, max_size=3).map(tuple),
                               st.dictionaries(st.sampled_from("abc"), children, max_size=3)),
    max_leaves=6)


def _step(state):
  """Updates every array (traced Python numbers are 0-d: returned as they
  came, as every other leaf)."""
  return jax.tree.map(lambda x: x * 0.5 + 1.0 if jnp.ndim(x) else x, state)


@settings(max_examples=12, deadline=None)
@given(tree=_trees)
def test_outputs_fed_back_as_inputs_never_fail_and_never_replan(tree):
  step = automap.partition(_step, mesh=mesh((4, 2)), **QUICK)
  state, expected = tree, tree
  for _ in range(3):
    state, expected = step(state), _step(expected)
    _same_leaves(state, expected)
  assert len(step._entries) == 1


def test_a_python_number_returned_as_it_came_stays_that_number():
  """A traced Python number the step hands back untouched is the call's own
  number again, not a traced copy of it."""
  step = automap.partition(lambda x, lr, on: (x * lr, lr, on), mesh=mesh((4, 2)), **QUICK)
  x, lr, on = jnp.ones((8, 4)), 0.5, True
  for _ in range(3):
    x, lr, on = step(x, lr, on)
    assert type(lr) is float and lr == 0.5 and on is True
  assert len(step._entries) == 1


def test_equinox_tutorial_loop_matches_filter_jit_at_every_step():
  eqx = pytest.importorskip("equinox")

  class MLP(eqx.Module):
    l1: eqx.nn.Linear
    drop: eqx.nn.Dropout
    l2: eqx.nn.Linear

    def __init__(self, key):
      k1, k2 = jax.random.split(key)
      self.l1 = eqx.nn.Linear(32, 64, key=k1)
      self.drop = eqx.nn.Dropout(0.1, inference=True)
      self.l2 = eqx.nn.Linear(64, 8, key=k2)

    def __call__(self, x):
      return self.l2(self.drop(jax.nn.relu(self.l1(x))))

  optimizer = optax.adam(1e-2)

  def step(model, opt_state, x, y):
    def loss(m):
      return jnp.mean((jax.vmap(m)(x) - y) ** 2)

    value, grads = eqx.filter_value_and_grad(loss)(model)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, value

  model = MLP(jax.random.key(0))
  opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
  x, y = jax.random.normal(jax.random.key(1), (16, 32)), jnp.ones((16, 8))
  ours = automap.partition(step, mesh=mesh((4, 2)), **QUICK)
  theirs = eqx.filter_jit(step)
  a = b = (model, opt_state)
  for _ in range(10):
    *a, loss_a = ours(*a, x, y)
    *b, loss_b = theirs(*b, x, y)
    _same_leaves((a, loss_a), (b, loss_b), atol=1e-5)
  assert len(ours._entries) == 1


@pytest.mark.heavy
def test_haiku_loop_matches_jit_at_every_step():
  hk = pytest.importorskip("haiku")

  def forward(x, is_training):
    x = hk.Linear(64)(x)
    x = hk.BatchNorm(True, True, 0.9)(x, is_training)
    return hk.Linear(8)(jax.nn.relu(x))

  net = hk.without_apply_rng(hk.transform_with_state(forward))
  optimizer = optax.sgd(0.1)

  def step(params, state, opt_state, x, y, is_training):
    def loss(p):
      out, new_state = net.apply(p, state, x, is_training)
      return jnp.mean((out - y) ** 2), new_state

    (value, state), grads = jax.value_and_grad(loss, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state)
    return optax.apply_updates(params, updates), state, opt_state, value, is_training

  x, y = jax.random.normal(jax.random.key(1), (16, 32)), jnp.ones((16, 8))
  params, state = net.init(jax.random.key(0), x, True)
  ours = automap.partition(step, mesh=mesh((4, 2)), **QUICK)
  theirs = jax.jit(step, static_argnums=5)
  a = b = (params, state, optimizer.init(params))
  training_a = True
  for _ in range(10):
    *a, loss_a, training_a = ours(*a, x, y, training_a)
    *b, loss_b, _ = theirs(*b, x, y, True)
    assert training_a is True
    _same_leaves((a, loss_a), (b, loss_b), atol=1e-5)
  assert len(ours._entries) == 1


def test_flax_nnx_loop_matches_jit_at_every_step():
  from flax import nnx

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(32, 64, rngs=rngs)
      self.drop = nnx.Dropout(0.1, deterministic=True)
      self.l2 = nnx.Linear(64, 8, rngs=rngs)

    def __call__(self, x):
      return self.l2(self.drop(nnx.relu(self.l1(x))))

  graphdef, params = nnx.split(MLP(nnx.Rngs(0)))
  optimizer = optax.adamw(1e-2)

  def step(params, opt_state, x, y):
    def loss(p):
      return jnp.mean((nnx.merge(graphdef, p)(x) - y) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  x, y = jax.random.normal(jax.random.key(1), (16, 32)), jnp.ones((16, 8))
  ours = automap.partition(step, mesh=mesh((4, 2)), **QUICK)
  theirs = jax.jit(step)
  a = b = (params, optimizer.init(params))
  for _ in range(10):
    *a, loss_a = ours(*a, x, y)
    *b, loss_b = theirs(*b, x, y)
    _same_leaves((a, loss_a), (b, loss_b), atol=1e-5)
  assert len(ours._entries) == 1
