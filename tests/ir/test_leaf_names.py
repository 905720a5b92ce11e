"""Naming argument leaves as their libraries do, without running their code."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh

import automap
from automap._src.ir import leaf_names


class _Raising:
  """A user object whose properties and missing attributes raise."""

  label = "looks/labelled"

  @property
  def value(self):
    raise RuntimeError("a property of the user's was run")

  def __getattr__(self, name):
    raise RuntimeError(f"__getattr__({name!r}) of the user's was run")


class _Slotted:
  __slots__ = ("label", "value")

  def __init__(self, label, value):
    self.label, self.value = label, value


jax.tree_util.register_pytree_node(
    _Slotted, lambda s: ((s.value,), s.label), lambda label, kids: _Slotted(label, kids[0]))


def test_the_name_pass_never_runs_a_users_property_or_getattr():
  tree = ({"w": jnp.ones(3)}, _Raising())
  assert leaf_names.library_names(tree) is None


def test_labels_stored_in_slots_name_their_leaves():
  tree = (_Slotted("block/w", jnp.ones(3)), jnp.zeros(2))
  assert leaf_names.library_names(tree) == ("block/w", None)


def _penzai_step():
  """penzai's `basic_training` form: the step takes the model with its
  parameters unbound (`ParameterSlot`s, whose `.value` raises) and the
  parameter values apart, and binds them inside."""
  pytest.importorskip("penzai")
  from penzai import pz
  model = pz.nn.Sequential([
      pz.nn.Linear.from_config(name="up", init_base_rng=jax.random.key(0),
                               input_axes={"i": 16}, output_axes={"h": 32}),
      pz.nn.Elementwise(jax.nn.relu),
      pz.nn.Linear.from_config(name="down", init_base_rng=jax.random.key(1),
                               input_axes={"h": 32}, output_axes={"o": 16}),
  ])
  unbound, params = pz.unbind_params(model, freeze=True)

  def step(unbound, params, x):
    def loss(params):
      y = unbound.bind_variables(params)(pz.nx.wrap(x).tag("b", "i"))
      return jnp.mean(y.unwrap("b", "o") ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

  return step, (unbound, params, jax.random.normal(jax.random.key(2), (32, 16)))


@pytest.mark.heavy
def test_a_penzai_step_over_unbound_parameters_is_planned_and_run():
  step, args = _penzai_step()
  step_p = automap.partition(step, mesh=mesh((4, 2)), hardware="cpu",
                             budget=automap.Budget(episodes=10, progress=False), cache=False)
  expected, got = jax.jit(step)(*args), step_p(*args)
  for want, have in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
    np.testing.assert_allclose(np.asarray(have), np.asarray(want), rtol=1e-5, atol=1e-6)
  # The bound values are named by their labels, which penzai's paths leave out.
  assert any("up.weights" in p for p in step_p.plan.in_paths)
