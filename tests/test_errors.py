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


def test_unhashable_non_array_leaf_names_its_path():
  with pytest.raises(automap.ArgumentError, match="'1/activation'.*set.*hashable"):
    automap.search(lambda x, cfg: x, X[0], {"activation": {"gelu"}}, mesh=mesh((8, 1)))


def test_python_scalars_are_accepted():
  plan = automap.search(lambda x, s: x * s, X[0], 2.0, mesh=mesh((8, 1)), hardware="cpu")
  assert plan.in_specs[1] == P()


def test_memory_limit_below_the_lower_bound_states_it():
  step, args = gpt_step()
  with pytest.raises(automap.MemoryLimitError, match="lower bound of [0-9,]+ bytes"):
    automap.search(step, *args, mesh=mesh((4, 2)), memory_limit=1000)


@pytest.mark.heavy
# A limit met and checked compiled: test_tight_memory_limit_finds_a_plan_that_fits_when_compiled.
@pytest.mark.slow
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
  for patience in (0, 2.5, True):
    with pytest.raises(ValueError, match="Budget.patience must be a positive integer"):
      automap.Budget(patience=patience)
  with pytest.raises(TypeError, match="PartitionSpec"):
    automap.Hints(fixed={"w": "model"})
  with pytest.raises(TypeError, match="automap.Budget"):
    automap.partition(mlp, mesh=mesh((8, 1)), budget=10)


def test_a_mesh_without_axes_is_refused():
  no_axes = jax.sharding.Mesh(np.array(jax.devices()[0]), ())
  with pytest.raises(automap.MeshError, match="at least one axis"):
    automap.search(mlp, *X, mesh=no_axes)


def test_spec_with_more_entries_than_dims_names_the_argument():
  with pytest.raises(automap.MeshError, match="'0'.*3 entries.*rank 2"):
    automap.evaluate(mlp, *X, mesh=mesh((4, 2)), in_shardings=(P(None, None, "data"), P(), P()))
  with pytest.raises(automap.MeshError, match=r"Hints.fixed\['0'\].*rank 2"):
    automap.search(mlp, *X, mesh=mesh((4, 2)),
                   hints=automap.Hints(fixed={"0": P(None, None, "data")}))


def test_spec_tiling_a_dim_the_axis_does_not_divide():
  x = jnp.ones((6, 32))
  with pytest.raises(automap.MeshError, match="size 6 is not divisible by the 4 tiles"):
    automap.search(mlp, x, X[1], X[2], mesh=mesh((4, 2)),
                   hints=automap.Hints(fixed={"0": P("data")}))


def test_conflicting_fixed_specs_name_both():
  hints = automap.Hints(fixed={"0": P("data"), "*": P()})
  with pytest.raises(automap.MeshError, match=r"two different specs.*make the patterns disjoint"):
    automap.search(mlp, *X, mesh=mesh((4, 2)), hints=hints)


def test_specs_not_matching_the_arguments():
  with pytest.raises(automap.MeshError, match="pytree of PartitionSpecs matching"):
    automap.evaluate(mlp, *X, mesh=mesh((4, 2)), in_shardings=(P(), P()))
  with pytest.raises(automap.MeshError, match="expected a PartitionSpec, got 'data'"):
    automap.evaluate(mlp, *X, mesh=mesh((4, 2)), in_shardings=("data", None, None))


@pytest.mark.parametrize("seconds", [0, -1.0, float("nan")])
def test_a_budget_must_be_positive(seconds):
  with pytest.raises(ValueError, match="Budget.seconds must be a positive number"):
    automap.Budget(seconds=seconds)


@pytest.mark.parametrize("kwargs, match", [
    ({"memory_limit": "16GB"}, "memory_limit must be a number of bytes"),
    ({"memory_limit": -5}, "memory_limit must be a positive number"),
    ({"seed": "a"}, "seed must be a non-negative integer"),
    ({"search": "genetic"}, "search must be one of"),
    ({"hardware": "tpu-v9"}, "hardware must be a automap.Hardware or one of"),
    ({"devices": 8}, "exactly one of mesh="),
])
def test_search_options_are_checked_before_searching(kwargs, match):
  with pytest.raises((TypeError, ValueError), match=match):
    automap.search(mlp, *X, mesh=mesh((4, 2)), **kwargs)


@pytest.mark.parametrize("field, value", [
    ("flops", 0.0), ("hbm_bandwidth", -1.0), ("link_bandwidth", float("nan")),
    ("link_latency", -1e-6), ("devices_per_node", 0)])
def test_hardware_figures_must_be_positive(field, value):
  import dataclasses

  with pytest.raises(automap.HardwareError, match=f"Hardware.{field} must be a positive"):
    dataclasses.replace(automap.HARDWARE["h100"], **{field: value})


def test_callbacks_rng_and_custom_calls_next_to_sharded_values_keep_numerics():
  """Effects and opaque ops between sharded neighbours: the callbacks run
  once per call on whole values, the random draws and a LAPACK custom call
  (cholesky) give the unpartitioned results."""
  seen = []

  def f(x, w, key):
    h = jnp.tanh(x @ w)
    jax.debug.callback(lambda v: seen.append(float(v)), h.sum())
    h = h + 0.1 * jax.random.normal(key, h.shape)
    y = jax.pure_callback(np.sin, jax.ShapeDtypeStruct(h.shape, h.dtype), h)
    s = jnp.linalg.cholesky(y.T @ y + 64 * jnp.eye(y.shape[1]))
    return (y @ s).sum(axis=0)

  args = (jax.random.normal(jax.random.key(0), (16, 32)),
          jax.random.normal(jax.random.key(1), (32, 16)), jax.random.key(2))
  expected = jax.jit(f)(*args)
  hints = automap.Hints(fixed={"0": P("data"), "1": P(None, "model")})
  g = automap.partition(f, mesh=mesh((4, 2)), hints=hints, hardware="cpu")
  actual = g(*args)  # cholesky has a rule: its matrix whole, as XLA keeps it
  assert g.plan.in_specs[:2] == (P("data"), P(None, "model"))
  np.testing.assert_allclose(actual, expected, rtol=1e-5)
  assert len(seen) == 2 and seen[1] == pytest.approx(seen[0], rel=1e-4)


def test_search_options_and_their_keywords_are_one_request():
  options = automap.SearchOptions(budget=automap.Budget(episodes=12), seed=3)
  by_object = automap.search(mlp, *X, mesh=mesh((4, 2)), hardware="cpu", options=options)
  by_keywords = automap.search(mlp, *X, mesh=mesh((4, 2)), hardware="cpu",
                               budget=automap.Budget(episodes=12), seed=3)
  assert by_object.to_json() == by_keywords.to_json()
  step = automap.partition(mlp, mesh=mesh((4, 2)), options=options, cache=False)
  assert step.request == options


def test_search_options_given_twice_or_misspelt_name_the_keyword():
  options = automap.SearchOptions(seed=1)
  with pytest.raises(TypeError, match=r"search\(\) got seed= as keyword\(s\) and options= too"):
    automap.search(mlp, *X, mesh=mesh((4, 2)), options=options, seed=2)
  with pytest.raises(TypeError, match=r"partition\(\) got an unexpected keyword argument 'budjet'"):
    automap.partition(mlp, mesh=mesh((4, 2)), budjet=automap.Budget())
  with pytest.raises(TypeError, match="options must be an automap.SearchOptions"):
    automap.search(mlp, *X, mesh=mesh((4, 2)), options={"seed": 1})
  with pytest.raises(ValueError, match="search must be one of"):
    automap.SearchOptions(search="greedy")
