"""A loss scanning stacked parameters, seen as its layers: the split loss is
the user's loss (values and gradients), each stack's calls are named layers,
and what is not a layer stack is left as written."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from automap._src.cluster.execute import cut as cut_lib
from automap._src.ir import stacks

L, W = 4, 8


def params(seed: int = 0):
  k = jax.random.split(jax.random.key(seed), 3)
  return {"embed": jax.random.normal(k[0], (W, W)),
          "stack": {"w": jax.random.normal(k[1], (L, W, W)) / W, "b": jnp.zeros((L, W))},
          "head": jax.random.normal(k[2], (W, 1))}


def batch():
  return (jax.random.normal(jax.random.key(9), (16, W)),)


def stacked_loss(p, x, *, cast=False, reverse=False):
  def block(h, layer):
    w = layer["w"]
    with jax.named_scope("block"):
      return jnp.tanh(h @ w + layer["b"][None]), jnp.sum(h)

  with jax.named_scope("embed"):
    h = x @ p["embed"]
  stack = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), p["stack"]) \
      if cast else p["stack"]
  h, sums = jax.lax.scan(block, h, stack, reverse=reverse)
  with jax.named_scope("head"):
    return jnp.mean((h @ p["head"]) ** 2) + 1e-3 * jnp.sum(sums)


def assert_same_loss_and_grads(loss, p, b):
  found = stacks.unstack(loss, p, b)
  assert found is not None
  want, want_grads = jax.value_and_grad(loss)(p, *b)
  got, grads = jax.value_and_grad(found.loss_fn)(found.split(p), *b)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  for g, w in zip(jax.tree.leaves(found.join(grads)), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  return found


def layer_names(found, p, b):
  ops, *_ = cut_lib.trace(found.loss_fn, found.split(p), b)
  return cut_lib.layer_names(ops)[0]


def test_a_scan_over_stacked_parameters_is_its_layers():
  p, b = params(), batch()
  found = assert_same_loss_and_grads(stacked_loss, p, b)
  assert found.layers == L
  lengths = dict(zip(["b", "w"], [n for n in found.lengths if n]))
  assert lengths == {"b": L, "w": L}
  split = found.split(p)
  assert len(split["stack"]["w"]) == L and split["stack"]["w"][2].shape == (W, W)
  np.testing.assert_array_equal(split["stack"]["w"][2], p["stack"]["w"][2])
  assert layer_names(found, p, b) == ["embed", *(f"block_{i}" for i in range(L)), "head"]
  joined = found.join(split)
  assert jax.tree.structure(joined) == jax.tree.structure(p)
  np.testing.assert_array_equal(joined["stack"]["w"], p["stack"]["w"])


def test_stacks_cast_before_the_scan_and_reversed_scans_unroll_too():
  p, b = params(), batch()
  found = assert_same_loss_and_grads(lambda p, x: stacked_loss(p, x, cast=True), p, b)
  assert found.layers == L
  assert_same_loss_and_grads(lambda p, x: stacked_loss(p, x, reverse=True), p, b)


def test_a_stacked_leaf_read_outside_its_scan_is_rebuilt_whole_there():
  def loss(p, x):
    return stacked_loss(p, x) + jnp.sum(p["stack"]["w"] ** 2)

  p, b = params(), batch()
  assert_same_loss_and_grads(loss, p, b)


def test_abstract_parameters_split_and_join_as_shapes():
  p, b = params(), batch()
  found = stacks.unstack(stacked_loss, p, b)
  shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), p)
  split = found.split(shapes)
  assert split["stack"]["w"][0] == jax.ShapeDtypeStruct((W, W), jnp.float32)
  assert found.join(split) == shapes


def test_scans_that_stack_no_parameters_are_not_layers():
  def loss(p, x):  # a recurrence over time, its weights shared by every step
    def cell(h, x_t):
      return jnp.tanh(h @ p["embed"] + x_t), None
    h, _ = jax.lax.scan(cell, jnp.zeros(W), x[:W])
    return jnp.sum(h)

  assert stacks.unstack(loss, params(), batch()) is None


def test_the_split_loss_retraces_at_other_batch_sizes():
  p = params()
  found = stacks.unstack(stacked_loss, p, batch())
  x = jnp.ones((4, W))
  np.testing.assert_allclose(found.loss_fn(found.split(p), x), stacked_loss(p, x), rtol=1e-6)
