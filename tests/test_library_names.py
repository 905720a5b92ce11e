"""Argument names as the user's library calls them (`names=`).

Keras keeps state in lists, so a leaf's pytree path is `0/2`; its own name
is the variable's path (`mlp/up/kernel`). Plans, explain, hints, export and
errors speak the names given, and the optimizer state that mirrors named
parameters takes their names too.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mesh
from jax.sharding import PartitionSpec as P

import automap
from automap._src.ir import trace as trace_lib
from automap._src.run.verify import compare_numerics

BUDGET = automap.Budget(episodes=20, seconds=60)
RNG = np.random.default_rng(0)
PARAMS = [jnp.asarray(RNG.standard_normal(s) * 0.1, jnp.float32)
          for s in ((16, 64), (64,), (64, 16))]
NAMES = ["mlp/up/kernel", "mlp/up/bias", "mlp/down/kernel"]
X = jnp.asarray(RNG.standard_normal((32, 16)), jnp.float32)
OPT = optax.adam(1e-2)


def _step(params, opt_state, x):
  def loss(p):
    return jnp.mean((jnp.tanh(x @ p[0] + p[1][None]) @ p[2] - x) ** 2)
  value, grads = jax.value_and_grad(loss)(params)
  updates, opt_state = OPT.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, value


def test_names_replace_the_keys_they_stand_at_and_mirror_into_moments():
  traced = trace_lib.trace(_step, (PARAMS, OPT.init(PARAMS), X), names=(NAMES, None, "batch"))
  assert traced.in_paths == (
      "0/mlp/up/kernel", "0/mlp/up/bias", "0/mlp/down/kernel", "1/0/count",
      "1/0/mu/mlp/up/kernel", "1/0/mu/mlp/up/bias", "1/0/mu/mlp/down/kernel",
      "1/0/nu/mlp/up/kernel", "1/0/nu/mlp/up/bias", "1/0/nu/mlp/down/kernel", "batch")
  # Results at an argument's default path take its name: carried state pairs up.
  assert traced.out_paths == traced.in_paths[:-1] + ("2",)


def test_a_string_names_a_whole_argument():
  traced = trace_lib.trace(_step, (PARAMS, OPT.init(PARAMS), X),
                           names=("params", "opt_state", None))
  assert traced.in_paths[:4] == ("params/0", "params/1", "params/2", "opt_state/0/count")
  assert traced.in_paths[-1] == "2"


def test_names_of_another_structure_are_refused_with_the_mismatch():
  args = (PARAMS, OPT.init(PARAMS), X)
  mismatch = "(?s)prefix of the arguments.*names\\[0\\].*length 2"
  with pytest.raises(automap.ArgumentError, match=mismatch):
    trace_lib.trace(_step, args, names=(NAMES[:2], None, None))
  with pytest.raises(automap.ArgumentError, match="two argument leaves the name '0/w'"):
    trace_lib.trace(_step, args, names=(["w", "w", "v"], None, None))
  with pytest.raises(automap.ArgumentError, match="non-empty string"):
    trace_lib.trace(_step, args, names=(["w", 3, "v"], None, None))


@pytest.mark.heavy
def test_plans_hints_and_export_speak_the_given_names():
  m = mesh((4, 2))
  args = (PARAMS, OPT.init(PARAMS), X)
  hints = automap.Hints(fixed={"0/mlp/up/kernel": P(None, "model"),
                                "1/0/mu/mlp/up/kernel": P(None, "model")})
  step = automap.partition(_step, mesh=m, hardware="cpu", budget=BUDGET, cache=False,
                           names=(NAMES, None, None), hints=hints)
  new_params, _, loss = step(*args)
  expected = jax.jit(_step)(*args)
  assert compare_numerics(expected[0], new_params)[1] < 1e-5
  assert abs(float(loss) - float(expected[2])) < 1e-5
  plan = step.plan
  specs = dict(zip(plan.in_paths, plan.in_specs))
  assert specs["0/mlp/up/kernel"] == P(None, "model")
  # An optimizer moment takes its parameter's name, in hints as in plans.
  assert specs["1/0/mu/mlp/up/kernel"] == P(None, "model")
  assert "0/mlp/up/kernel" in plan.explain()
  # Export matches the list as the function took it, or by the names.
  assert plan.specs(PARAMS)[0] == P(None, "model")
  sub = plan.specs({"up": {"kernel": PARAMS[0]}}, at="0/mlp")
  assert sub == {"up": {"kernel": P(None, "model")}}
  report = step.verify(*args)
  assert report.max_rel_error < 1e-5


def test_a_renamed_program_is_cached_apart(tmp_path):
  m = mesh((4, 2))
  args = (PARAMS, OPT.init(PARAMS), X)
  plain = automap.search(_step, *args, mesh=m, hardware="cpu", budget=BUDGET, cache=tmp_path)
  named = automap.search(_step, *args, mesh=m, hardware="cpu", budget=BUDGET, cache=tmp_path,
                         names=(NAMES, None, None))
  assert plain.in_paths[0] == "0/0" and named.in_paths[0] == "0/mlp/up/kernel"
  again = automap.search(_step, *args, mesh=m, hardware="cpu", budget=BUDGET, cache=tmp_path,
                         names=(NAMES, None, None))
  assert again.stats.get("cached") and again.in_paths == named.in_paths


def test_keras_variables_are_named_by_their_paths():
  os.environ.setdefault("KERAS_BACKEND", "jax")
  keras = pytest.importorskip("keras")
  if keras.backend.backend() != "jax":
    pytest.skip("keras runs on another backend in this process")
  with jax.numpy_rank_promotion("allow"):  # keras broadcasts its biases
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(64, activation="relu", name="up"),
                              keras.layers.Dense(16, name="down")], name="mlp")
    loss_fn = keras.losses.MeanSquaredError()
    trainable = [v.value for v in model.trainable_variables]
    fixed = [v.value for v in model.non_trainable_variables]

    def step(trainable, fixed, opt_state, x):  # keras' own JAX training loop
      def loss(t):
        pred, new_fixed = model.stateless_call(t, fixed, x)
        return loss_fn(x, pred), new_fixed
      (value, new_fixed), grads = jax.value_and_grad(loss, has_aux=True)(trainable)
      updates, opt_state = OPT.update(grads, opt_state, trainable)
      return optax.apply_updates(trainable, updates), new_fixed, opt_state, value

    names = ([v.path for v in model.trainable_variables], None, None, None)
    args = (trainable, fixed, OPT.init(trainable), X)
    step_p = automap.partition(step, mesh=mesh((4, 2)), hardware="cpu", budget=BUDGET,
                               cache=False, names=names,
                               hints=automap.Hints(fixed={"0/mlp/up/kernel": P(None, "model")}))
    out = step_p(*args)
    assert compare_numerics(jax.jit(step)(*args), out)[1] < 1e-5
    paths = step_p.plan.in_paths
    assert paths[:4] == ("0/mlp/up/kernel", "0/mlp/up/bias", "0/mlp/down/kernel",
                         "0/mlp/down/bias")
    assert "2/0/nu/mlp/down/bias" in paths
    text = step_p.plan.explain()
    assert "0/mlp/up/kernel" in text and "0/0 " not in text


@pytest.mark.heavy
def test_penzai_parameters_are_named_by_their_labels():
  """penzai's pytree paths leave its labels out (`0/7/value/data_array`);
  automap names each parameter, and the moments that mirror it, by label."""
  pytest.importorskip("penzai")
  import outside_steps

  step = outside_steps.penzai_transformer(outside_steps.TINY)
  step_p = automap.partition(step.fn, mesh=mesh((4, 2)), hardware="cpu", budget=BUDGET,
                             cache=False)
  out = step_p(*step.args)
  # AdamW moves every weight by about its learning rate (1e-3): a wrong
  # layout errs by that much, rounding by far less.
  assert compare_numerics(jax.jit(step.fn)(*step.args), out)[1] < 1e-3
  paths = step_p.plan.in_paths
  query = "transformer/block_0/attention/query.weights/value/data_array"
  assert f"0/{query}" in paths and f"1/0/mu/{query}" in paths
  assert not any(p.startswith("0/0/") for p in paths)


def test_state_a_step_returns_unwrapped_is_its_state_not_its_data():
  """penzai's trainer takes each parameter (and each Adam moment) as a
  `Parameter` holding a `NamedArray` (`.../value/data_array`) and returns
  the new array under the parameter's own path: those arguments are the
  model's state, and data parallelism leaves them whole; the batch and the
  random key are the data."""
  pytest.importorskip("penzai")
  import outside_steps

  from automap._src.plan import planner
  from automap._src.search.actions import ActionSpace
  from automap._src.search.tactics import expert_states, state_arguments

  step = outside_steps.penzai_trainer(outside_steps.TINY)
  m = mesh((4, 2))
  traced = planner.trace(step.fn, step.args, m, names=step.names)
  state = state_arguments(traced)
  arrays = [(p, s) for p, a, s in zip(traced.in_paths, traced.in_avals, state) if a.shape]
  assert [p for p, s in arrays if not s] == ["4/batch"]
  assert sum(p.endswith("value/data_array") for p, s in arrays if s) == 3 * 21
  program = planner.build_program(step.fn, step.args, m, automap.HARDWARE["cpu"],
                                  names=step.names)
  dp = expert_states(program, ActionSpace(program))["data parallel"]
  g = program.graph
  split = [p for p, v in zip(traced.in_paths, g.inputs) if (dp[v] >= 0).any()]
  assert split == ["4/batch"]
