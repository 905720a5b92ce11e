"""Your layout: the shardings a program's author already wrote, read from the
arguments (placed arrays, flax partitioning metadata, `layout=`, a keras
LayoutMap), priced beside the plan as "your layout", the default of
`evaluate`, and on request the search's start (never ending worse)."""

from __future__ import annotations

import os
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import automap
from automap._src.ir import trace as trace_lib
from automap._src.run.verify import compare_numerics
from automap._src.sharding import annotations
from automap._src.sharding.mesh import MeshSpec

M = mesh((4, 2))
BUDGET = automap.Budget(episodes=30, seconds=60)
RNG = np.random.default_rng(0)
PARAMS = {"up": jnp.asarray(RNG.standard_normal((64, 256)) * 0.1, jnp.float32),
          "down": jnp.asarray(RNG.standard_normal((256, 64)) * 0.1, jnp.float32)}
X = jnp.asarray(RNG.standard_normal((32, 64)), jnp.float32)
MEGATRON = {"up": P(None, "model"), "down": P("model")}
RULES = [("batch", "data"), ("embed", None), ("mlp", "model")]


def _step(p, x):
  def loss(p):
    return jnp.mean(jnp.tanh(x @ p["up"]) @ p["down"])
  g = jax.grad(loss)(p)
  return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)


def _placed():
  params = jax.device_put(PARAMS, {k: NamedSharding(M, s) for k, s in MEGATRON.items()})
  return params, jax.device_put(X, NamedSharding(M, P("data", None)))


def _search(fn, *args, **kw):
  return automap.search(fn, *args, mesh=M, hardware="cpu", budget=BUDGET, **kw)


def test_placed_arguments_are_your_layout_priced_as_evaluate_prices_them():
  params, x = _placed()
  plan = _search(_step, params, x)
  written = automap.evaluate(_step, PARAMS, X, mesh=M, hardware="cpu",
                             in_shardings=(MEGATRON, P("data", None)))
  # evaluate's default is the layout the arguments are placed in, as jax.jit's.
  assert automap.evaluate(_step, params, x, mesh=M, hardware="cpu") == written
  yours = plan.yardsticks["your layout"]
  assert yours.cost == written
  assert "your layout" in plan.explain()
  # Arrays not placed on the mesh state nothing: no yardstick.
  assert "your layout" not in _search(_step, PARAMS, X).yardsticks


def test_arrays_placed_for_another_mesh_state_nothing_here():
  other = mesh((2, 4))
  params = jax.device_put(PARAMS, {k: NamedSharding(other, s) for k, s in MEGATRON.items()})
  traced = trace_lib.trace(_step, (params, X))
  read = annotations.read(traced.dynamic_args((params, X)), traced.in_paths, MeshSpec.of(M))
  assert not read.stated


def _trimmed(spec: P) -> tuple:
  """A spec's entries without trailing whole dims (`P("a", None)` is `P("a")`)."""
  entries = tuple(spec)
  while entries and entries[-1] is None:
    entries = entries[:-1]
  return entries


def _nnx_step(graphdef):
  def step(state, x):
    def loss(s):
      return jnp.mean(nnx.merge(graphdef, s)(x) ** 2)
    g = jax.grad(loss)(state)
    return jax.tree.map(lambda a, b: a - 0.1 * b, state, g)
  return step


class MLP(nnx.Module):
  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    self.up = nnx.Linear(64, 256, kernel_init=nnx.with_partitioning(init, (None, "model")),
                         rngs=rngs)
    self.down = nnx.Linear(256, 64, kernel_init=nnx.with_partitioning(init, ("model", None)),
                           rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.relu(self.up(x)))


def test_nnx_partitioning_metadata_is_read_concrete_or_abstract():
  with jax.set_mesh(M):
    model = MLP(nnx.Rngs(0))
    abstract = nnx.eval_shape(lambda: MLP(nnx.Rngs(0)))
  graphdef, state = nnx.split(model)
  _, abstract_state = nnx.split(abstract)
  step = _nnx_step(graphdef)
  traced = trace_lib.trace(step, (state, X))
  read = annotations.read(traced.dynamic_args((state, X)), traced.in_paths, MeshSpec.of(M))
  expected = jax.tree.leaves(nnx.get_partition_spec(state),
                             is_leaf=lambda s: isinstance(s, P))
  assert [_trimmed(s) for s in read.specs[:-1]] == [_trimmed(s) for s in expected]
  concrete = _search(step, state, X).yardsticks["your layout"].cost
  shaped = _search(step, abstract_state, jax.ShapeDtypeStruct(X.shape, X.dtype))
  assert shaped.yardsticks["your layout"].cost == concrete


class Logical(nn.Module):
  @nn.compact
  def __call__(self, x):
    init = nn.initializers.lecun_normal()
    h = nn.Dense(256, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
    return nn.Dense(64, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(
        jax.nn.relu(h))


def _linen_step(variables, x):
  g = jax.grad(lambda v: jnp.mean(Logical().apply(v, x) ** 2))(variables)
  return jax.tree.map(lambda a, b: a - 0.1 * b, variables, g)


def test_linen_logical_names_resolve_through_the_rules_given_or_active():
  variables = Logical().init(jax.random.key(0), X)
  with pytest.warns(automap.LayoutWarning, match="'embed'.*logical axis name.*layout_rules"):
    plan = _search(_linen_step, variables, X)
  assert "your layout" not in plan.yardsticks
  given = _search(_linen_step, variables, X, layout_rules=RULES)
  with nn.logical_axis_rules(RULES):
    active = _search(_linen_step, variables, X)
  specs = nn.logical_to_mesh(nn.get_partition_spec(variables), RULES)
  by_hand = automap.evaluate(_linen_step, variables, X, mesh=M, hardware="cpu",
                             in_shardings=(specs, P()))
  assert given.yardsticks["your layout"].cost == active.yardsticks["your layout"].cost == by_hand
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _search(_linen_step, variables, X, layout=False)  # reads nothing, warns nothing


def test_layout_given_as_a_prefix_tree_or_path_patterns():
  prefix = _search(_step, PARAMS, X, layout=(MEGATRON, P("data", None)))
  patterns = _search(_step, PARAMS, X, layout={"0/up": P(None, "model"),
                                               "0/down": ("model", None), "1": P("data")})
  placed = _search(_step, *_placed())
  assert (prefix.yardsticks["your layout"].cost == patterns.yardsticks["your layout"].cost
          == placed.yardsticks["your layout"].cost)


def test_a_layout_asked_for_that_does_not_fit_is_an_error_naming_the_argument():
  with pytest.raises(automap.LayoutError, match="'0/up'.*'tensor'"):
    _search(_step, PARAMS, X, layout=({"up": P(None, "tensor"), "down": None}, None))
  with pytest.raises(automap.MeshError, match="0/up"):  # 64 rows over 3 axes of 8
    _search(_step, PARAMS, X, layout=({"up": P(("data", "model", None)), "down": None}, None))
  with pytest.raises(automap.LayoutError, match="prefix of the arguments"):
    _search(_step, PARAMS, X, layout=([P()], None))


def test_starting_from_your_layout_never_ends_worse_and_runs_exactly():
  params, x = _placed()
  budget = automap.Budget(episodes=2, seconds=60)
  step = automap.partition(_step, mesh=M, hardware="cpu", budget=budget, cache=False,
                           start="your layout")
  out = step(params, x)
  plan = step.plan
  assert plan.cost.step_time <= plan.yardsticks["your layout"].cost.step_time
  assert compare_numerics(jax.jit(_step)(PARAMS, X), out)[1] < 1e-5
  with pytest.raises(ValueError, match="start must be one of"):
    automap.SearchOptions(start="mine")


def test_your_layout_enters_the_cache_key(tmp_path):
  plain = _search(_step, PARAMS, X, cache=tmp_path)
  placed = _search(_step, *_placed(), cache=tmp_path)
  assert "your layout" not in plain.yardsticks
  assert "your layout" in placed.yardsticks and not placed.stats.get("cached")


def test_a_keras_layout_map_reaches_variables_and_their_optimizer_slots():
  os.environ.setdefault("KERAS_BACKEND", "jax")
  keras = pytest.importorskip("keras")
  if keras.backend.backend() != "jax":
    pytest.skip("keras runs on another backend in this process")
  import optax

  with jax.numpy_rank_promotion("allow"):  # keras broadcasts its biases
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, name="up"),
                              keras.layers.Dense(64, name="down")], name="mlp")
    layout_map = keras.distribution.LayoutMap(keras.distribution.DeviceMesh(
        (4, 2), ["data", "model"], jax.devices()))
    layout_map["mlp/up/kernel"] = (None, "model")
    layout_map[".*down/kernel"] = ("model", None)
    opt = optax.adam(1e-3)
    trainable = [v.value for v in model.trainable_variables]

    def step(trainable, opt_state, x):
      def loss(t):
        return jnp.mean(model.stateless_call(t, [], x)[0] ** 2)
      grads = jax.grad(loss)(trainable)
      updates, opt_state = opt.update(grads, opt_state, trainable)
      return optax.apply_updates(trainable, updates), opt_state

    names = ([v.path for v in model.trainable_variables], None, None)
    args = (trainable, opt.init(trainable), X)
    traced = trace_lib.trace(step, args, names=names)
    read = annotations.read(traced.dynamic_args(args), traced.in_paths, MeshSpec.of(M),
                            layout_map)
    stated = {p: s for p, s in zip(traced.in_paths, read.specs) if s is not None}
    assert stated == {
        "0/mlp/up/kernel": P(None, "model"), "0/mlp/down/kernel": P("model"),
        "1/0/mu/mlp/up/kernel": P(None, "model"), "1/0/mu/mlp/down/kernel": P("model"),
        "1/0/nu/mlp/up/kernel": P(None, "model"), "1/0/nu/mlp/down/kernel": P("model")}
    plan = _search(step, *args, names=names, layout=layout_map)
    assert "your layout" in plan.yardsticks
