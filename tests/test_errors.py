"""Bad input: a clear error naming the argument, or a safe fallback."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import gpt_step, mesh, mlp
from jax.sharding import PartitionSpec as P

import automap

X = (jnp.ones((16, 32)), jnp.ones((32, 64)), jnp.ones((64, 32)))


def test_mesh_that_is_not_a_mesh():
  with pytest.raises(automap.MeshError, match="jax.make_mesh"):
    automap.partition(mlp, mesh=(4, 2))
  with pytest.raises(automap.MeshError, match="got list"):
    automap.search(mlp, *X, mesh=[1, 2])


def test_unknown_mesh_axis_in_hints():
  hints = automap.Hints(fixed={"*": P("tensor")})
  with pytest.raises(automap.MeshError, match="'tensor'.*'data', 'model'"):
    automap.partition(mlp, mesh=mesh((4, 2)), hints=hints)


def test_unknown_mesh_axis_in_hand_written_specs():
  with pytest.raises(automap.MeshError, match="'batch'"):
    automap.evaluate(mlp, *X, mesh=mesh((4, 2)), in_shardings=(P("batch"), P(), P()))


def test_fixed_hint_that_matches_nothing():
  with pytest.raises(automap.MeshError, match="matches no argument"):
    automap.search(mlp, *X, mesh=mesh((4, 2)), hints=automap.Hints(fixed={"w9": P()}))


def test_fixed_hint_is_kept_by_the_plan():
  hints = automap.Hints(fixed={"1": P(None, "model")})
  plan = automap.search(mlp, *X, mesh=mesh((4, 2)), hints=hints, hardware="cpu")
  assert plan.in_specs[1] == P(None, "model")


def test_non_array_leaf_names_its_path():
  with pytest.raises(automap.ArgumentError, match="'1/activation'.*str"):
    automap.search(lambda x, cfg: x, X[0], {"activation": "gelu"}, mesh=mesh((8, 1)))


def test_python_scalars_are_accepted():
  plan = automap.search(lambda x, s: x * s, X[0], 2.0, mesh=mesh((8, 1)), hardware="cpu")
  assert plan.in_specs[1] == P()


def test_memory_limit_below_the_lower_bound_states_it():
  step, args = gpt_step()
  with pytest.raises(automap.MemoryLimitError, match="lower bound of [0-9,]+ bytes"):
    automap.search(step, *args, mesh=mesh((4, 2)), memory_limit=1000)


def test_a_reachable_memory_limit_is_met():
  step, args = gpt_step()
  m = mesh((4, 2))
  free = automap.search(step, *args, mesh=m, hardware="tpu-v4")
  limit = 0.7 * free.cost.peak_memory
  plan = automap.search(step, *args, mesh=m, hardware="tpu-v4", memory_limit=limit)
  assert plan.cost.peak_memory <= limit


def test_changed_signature_replans():
  f = automap.partition(mlp, mesh=mesh((4, 2)), hardware="cpu")
  f(*X)
  first = f.plan
  wider = (jnp.ones((32, 32)), X[1], X[2])
  np.testing.assert_allclose(f(*wider), mlp(*wider), rtol=1e-5)
  assert f.plan is not first


def test_user_errors_surface_unchanged():
  def broken(x):
    raise ZeroDivisionError("user bug")
  with pytest.raises(ZeroDivisionError, match="user bug"):
    automap.search(broken, X[0], mesh=mesh((8, 1)))


def test_unsupported_primitive_is_replicated_with_a_warning():
  def f(x, w):
    return jnp.fft.fft(x @ w).real.sum(axis=1)
  args = (jax.random.normal(jax.random.key(0), (16, 32)),
          jax.random.normal(jax.random.key(1), (32, 64)))
  with pytest.warns(automap.UnknownPrimitiveWarning, match="fft"):
    g = automap.partition(f, mesh=mesh((4, 2)), hardware="cpu")
    out = g(*args)
  np.testing.assert_allclose(out, f(*args), rtol=1e-4, atol=1e-3)


def test_budget_and_hints_validation():
  with pytest.raises(ValueError, match="episodes"):
    automap.Budget(episodes=0)
  with pytest.raises(ValueError, match="seconds"):
    automap.Budget(seconds=-1.0)
  with pytest.raises(TypeError, match="PartitionSpec"):
    automap.Hints(fixed={"w": "model"})
  with pytest.raises(TypeError, match="automap.Budget"):
    automap.partition(mlp, mesh=mesh((8, 1)), budget=10)
